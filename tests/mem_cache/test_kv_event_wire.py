"""The KV-event wire format as SGLang's and vLLM's own event structs read it: tagged msgpack maps
in an array batch (issue 44). SGLang's structs are loaded from the installed package; vLLM's are
pinned below from its source (vllm 0.33.0, `vllm/distributed/kv_events.py`) and mirrored, and
checked against the real ones where vllm is installed. A release that changes the structs we
target fails `test_*_structs_are_the_ones_we_target`, not our users."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from dataclasses import asdict
from typing import Any

import msgpack
import pytest
import torch

from mem_cache.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventRecorder,
    encode_records,
    expand,
    namespace_seed,
    namespaced,
    page_digests,
    public_hashes,
)
from mem_cache.radix_cache import RadixCache
from tests.mem_cache.kv_event_helpers import sglang_kv_events

# (name, required) per field, in order; the tag (None: untagged) and array_like of each struct.
Fields = list[tuple[str, bool]]
SGLANG_STRUCTS: dict[str, tuple[str | None, bool, Fields]] = {  # sglang 0.5.23
    "KVEventBatch": (None, True, [("ts", True), ("events", True), ("attn_dp_rank", False)]),
    "BlockStored": ("BlockStored", False, [
        ("block_hashes", True), ("parent_block_hash", True), ("token_ids", True),
        ("block_size", True), ("lora_id", True), ("medium", False), ("cache_salt", False),
        ("session_id", False), ("lora_name", False),
    ]),
    "BlockRemoved": ("BlockRemoved", False, [("block_hashes", True), ("medium", False)]),
    "AllBlocksCleared": ("AllBlocksCleared", False, []),
}  # fmt: skip
VLLM_STRUCTS: dict[str, tuple[str | None, bool, Fields]] = {  # vllm 0.33.0
    "KVEventBatch": (None, True, [("ts", True), ("events", True), ("data_parallel_rank", False)]),
    "BlockStored": ("BlockStored", False, [
        ("block_hashes", True), ("parent_block_hash", True), ("token_ids", True),
        ("block_size", True), ("lora_id", True), ("medium", True), ("lora_name", True),
        ("extra_keys", False), ("group_idx", False), ("kv_cache_spec_kind", False),
        ("kv_cache_spec_sliding_window", False), ("locality", False), ("ownership", False),
        ("session_id", False), ("lookahead_token_ids", False),
    ]),
    "BlockRemoved": ("BlockRemoved", False, [
        ("block_hashes", True), ("medium", True), ("group_idx", False), ("locality", False),
        ("ownership", False),
    ]),
    "AllBlocksCleared": ("AllBlocksCleared", False, []),
}  # fmt: skip
_HASH = bytes | int  # vLLM's ExternalBlockHash
_VLLM_TYPES: dict[str, Any] = {
    "ts": float, "block_hashes": list[_HASH], "parent_block_hash": _HASH | None,
    "token_ids": list[int], "block_size": int, "lora_id": int | None, "medium": str | None,
    "lora_name": str | None, "extra_keys": list[tuple[Any, ...] | None] | None,
    "lookahead_token_ids": list[list[int]] | None, "group_idx": int | None,
    "kv_cache_spec_sliding_window": int | None, "data_parallel_rank": int | None,
}  # fmt: skip


def struct_shape(cls: type) -> tuple[str | None, bool, Fields]:
    import msgspec

    config = cls.__struct_config__
    assert config.tag_field in (None, "type")
    fields = [(f.name, f.required) for f in msgspec.structs.fields(cls)]
    return config.tag, config.array_like, fields


def vllm_mirror() -> type:
    """vLLM's KVEventBatch rebuilt from VLLM_STRUCTS (vllm itself is not installed here)."""
    msgspec = pytest.importorskip("msgspec")

    types = dict(_VLLM_TYPES)

    def build(name: str) -> type:
        tag, array_like, fields = VLLM_STRUCTS[name]
        spec = [
            (f, types.get(f, str | None)) if req else (f, types.get(f, str | None), None)
            for f, req in fields
        ]
        return msgspec.defstruct(
            name, spec, tag=tag or None, array_like=array_like, omit_defaults=True
        )

    types["events"] = list[build("BlockStored") | build("BlockRemoved") | build("AllBlocksCleared")]
    return build("KVEventBatch")


def recorded(dynamo: bool = False) -> list:
    """A step's worth of records from a real tree: stores that chain, a branch, a namespace,
    an eviction and a clear."""
    tree = RadixCache(2)
    rec = KVEventRecorder(namespaced=dynamo)
    tree.record_events(rec)
    for tokens, key in (([1, 2, 3, 4], None), ([1, 2, 3, 4, 5, 6], None), ([1, 2, 9, 9], None),
                        ([1, 2], "tenant")):  # fmt: skip
        tree.insert(tokens, torch.arange(len(tokens)), key)
    tree.evict(2)
    tree.reset()
    return rec.take()


def test_events_are_tagged_maps_in_an_array_batch() -> None:
    events = [
        BlockStored([-5, 7], None, [1, 2, 3, 4], 2),
        BlockStored([9], -5, [5, 6], 2),  # not a continuation of 7: its own event
        BlockRemoved([-5]),
        BlockRemoved([7]),  # consecutive removals: one event
        AllBlocksCleared(),
    ]
    payload = KVEventBatch(12.5, events).encode()
    stored = {"type": "BlockStored", "lora_id": None, "medium": "GPU", "lora_name": None}
    assert msgpack.unpackb(payload) == [
        12.5,
        [
            stored | {"block_hashes": [-5, 7], "parent_block_hash": None,
                      "token_ids": [1, 2, 3, 4], "block_size": 2},
            stored | {"block_hashes": [9], "parent_block_hash": -5, "token_ids": [5, 6],
                      "block_size": 2},
            {"type": "BlockRemoved", "block_hashes": [-5, 7], "medium": "GPU"},
            {"type": "AllBlocksCleared"},
        ],
        0,
    ]  # fmt: skip
    assert KVEventBatch.decode(payload).events == [
        events[0], events[1], BlockRemoved([-5, 7]), events[4]
    ]  # fmt: skip
    # The publisher's path (records straight to bytes) gives the same bytes.
    records = recorded()
    assert encode_records(records, 3.0) == KVEventBatch(3.0, expand(records)).encode()


@pytest.mark.parametrize("dynamo", [False, True])
def test_sglang_decodes_our_batches(dynamo: bool) -> None:
    sgl = sglang_kv_events()  # skips without sglang or msgspec
    import msgspec

    records = recorded(dynamo)
    payload = encode_records(records, 7.5)
    batch = msgspec.msgpack.Decoder(sgl.KVEventBatch).decode(payload)
    assert (batch.ts, batch.attn_dp_rank) == (7.5, 0)
    ours = expand(records)
    assert [type(e).__name__ for e in batch.events] == [type(e).__name__ for e in ours]
    for theirs, mine in zip(batch.events, ours, strict=True):
        known = msgspec.structs.asdict(theirs)  # every field SGLang's struct shares with ours
        assert {k: v for k, v in asdict(mine).items() if k in known} == {
            k: known[k] for k in asdict(mine) if k in known
        }
        assert not isinstance(mine, BlockStored) or known["lora_name"] is None
    # The array form we sent before issue 44 is what SGLang's decoder refused.
    with pytest.raises(msgspec.ValidationError, match="Expected `object`, got `array`"):
        msgspec.msgpack.Decoder(sgl.KVEventBatch).decode(
            msgpack.packb([1.0, [["BlockRemoved", [1], "GPU"]], 0])
        )


def test_vllm_decodes_our_batches() -> None:
    batch_type = vllm_mirror()  # skips without msgspec
    import msgspec

    payload = encode_records(recorded(), 2.0)
    batch = msgspec.msgpack.Decoder(batch_type).decode(payload)
    assert [type(e).__name__ for e in batch.events] == [
        "BlockStored", "BlockStored", "BlockStored", "BlockRemoved", "AllBlocksCleared"
    ]  # fmt: skip
    assert batch.data_parallel_rank == 0 and batch.events[0].lora_name is None
    # What vLLM's encoder writes for the same events is our payload, key for key (not byte for
    # byte: msgspec gives a struct of 16 or more fields a 16-bit map header, however few it
    # writes).
    assert msgpack.unpackb(msgspec.msgpack.encode(batch)) == msgpack.unpackb(payload)


def test_sglang_structs_are_the_ones_we_target() -> None:
    sgl = sglang_kv_events()
    for name, shape in SGLANG_STRUCTS.items():
        assert struct_shape(getattr(sgl, name)) == shape, f"sglang's {name} changed"


def test_vllm_structs_are_the_ones_we_target() -> None:
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    for name, shape in VLLM_STRUCTS.items():
        assert struct_shape(getattr(kv_events, name)) == shape, f"vllm's {name} changed"


def test_what_we_send_is_what_both_require() -> None:
    """Every required field of both is sent; every field sent is one both know."""
    sent = {k for k in msgpack.unpackb(encode_records(recorded(), 0.0))[1][0]} - {"type"}
    for structs in (SGLANG_STRUCTS, VLLM_STRUCTS):
        fields = structs["BlockStored"][2]
        assert {f for f, required in fields if required} <= sent <= {f for f, _ in fields}


def test_dynamo_hashes_are_sglangs_namespaced_hashes() -> None:
    sgl = sglang_kv_events()
    for key in ("tenant", "", "ключ"):
        seed = namespace_seed(key)
        assert seed == sgl.kv_event_namespace_seed(extra_key=key, cache_salt=None)
        for h in (-(2**63), -1, 0, 12345, 2**63 - 1):
            assert namespaced([h], seed) == [sgl.namespaced_block_hash(h, namespace_seed=seed)]
    assert namespace_seed(None) is None and namespaced([5], None) == [5]


# The packages on the way to SGLang's hash module are stood in for by bare namespaces: their
# __init__ files import all of sglang (~8 s), and the module needs none of it.
_NATIVE = """
import importlib.util, json, sys, types
try:
    root = importlib.util.find_spec("sglang").submodule_search_locations[0]
    for name in ("sglang", "sglang.srt", "sglang.srt.utils", "sglang.srt.mem_cache"):
        package = types.ModuleType(name)
        package.__path__ = [root + name[len("sglang"):].replace(".", "/")]
        sys.modules[name] = package
    from sglang.srt.mem_cache.cpp_utils.native_hash import get_native_hash
    cases = json.loads(sys.argv[1])
    out = [get_native_hash(tokens, None, page) for tokens, page in cases]
except Exception as e:  # no compiler, no OpenSSL headers, an sglang that moved it
    out = {"skip": repr(e)}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_page_hashes_equal_sglangs_native_hash() -> None:
    """SGLang's own C++ page hash (built on first use), run in a child process so its
    package's imports stay out of this one."""
    if importlib.util.find_spec("sglang") is None:  # not importorskip: that imports it all
        pytest.skip("sglang is not installed")
    cases = [(list(range(100, 150)), 16), ([7, 2**32 - 1, 0, 5], 1), (list(range(1, 41)), 4)]
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_NATIVE), json.dumps(cases)],
        capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if isinstance(result, dict):
        pytest.skip(f"SGLang's native hash did not load: {result['skip']}")
    for (tokens, page), hexes in zip(cases, result, strict=True):
        full = len(tokens) // page
        expected = [int(h[:16], 16) - (2**64 if int(h[:16], 16) >= 2**63 else 0) for h in hexes]
        assert public_hashes(page_digests(tokens, page, None)) == expected[:full]
