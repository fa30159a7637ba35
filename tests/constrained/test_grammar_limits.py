"""Grammar hardening: caps on size, nesting and properties checked before a
compile, several compile threads with one kept for small grammars, and compiles nobody waits
for any more cancelled. Orderings are compared, never absolute times."""

from __future__ import annotations

import json
import threading
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

import pytest
import torch

from constrained import create_grammar_backend
from constrained.base_grammar_backend import (
    SMALL_GRAMMAR_BYTES,
    BaseGrammarBackend,
    GrammarKey,
    is_small,
)
from constrained.limits import GrammarLimitError, GrammarLimits, check_grammar_limits
from managers.errors import RequestError
from managers.req import Req
from managers.scheduler.grammar_queue import GrammarQueue
from managers.validation import check_grammar
from srt.entrypoints.openai.serving_utils import name_grammar_field
from srt.sampling.sampling_params import SamplingParams
from tests.constrained.helpers import AcceptAllMatcher

LIMITS = GrammarLimits(max_bytes=65536, max_depth=20, max_properties=1000)
WAIT_S = 30  # a bound for waits that only fail on a broken implementation


def nested(levels: int, kind: str = "object") -> str:
    """`levels` objects (or arrays, or anyOf wrappers) around an integer, built as text so
    that even thousands of levels need no recursion here."""
    opening = {
        "object": '{"type": "object", "properties": {"a": ',
        "array": '{"type": "array", "items": ',
        "anyOf": '{"anyOf": [{"type": "null"}, ',
    }[kind]
    closing = {"object": "}}", "array": "}", "anyOf": "]}"}[kind]
    return opening * levels + '{"type": "integer"}' + closing * levels


def refused(field: str, spec: str, limits: GrammarLimits = LIMITS) -> GrammarLimitError:
    with pytest.raises(GrammarLimitError) as info:
        check_grammar_limits(field, spec, limits)
    assert info.value.field == field
    return info.value


def flat_object(properties: int, required: bool = False, leaf: Any = None) -> dict[str, Any]:
    names = [f"p{i}" for i in range(properties)]
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {k: leaf if leaf is not None else {"type": "string"} for k in names},
    }
    if required:
        schema["required"] = names
    return schema


# ---- depth --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["object", "array", "anyOf"])
def test_depth_at_the_cap_passes_one_more_is_refused(kind: str) -> None:
    check_grammar_limits("json_schema", nested(20, kind), LIMITS)
    err = refused("json_schema", nested(21, kind))
    assert "--grammar-max-depth" in err.message and "20" in err.message


def test_the_probe_1000_deep_array_schema_is_refused_without_compiling() -> None:
    spec = nested(1000, "array")  # the probe's 40 KB schema compiled for ~75 s
    assert len(spec) < LIMITS.max_bytes
    refused("json_schema", spec)


def test_nesting_deeper_than_python_can_parse_is_refused_as_too_deep() -> None:
    spec = "[" * 100_000 + "]" * 100_000  # json.loads raises RecursionError
    err = refused("json_schema", spec, GrammarLimits(max_bytes=10**6))
    assert "--grammar-max-depth" in err.message


def test_leaves_and_keywords_that_hold_no_schema_add_no_depth() -> None:
    # 20 objects whose leaves carry data (`enum`, `examples`) nested far deeper than 20.
    data = json.loads("[" * 40 + "]" * 40)
    spec = nested(20).replace('{"type": "integer"}', json.dumps({"enum": [data]}))
    check_grammar_limits("json_schema", spec, LIMITS)


def test_recursive_refs_pass_and_terminate() -> None:
    tree = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "value": {"type": "integer"},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                },
            }
        },
        "$ref": "#/$defs/node",
    }
    linked_list = {"type": "object", "properties": {"next": {"$ref": "#"}}}
    mutual = {
        "definitions": {
            "a": {"type": "object", "properties": {"b": {"$ref": "#/definitions/b"}}},
            "b": {"type": "array", "items": {"$ref": "#/definitions/a"}},
        },
        "$ref": "#/definitions/a",
    }
    sizes = [
        check_grammar_limits("json_schema", json.dumps(s), LIMITS)
        for s in (tree, linked_list, mutual)
    ]
    assert [size.properties for size in sizes] == [2, 1, 1]  # each schema counted once


def test_refs_count_as_the_schema_they_name() -> None:
    defs = {
        f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}}
        for i in range(25)
    }
    defs["d25"] = {"type": "string"}
    refused("json_schema", json.dumps({"$defs": defs, "$ref": "#/$defs/d0"}))


def test_a_ref_used_at_many_places_is_walked_once() -> None:
    """Every definition refers to the next one twice: walked naively that is 2^19 paths."""
    defs = {
        f"d{i}": {
            "type": "object",
            "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}, "y": {"$ref": f"#/$defs/d{i + 1}"}},
        }
        for i in range(19)
    }
    defs["d19"] = {"type": "string"}
    check_grammar_limits("json_schema", json.dumps({"$defs": defs, "$ref": "#/$defs/d0"}), LIMITS)


def test_an_endless_chain_of_ref_aliases_is_refused() -> None:
    chain = {f"a{i}": {"$ref": f"#/$defs/a{i + 1}"} for i in range(5000)}
    spec = json.dumps({"$defs": chain, "$ref": "#/$defs/a0"})
    refused("json_schema", spec, GrammarLimits(max_bytes=10**6))


# ---- size and properties ------------------------------------------------------------------


@pytest.mark.parametrize("field", ["json_schema", "regex", "ebnf"])
def test_size_is_capped_in_bytes_for_every_kind(field: str) -> None:
    small = GrammarLimits(max_bytes=100)
    check_grammar_limits(field, "é" * 50, small)  # 100 bytes
    err = refused(field, "é" * 51, small)  # 51 characters, 102 bytes
    assert (
        err.message.startswith(f"`{field}` is 102 bytes")
        and "--grammar-max-schema-bytes" in err.message
    )


def test_properties_are_counted_across_the_schema_and_its_definitions() -> None:
    check_grammar_limits("json_schema", json.dumps(flat_object(1000)), LIMITS)
    err = refused("json_schema", json.dumps(flat_object(1001, leaf={})))
    assert "--grammar-max-properties" in err.message
    split = flat_object(600)
    split["$defs"] = {"unused": flat_object(401)}  # compiled or not, it is counted
    refused("json_schema", json.dumps(split))


def test_regex_and_ebnf_are_not_parsed_as_json_and_invalid_json_is_left_to_the_compiler() -> None:
    for field, spec in (("regex", nested(50)), ("ebnf", "root ::= [0-9]+"), ("json_schema", "{")):
        assert check_grammar_limits(field, spec, LIMITS).bytes == len(spec)


def test_validation_names_the_field_and_openai_names_the_schema_source() -> None:
    params = SamplingParams(json_schema=nested(30))
    with pytest.raises(RequestError) as info:
        check_grammar(params, LIMITS)
    assert info.value.param == "json_schema" and info.value.status_code == 400
    assert name_grammar_field(info.value, "tools").param == "tools"
    with pytest.raises(RequestError) as info:
        check_grammar(SamplingParams(regex="a" * 70_000), LIMITS)
    assert info.value.param == "regex"
    assert name_grammar_field(info.value, "tools").param == "regex"  # not from the schema
    check_grammar(SamplingParams(regex="[0-9]+"), LIMITS)


# ---- compile threads ----------------------------------------------------------------------


class Compiled:
    def __init__(self, key: GrammarKey) -> None:
        self.key = key


class GatedBackend(BaseGrammarBackend):
    """Compiles at once, except specs in `gates`, which wait for their event."""

    def __init__(self, compile_threads: int) -> None:
        super().__init__(compile_threads=compile_threads)
        self.gates: dict[str, threading.Event] = {}
        self.started: list[str] = []

    def compile(self, key: GrammarKey) -> Compiled:
        self.started.append(key.spec)
        gate = self.gates.get(key.spec)
        if gate is not None:
            assert gate.wait(WAIT_S)
        return Compiled(key)

    def new_matcher(self, compiled: Compiled) -> AcceptAllMatcher:
        return AcceptAllMatcher()

    def allocate_mask(self, batch_size: int) -> torch.Tensor:
        return torch.zeros(batch_size, 1)

    def apply_mask(self, logits: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> None:
        pass


def big(name: str) -> GrammarKey:
    """A schema too big for the small-grammar thread."""
    return GrammarKey("regex", name + "x" * SMALL_GRAMMAR_BYTES)


def test_a_slow_compile_leaves_the_other_threads_free() -> None:
    backend = GatedBackend(compile_threads=3)  # two for any grammar, one for small ones
    slow, fast = big("slow"), big("fast")
    backend.gates[slow.spec] = threading.Event()
    slow_future = backend.compile_async(slow)
    fast_future = backend.compile_async(fast)
    done, _ = wait([slow_future, fast_future], WAIT_S, FIRST_COMPLETED)
    assert done == {fast_future} and not slow_future.done()
    backend.gates[slow.spec].set()
    assert slow_future.result(WAIT_S).key == slow


def test_with_one_thread_a_slow_compile_delays_the_next() -> None:
    """The contrast: what `--grammar-compile-threads 1` (the old behaviour) does."""
    backend = GatedBackend(compile_threads=1)
    slow, fast = big("slow"), GrammarKey("regex", "[0-9]+")
    backend.gates[slow.spec] = threading.Event()
    backend.compile_async(slow)
    fast_future = backend.compile_async(fast)
    assert wait([fast_future], 0.2).not_done == {fast_future}  # the gate holds it, not time
    backend.gates[slow.spec].set()
    assert fast_future.result(WAIT_S).key == fast


def test_a_flood_of_big_grammars_never_delays_a_small_one() -> None:
    backend = GatedBackend(compile_threads=2)
    gate = threading.Event()
    flood = [big(f"big{i}") for i in range(8)]
    for key in flood:
        backend.gates[key.spec] = gate
    flood_futures = [backend.compile_async(key) for key in flood]
    small = backend.compile_async(GrammarKey("json_schema", json.dumps(flat_object(5))))
    done, _ = wait([small, *flood_futures], WAIT_S, FIRST_COMPLETED)
    assert done == {small}
    gate.set()
    assert all(f.result(WAIT_S) for f in flood_futures)


def test_patterns_are_counted_so_a_schema_full_of_them_is_not_small() -> None:
    patterned = flat_object(8, leaf={"type": "string", "pattern": "[a-z]{1,20}"})
    patterned["patternProperties"] = {"^x": {}, "^y": {}}
    size = check_grammar_limits("json_schema", json.dumps(patterned), LIMITS)
    assert size.patterns == 10 and size.properties == 8 and size.bytes < SMALL_GRAMMAR_BYTES
    assert not is_small(size)
    assert is_small(check_grammar_limits("json_schema", json.dumps(flat_object(8)), LIMITS))


def test_concurrent_requests_for_one_grammar_share_one_compile() -> None:
    backend = GatedBackend(compile_threads=4)
    key = big("shared")
    backend.gates[key.spec] = threading.Event()
    futures = [backend.compile_async(key) for _ in range(5)]
    assert all(f is futures[0] for f in futures)
    backend.gates[key.spec].set()
    futures[0].result(WAIT_S)
    assert backend.started == [key.spec]


def test_a_grammar_over_a_cap_fails_at_once_and_is_neither_compiled_nor_cached() -> None:
    backend = GatedBackend(compile_threads=2)
    key = GrammarKey("json_schema", nested(30))
    future = backend.compile_async(key)
    assert future.done() and isinstance(future.exception(), GrammarLimitError)
    assert key not in backend.cache and backend.started == []


def make_req(rid: str) -> Req:
    return Req(rid, [1, 2, 3], SamplingParams(), sampling_seed=0)


def test_a_compile_nobody_waits_for_is_cancelled_before_it_starts() -> None:
    backend = GatedBackend(compile_threads=1)
    busy = big("busy")
    backend.gates[busy.spec] = threading.Event()
    backend.compile_async(busy)  # holds the only thread
    queue = GrammarQueue(timeout_s=60)
    waiting, shared_a, shared_b = make_req("waiting"), make_req("a"), make_req("b")
    queue.add(waiting, backend.compile_async(big("queued")))
    shared = backend.compile_async(big("shared"))
    queue.add(shared_a, shared)
    queue.add(shared_b, shared)

    queue.remove_if(lambda r: r.rid in ("waiting", "a"))  # aborted
    assert queue.entries[0].req is shared_b and not shared.cancelled(), "b still waits for it"
    queued = backend.cache.hit(big("queued"))
    assert queued is not None and queued.cancelled()

    # A cancelled future in the cache is a miss: the next request compiles again.
    again = backend.compile_async(big("queued"))
    assert again is not queued and not again.cancelled()
    backend.gates[busy.spec].set()
    again.result(WAIT_S)
    assert big("queued").spec in backend.started


def test_a_timed_out_request_cancels_its_queued_compile() -> None:
    queue = GrammarQueue(timeout_s=0.0)
    pending: Future = Future()
    queue.add(make_req("late"), pending)
    ready, failed = queue.pop_done(lambda c: c, block=False)
    assert ready == [] and [r.rid for r in failed] == ["late"]
    assert "did not finish within" in failed[0].finished_reason.message
    assert pending.cancelled()


def test_the_scheduler_reports_a_refused_grammar_with_its_own_message() -> None:
    queue = GrammarQueue(timeout_s=60)
    req = make_req("deep")
    refusal: Future = Future()
    refusal.set_exception(GrammarLimitError("json_schema", "`json_schema` nests too deep"))
    queue.add(req, refusal)
    _, failed = queue.pop_done(lambda c: c, block=False)
    assert failed == [req]
    assert req.finished_reason.to_json() == {
        "type": "abort",
        "message": "`json_schema` nests too deep",
        "status_code": 400,
    }


# ---- the real compiler --------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(default_model_path: str) -> Any:
    pytest.importorskip("xgrammar")
    from srt.model_loader.sources import get_tokenizer

    return get_tokenizer(default_model_path)


def test_xgrammar_compiles_in_parallel(tokenizer: Any) -> None:
    """A slow schema (700 optional properties: about a second) and a cheap one submitted
    after it on the general threads: the cheap one is ready first, which it could not be if
    the compiler held the GIL or the threads were one."""
    backend = create_grammar_backend(
        "xgrammar",
        tokenizer,
        len(tokenizer),
        [tokenizer.eos_token_id],
        compile_threads=3,
        isolation="thread",
    )
    assert backend is not None
    slow = GrammarKey("json_schema", json.dumps(flat_object(700, leaf={})))
    cheap = GrammarKey("json_schema", json.dumps(flat_object(300, required=True)))
    assert len(cheap.spec) > SMALL_GRAMMAR_BYTES  # so it shares the slow one's thread pool
    slow_future = backend.compile_async(slow)
    cheap_future = backend.compile_async(cheap)
    done, _ = wait([slow_future, cheap_future], 120, FIRST_COMPLETED)
    assert done == {cheap_future}
    slow_future.result(120)
