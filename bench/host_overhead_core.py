"""The measurement core of `bench/host_overhead.py`, run in a child process per configuration.

It builds a real `ModelWorker` and `Scheduler` on CPU for a tiny Llama (dummy weights), swaps
the worker's model for `NoOpModel`, brings `batch` requests into steady decode and times
`scheduler.step()` wall clock: what remains is the host's cost of a decode step. The parent
runs this file by path with only the tree under test on PYTHONPATH (`python -P`, so bench/ is
not on sys.path), so it imports nothing from bench/ and only APIs every compared tree has.

    PYTHONPATH=. python -P bench/host_overhead_core.py '{"loop": "normal", "batch": 64}' OUT.json
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# Small enough that the sampler's compiled argmax stays on one thread up to batch 511 (see
# SERIAL_ELEMENTS in srt/kernels/csrc/layer_ops.c): with a no-op forward nothing keeps the
# OpenMP team awake, and waking it (a whole time slice on a loaded 2-core machine) would
# swamp the host figures.
VOCAB = 64
NOOP_TOKEN = 7  # what NoOpModel's logits pick: not EOS (VOCAB - 1)
PROMPT_LEN = 8
READY_STEP_LIMIT = 200  # steps allowed until every request has its first token


class Unsupported(Exception):
    """The tree under test cannot run this configuration (the GPU path on a CPU needs
    `StandInMemory`)."""


@dataclass
class Config:
    # "normal" or "overlap"; with "-gpu" the GPU path's host work, on this CPU
    # (`device_memory.StandInMemory`), where the tree has it.
    loop: str
    batch: int
    steps: int = 200
    warmup: int = 10
    stream: bool = True
    profile_path: str | None = None
    profile_top: int = 40


class NoOpModel:
    """Test double for the model: its forward does no work and returns float32 logits
    `[len(forward_batch.logits_indices), vocab]` whose argmax is always `NOOP_TOKEN`, sliced
    from one buffer allocated up front. It records each forward's row count, so the
    benchmark can prove the timed steps decoded the whole batch."""

    def __init__(self, vocab: int, max_rows: int) -> None:
        import torch

        self.logits = torch.zeros(max_rows, vocab, dtype=torch.float32)
        self.logits[:, NOOP_TOKEN] = 1.0
        self.rows: list[int] = []

    def __call__(self, input_ids: Any, positions: Any, forward_batch: Any) -> Any:
        rows = forward_batch.logits_indices
        n = forward_batch.batch_size if rows is None else len(rows)  # None: one per request
        self.rows.append(n)
        return self.logits[:n]


def write_model_folder(folder: Path) -> str:
    """A tiny Llama config (no weights: the worker loads it with --load-format dummy)."""
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,  # head_dim 64, as the models served: the CPU kernels take it
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        eos_token_id=VOCAB - 1,
        bos_token_id=1,
        tie_word_embeddings=True,
        architectures=["LlamaForCausalLM"],
        dtype="float32",
    ).save_pretrained(folder)
    return str(folder)


def measure(cfg: Config) -> dict[str, Any]:
    """Time `cfg.steps` steady decode steps of `cfg.batch` requests; return the figures.

    Uses only APIs that both trees compared have: `ServerArgs`, `ModelWorker(server_args,
    model_config)`, `Scheduler(server_args, worker, output_sink)`, `handle`, `step`,
    `worker.model_runner.model`, `forward_batch.logits_indices`."""
    import torch

    from managers.io_struct import TokenizedGenerateReqInput
    from managers.model_worker import ModelWorker
    from managers.scheduler.loop import Scheduler
    from srt.configs.model_config import ModelConfig
    from srt.sampling.sampling_params import SamplingParams
    from srt.server_args import ServerArgs

    loop = cfg.loop.removesuffix("-gpu")
    if cfg.loop.endswith("-gpu"):
        stand_in_for_a_gpu()
    max_new = READY_STEP_LIMIT + cfg.warmup + cfg.steps + 8
    with tempfile.TemporaryDirectory(prefix="host-overhead-") as tmp:
        args = ServerArgs(
            model_path=write_model_folder(Path(tmp)),
            load_format="dummy",
            dtype="float32",
            device="cpu",
            skip_tokenizer_init=True,
            max_total_tokens=2 * cfg.batch * (PROMPT_LEN + max_new) + 1024,
            max_running_requests=cfg.batch,
            disable_overlap_schedule=loop == "normal",
            # So no two requests share KV: with this vocabulary many prompts begin with the
            # same token, and the CPU attention backend would group them by shared prefix every
            # step, work that random prompts over a real vocabulary never cause. A decode step
            # touches the prefix cache only to ask what it could evict.
            disable_radix_cache=True,
        )
        model_config = ModelConfig.from_path(args.model_path, dtype="float32", device="cpu")
        worker = ModelWorker(args, model_config)
    model = NoOpModel(VOCAB, cfg.batch * (PROMPT_LEN + 1))
    worker.model_runner.model = model
    sent: list[Any] = []  # the sink only appends: its cost stays out of the figures
    scheduler = Scheduler(args, worker, sent.append)
    params = {"max_new_tokens": max_new, "ignore_eos": True, "temperature": 0.0}
    for i in range(cfg.batch):
        prompt = [(i * PROMPT_LEN + j) % (VOCAB - 2) + 1 for j in range(PROMPT_LEN)]
        sampling = SamplingParams(**params)
        scheduler.handle(TokenizedGenerateReqInput(f"r{i}", prompt, sampling, stream=cfg.stream))

    started: set[str] = set()
    ready_steps = 0
    while len(started) < cfg.batch:
        if ready_steps == READY_STEP_LIMIT:
            raise RuntimeError(f"{len(started)}/{cfg.batch} requests started decoding")
        scheduler.step()
        ready_steps += 1
        started.update(out.rid for batch in sent for out in batch.outputs)
        sent.clear()
    for _ in range(cfg.warmup):
        scheduler.step()
    sent.clear()
    first_timed_forward = len(model.rows)

    profiler = None
    if cfg.profile_path:
        import cProfile

        profiler = cProfile.Profile()
    times: list[float] = []
    clock = time.perf_counter
    for _ in range(cfg.steps):
        if profiler is not None:
            profiler.enable()
        t0 = clock()
        scheduler.step()
        t1 = clock()
        if profiler is not None:
            profiler.disable()
        times.append(t1 - t0)
    emitted = sum(len(batch.outputs) for batch in sent)

    timed_rows = model.rows[first_timed_forward:]
    if len(timed_rows) < cfg.steps - 1 or any(n != cfg.batch for n in timed_rows):
        raise RuntimeError(f"timed forwards were not all batch {cfg.batch}: {set(timed_rows)}")
    if cfg.stream and emitted != cfg.steps * cfg.batch:
        raise RuntimeError(f"{emitted} outputs over {cfg.steps} steps of {cfg.batch}")
    forward_worker = getattr(scheduler, "forward_worker", None)
    if forward_worker is not None and hasattr(forward_worker, "stop"):
        forward_worker.stop()  # the overlap loop's forward thread, where it has one
    if profiler is not None and cfg.profile_path:
        write_profile(profiler, cfg)

    us = [t * 1e6 for t in times]  # in step order
    ranked = sorted(us)
    return {
        **asdict(cfg),
        "median_us": statistics.median(us),
        "p90_us": ranked[int(0.9 * (len(ranked) - 1))],
        "mean_us": statistics.fmean(us),
        "samples_us": us,
        "ready_steps": ready_steps,
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
    }


def stand_in_for_a_gpu() -> None:
    """Make every module that asks `device_memory` get `StandInMemory` for the CPU."""
    try:
        from srt.utils import device_memory
    except ImportError as e:
        raise Unsupported("no GPU path to run on a CPU in this tree") from e
    import managers.overlap_worker
    import mem_cache.memory_pool
    import srt.model_executor.model_runner

    def pick(device: Any) -> Any:
        return device_memory.StandInMemory(device)

    for module in (managers.overlap_worker, mem_cache.memory_pool, srt.model_executor.model_runner):
        module.device_memory = pick


def write_profile(profiler: Any, cfg: Config) -> None:
    import io
    import pstats

    assert cfg.profile_path is not None
    text = io.StringIO()
    text.write(f"# cProfile: {cfg.steps} decode steps, {cfg.loop} loop, batch {cfg.batch}\n")
    text.write("# (main thread only: the overlap loop's forward thread is not profiled)\n")
    for key in ("cumulative", "tottime"):
        text.write(f"\n## top {cfg.profile_top} by {key}\n")
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(cfg.profile_top)
    Path(cfg.profile_path).write_text(text.getvalue())


if __name__ == "__main__":
    try:
        result = measure(Config(**json.loads(sys.argv[1])))
    except Unsupported as e:
        result = {"unsupported": str(e)}
    Path(sys.argv[2]).write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # no wait on the overlap loop's forward thread or native teardown
