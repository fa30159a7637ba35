"""The GPU path of a step, run on a CPU through a test double of the device's memory
(`device_double.SeparateMemoryDouble`): the real scheduler, model worker and a tiny Llama.

What it proves, per launched batch: the inputs reach the "device" in exactly one copy, from
pinned memory, with no host wait before the forward starts; the overlap loop launches batch
N+1 before it waits for batch N's ids, and that wait is the step's only sync; the launch
path reads no tensor back to the host (a trap on `tolist` / `item` / `__bool__` / `__int__`
/ `__index__` / `__float__`, off only inside the model's own forward, which the GPU run
checks with `torch.cuda.set_sync_debug_mode`); greedy outputs of both loops equal HF's; and
requests finishing, aborted and retracted between overlapped steps free exactly their KV.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from managers.inprocess import InProcessDriver
from managers.model_worker import ModelWorker
from srt.server_args import ServerArgs
from tests.engine.hf_reference import hf_greedy_batch
from tests.engine.shared_worker import release
from tests.engine.tiny_models import save_tiny_model
from tests.managers.device_double import SeparateMemoryDouble
from tests.managers.scripted_worker import assert_idle_and_clean

GREEDY = {"temperature": 0, "ignore_eos": True}
PROMPTS = [[1 + (7 * i + 3 * j) % 500 for j in range(10 + 5 * i)] for i in range(4)]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def memory(monkeypatch: pytest.MonkeyPatch) -> SeparateMemoryDouble:
    double = SeparateMemoryDouble()
    double.install(monkeypatch)
    return double


@contextmanager
def driver(path: Path, overlap: bool, **args: Any) -> Iterator[InProcessDriver]:
    server_args = ServerArgs(
        model_path=str(path),
        dtype="float32",
        skip_tokenizer_init=True,
        max_total_tokens=args.pop("max_total_tokens", 2048),
        disable_overlap_schedule=not overlap,
        **args,
    )
    d = InProcessDriver(server_args, worker=ModelWorker(server_args))
    try:
        yield d
    finally:
        release(d)


def mark_launches(d: InProcessDriver, memory: SeparateMemoryDouble) -> None:
    """Log each launch and the start of each model forward into the double's log."""
    worker = d.worker
    launch = worker.launch

    def logged_launch(mwb: Any, future: Any = None) -> Any:
        memory.mark("launch", mwb.forward_mode.name)
        return launch(mwb, future)

    worker.launch = logged_launch
    worker.model_runner.model.register_forward_pre_hook(lambda *_: memory.mark("forward"))


def test_device_path_greedy_equals_hf_in_both_loops(tiny_llama: Path, memory) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    expected = hf_greedy_batch(hf, PROMPTS, 12)
    for overlap in (True, False):
        with driver(tiny_llama, overlap) as d:
            if overlap:
                assert d.scheduler.forward_worker.threaded is False  # the GPU way
            assert d.worker.model_runner.req_to_token_pool.mirrored
            outs = d.generate(PROMPTS, {"max_new_tokens": 12, **GREEDY})
            assert [o["output_ids"] for o in outs] == expected, f"overlap={overlap}"
            assert_idle_and_clean(d)


def launch_segments(log: list[tuple[Any, ...]]) -> list[list[tuple[Any, ...]]]:
    """The log from each launch to the start of its forward."""
    segments = []
    for i, entry in enumerate(log):
        if entry[0] == "launch":
            end = log.index(("forward",), i)
            segments.append(log[i:end])
    return segments


def test_each_launch_one_pinned_copy_and_no_sync_before_its_forward(
    tiny_llama: Path, memory
) -> None:
    with driver(tiny_llama, overlap=True) as d:
        mark_launches(d, memory)
        d.generate(PROMPTS, {"max_new_tokens": 16, **GREEDY})
        assert_idle_and_clean(d)
    segments = launch_segments(memory.log)
    decodes = [s for s in segments if s[0] == ("launch", "DECODE")]
    assert len(decodes) >= 14
    for segment in segments:
        copies = [e for e in segment if e[0] == "h2d"]
        assert copies and len(copies) == 1 and copies[0][2], segment  # one, from pinned memory
        assert not [e for e in segment if e[0] == "sync"], segment


def test_overlap_launches_the_next_batch_before_waiting_for_ids(tiny_llama: Path, memory) -> None:
    with driver(tiny_llama, overlap=True) as d:
        mark_launches(d, memory)
        d.generate(PROMPTS, {"max_new_tokens": 16, **GREEDY})
    log = memory.log
    forwards = [i for i, e in enumerate(log) if e == ("forward",)]
    # Each forward's result event: the first event recorded after its forward starts and
    # after its ids' copy to pinned memory.
    result_events = []
    for f in forwards:
        d2h = next(i for i in range(f, len(log)) if log[i][0] == "d2h")
        result_events.append(next(log[i][1] for i in range(d2h, len(log)) if log[i][0] == "record"))
    syncs = [(i, e[1]) for i, e in enumerate(log) if e[0] == "sync"]
    assert [seq for _, seq in syncs] == result_events  # one wait per batch, for its ids
    steady = 0
    for n in range(len(forwards) - 1):
        wait_at = next(i for i, seq in syncs if seq == result_events[n])
        if forwards[n + 1] < wait_at:
            steady += 1
    # Every batch but those followed by an idle step (the last, and one per arrival wave)
    # has its successor launched before its ids are waited for.
    assert steady >= len(forwards) - 3, (steady, len(forwards))


class TensorTrap:
    """Records every host read of a tensor (`tolist`, `item`, truth value, `int`, index,
    `float`) while `active`, with the stack that made it."""

    NAMES = ("tolist", "item", "__bool__", "__int__", "__index__", "__float__")

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.active = False
        self.hits: list[str] = []
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, original))

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def trapped(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.active:
                self.hits.append(f"{name}:\n{''.join(traceback.format_stack(limit=6))}")
            return original(tensor, *args, **kwargs)

        return trapped

    @contextmanager
    def off(self) -> Iterator[None]:
        was, self.active = self.active, False
        try:
            yield
        finally:
            self.active = was


def test_launch_path_reads_no_tensor_back(
    tiny_llama: Path, memory, monkeypatch: pytest.MonkeyPatch
) -> None:
    with driver(tiny_llama, overlap=True) as d:
        trap = TensorTrap(monkeypatch)
        worker, runner = d.worker, d.worker.model_runner
        launch, forward = worker.launch, runner.forward

        def trapped_launch(mwb: Any, future: Any = None) -> Any:
            trap.active = True
            try:
                return launch(mwb, future)
            finally:
                trap.active = False

        def model_forward(batch: Any) -> Any:
            with trap.off():  # the model itself: checked on a GPU by sync debug mode
                return forward(batch)

        worker.launch, runner.forward = trapped_launch, model_forward
        d.generate(PROMPTS, {"max_new_tokens": 16, **GREEDY})
        assert_idle_and_clean(d)
    assert not trap.hits, trap.hits[0]


def test_finish_abort_and_retract_between_overlapped_steps_free_their_kv(
    tiny_llama: Path, memory
) -> None:
    """A pool too small for all four requests (retraction), different lengths (finishes
    while the next batch is in flight), one aborted after a retraction: the others' tokens
    equal the normal loop's, and nothing is leaked or double-owned once idle."""
    lengths = [40, 12, 50, 30]

    def run(overlap: bool) -> tuple[dict[int, list[int]], int]:
        with driver(tiny_llama, overlap, max_total_tokens=128, schedule_conservativeness=0.1) as d:
            rids = [
                d.submit(p, {"max_new_tokens": n, **GREEDY})[0]
                for p, n in zip(PROMPTS, lengths, strict=True)
            ]
            for _ in range(200):  # until the pool ran out and a request was retracted
                d.step()
                if d.scheduler.decode.num_retracted_reqs:
                    break
            d.step()
            d.abort(rids[3])
            d.run_until_idle()
            assert_idle_and_clean(d)
            retracted = d.scheduler.decode.num_retracted_reqs
            outs = {i: d.outputs[rid]["output_ids"] for i, rid in enumerate(rids[:3])}
        return outs, retracted

    overlapped, retracted = run(overlap=True)
    assert retracted > 0, "the pool should have been too small for every request"
    normal, _ = run(overlap=False)
    assert overlapped == normal
    assert [len(overlapped[i]) for i in range(3)] == lengths[:3]


def test_sampled_and_logprob_requests_match_the_cpu_path(tiny_llama: Path, memory) -> None:
    """Seeded sampling, penalties, logit_bias, min_new_tokens and logprobs (prompt and output)
    on the GPU path's overlap loop give exactly what the CPU path's normal loop gives: the
    sampling tensors kept on the device between steps, the per-step positions staged, and the
    logprobs copied back all carry the same values."""
    params = [
        {"temperature": 0.8, "top_p": 0.9, "seed": 11},
        {"temperature": 0.7, "top_k": 5, "seed": 12, "frequency_penalty": 0.5},
        {"temperature": 0, "logit_bias": {"7": 5.0}, "min_new_tokens": 6},
        {"temperature": 0, "repetition_penalty": 1.3},
    ]
    extra = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2}

    def run(overlap: bool) -> list[dict[str, Any]]:
        with driver(tiny_llama, overlap) as d:
            outs = [
                d.generate([prompt], {"max_new_tokens": 10, "ignore_eos": True, **p}, **extra)[0]
                for prompt, p in zip(PROMPTS, params, strict=True)
            ]
            assert_idle_and_clean(d)
        return outs

    on_gpu_path = run(overlap=True)
    memory.separate = False  # the CPU path: no mirror, no staging copy, a forward thread
    on_cpu_path = run(overlap=False)
    for a, b in zip(on_gpu_path, on_cpu_path, strict=True):
        assert a["output_ids"] == b["output_ids"]
        for key in ("output_token_logprobs", "input_token_logprobs", "output_top_logprobs"):
            got, want = flatten(a["meta_info"][key]), flatten(b["meta_info"][key])
            assert len(got) == len(want) > 0, key
            for x, y in zip(got, want, strict=True):
                assert x == y if not isinstance(x, float) else abs(x - y) < 1e-5, key


def flatten(value: Any) -> list[Any]:
    """The scalars of nested lists / tuples, in order."""
    if isinstance(value, (list, tuple)):
        return [x for item in value for x in flatten(item)]
    return [value]
