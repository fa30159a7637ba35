"""`bench.bench_one_batch` on a tiny random Llama: timings, greedy tokens equal to the
scheduler's, no KV leaked, and the CLI's JSON lines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.bench_one_batch import random_prompts, run_one_batch
from managers.inprocess import InProcessDriver
from managers.model_worker import ModelWorker
from mem_cache.chunk_cache import ChunkCache
from mem_cache.integrity import check_memory_integrity
from srt.server_args import ServerArgs
from tests.engine.tiny_models import VOCAB, save_tiny_model

REPO = Path(__file__).resolve().parents[2]
INPUT_LEN, OUTPUT_LEN = 12, 6
KEYS = {
    "run_name",
    "batch_size",
    "input_len",
    "output_len",
    "prefill_latency",
    "prefill_throughput",
    "median_decode_latency",
    "median_decode_throughput",
    "total_latency",
    "overall_throughput",
}


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory) -> str:
    return str(save_tiny_model("llama", tmp_path_factory.mktemp("llama")))


def test_run_one_batch_matches_scheduler_greedy(llama_path: str) -> None:
    worker = ModelWorker(ServerArgs(model_path=llama_path, dtype="float32", max_total_tokens=256))
    driver = InProcessDriver(
        ServerArgs(
            model_path=llama_path,
            dtype="float32",
            skip_tokenizer_init=True,
            max_total_tokens=4096,
            disable_overlap_schedule=True,
        )
    )
    req_to_token_pool, allocator = worker.get_memory_pool()
    for bs, seed in ((1, 0), (3, 7)):
        result = run_one_batch(worker, bs, INPUT_LEN, OUTPUT_LEN, seed)
        assert KEYS | {"output_ids"} == set(result)
        assert (result["batch_size"], result["input_len"]) == (bs, INPUT_LEN)
        for key in KEYS - {"run_name", "batch_size", "input_len", "output_len"}:
            assert result[key] > 0, key
        prompts = random_prompts(bs, INPUT_LEN, VOCAB, seed)
        ref = driver.generate(
            prompts, {"max_new_tokens": OUTPUT_LEN, "temperature": 0, "ignore_eos": True}
        )
        assert result["output_ids"] == [r["output_ids"] for r in ref]
        assert allocator.available_size() == allocator.total_size()
        assert req_to_token_pool.available_size() == req_to_token_pool.size
        check_memory_integrity(allocator, ChunkCache())


def test_cli_writes_json_lines(llama_path: str, tmp_path: Path) -> None:
    out = tmp_path / "result.jsonl"
    cmd = [sys.executable, "-m", "bench.bench_one_batch", "--model-path", llama_path]
    cmd += ["--load-format", "dummy", "--dtype", "float32", "--batch-size", "1", "2"]
    cmd += ["--input-len", "8", "--output-len", "3", "--result-filename", str(out)]
    proc = subprocess.run(cmd, check=False, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("Prefill. latency:") == 2
    assert "Decode.  median latency:" in proc.stdout
    assert "Total. latency:" in proc.stdout
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["batch_size"] for r in lines] == [1, 2]
    assert all(set(r) == KEYS and r["total_latency"] > 0 for r in lines)
