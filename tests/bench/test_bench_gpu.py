"""bench_gpu's arithmetic and config (CPU): roofline, bandwidth by name, the 0.6B shape."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from bench.bench_gpu import (
    decode_step_bytes,
    markdown_table,
    peak_bandwidth,
    roofline_fraction,
    save_qwen3_0_6b_config,
    weight_bytes_read,
)
from srt.configs.model_config import ModelConfig
from srt.model_executor.memory_sizing import kv_bytes_per_token
from tests.srt.test_models import CONFIGS, build_pair


@pytest.mark.parametrize(
    ("name", "tbs"),
    [
        ("NVIDIA H100 80GB HBM3", 3.35),
        ("NVIDIA H200", 4.8),
        ("NVIDIA H100 PCIe", 2.0),
        ("NVIDIA H100 NVL", 3.9),
        ("Tesla T4", None),
    ],
)
def test_peak_bandwidth_by_device_name(name: str, tbs: float | None) -> None:
    got = peak_bandwidth(name)
    assert (got is None) if tbs is None else got == pytest.approx(tbs * 1e12)


def test_roofline_arithmetic() -> None:
    step = decode_step_bytes(weights=1_000_000, batch=4, context_len=100, kv_per_token=1000)
    assert step == 1_000_000 + 400_000
    assert roofline_fraction(step, 1e-3, 2.8e9) == pytest.approx(0.5)
    assert roofline_fraction(step, 1e-3, None) is None


def test_weight_bytes_tied_and_untied() -> None:
    _, tied = build_pair(CONFIGS["qwen3_tied"])
    assert weight_bytes_read(tied) == sum(p.numel() * 4 for p in tied.parameters())
    _, untied = build_pair(CONFIGS["llama"])
    embed = untied.model.embed_tokens.weight.numel() * 4
    assert weight_bytes_read(untied) == sum(p.numel() * 4 for p in untied.parameters()) - embed


def test_qwen3_shaped_config(tmp_path: Path) -> None:
    cfg = ModelConfig.from_path(str(save_qwen3_0_6b_config(tmp_path)), dtype="bfloat16")
    assert cfg.architectures == ["Qwen3ForCausalLM"]
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (28, 16, 8)
    assert cfg.head_dim == 128 and cfg.vocab_size == 151936
    assert kv_bytes_per_token(cfg, torch.bfloat16) == 2 * 28 * 8 * 128 * 2


def test_markdown_table() -> None:
    rows = [{"model": "m", "tok_per_s": 1234.5, "roofline": 0.613, "step_ms": 1.0}]
    table = markdown_table(rows, ["model", "tok_per_s", "step_ms", "roofline", "missing"])
    assert table.splitlines()[2] == "| m | 1,234 | 1.00 | 61.3% |  |"


def test_w1_on_both_loops_shares_one_worker(default_worker: Any) -> None:
    """The overlap on / off rows: two schedulers take the worker's KV pool in turn (the
    first returns its cached pages), on CPU with the default model and a tiny W1."""
    from bench.bench_gpu import bench_w1_loops
    from srt.server_args import ServerArgs

    sargs = ServerArgs(dtype="float32", skip_tokenizer_init=True, max_total_tokens=2048)
    held: list[object] = []
    rows = list(bench_w1_loops(default_worker, sargs, 3, 4, 8, (True, False), held))
    assert [r["workload"] for r in rows] == ["W1x (3 prompts)", "W1x (3 prompts) overlap off"]
    assert all(r["tok_per_s"] > 0 for r in rows)
    assert not held[0].scheduler.forward_worker.thread.is_alive()


def test_freed_after_lets_every_held_object_go(monkeypatch) -> None:
    """On the H200 the graphs-off worker found the graphs-on worker's 120 GiB KV pool still
    allocated: the release loop's variable kept the last driver (and its worker) alive while
    the cache was emptied, so the memory stayed with torch's allocator."""
    import weakref

    from bench import bench_gpu

    class Held:
        pass

    refs: list[weakref.ref] = []
    alive_at_empty_cache: list[list[bool]] = []
    monkeypatch.setattr(
        bench_gpu.torch.cuda,
        "empty_cache",
        lambda: alive_at_empty_cache.append([r() is not None for r in refs]),
    )
    with bench_gpu.freed_after() as held:
        for _ in range(2):
            obj = Held()
            refs.append(weakref.ref(obj))
            held.append(obj)
        del obj
    assert alive_at_empty_cache == [[False, False]]
