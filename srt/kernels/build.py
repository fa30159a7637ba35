"""Build, cache and load the compiled CPU kernels of `csrc/`, and keep per-machine plans.

Build: `gcc -O3 -fopenmp -shared` with `-march=native`, or `-march=x86-64-v3` when
`ATEN_CPU_CAPABILITY=avx2` caps torch to AVX2 (so a capped run measures an AVX2 machine). The
library is cached under `cache_root()/kernels` (`RADIXRT_CACHE_DIR`, default
`~/.cache/radixrt`), named by a hash of every csrc/ source and header, the flags, the compiler
version and the CPU's flags, and written through a temporary file and a rename so concurrent
processes never load a half-written file, and under a lock beside it, so that processes
starting together (tensor-parallel ranks, test workers) compile each source once. The first
kernel a process loads on a machine builds every missing one at once, one compiler per core
(the largest sources take most of the compile time; `docs/tests.md` has the figures). Later
processes only load the files.

`load` wraps a built library (ctypes) for one kernel family, or gives None where it cannot be
built (no C compiler, a failed build, a non-x86 machine): the caller then keeps its torch
path. ctypes releases the GIL for the call, so the overlap loop's scheduler thread runs while
a forward is inside a kernel. The kernels' OpenMP threads come from the libgomp torch has
already loaded (same soname), with `torch.get_num_threads()` threads.

`kept_plan` keeps a measured per-machine choice (which matmul kernel runs what) in a JSON
file under a lock, so every process on a machine runs the same kernels.
"""

from __future__ import annotations

import ctypes
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from srt import environ

if TYPE_CHECKING:  # building needs only a C compiler: `tests/install.sh` builds before torch
    import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
# Sources whose library calls into others' libraries (linked, found beside it) instead of
# compiling them again: decode_layer.c's attention is paged_decode.c's, whose specialised
# cases take most of a build (`docs/tests.md` has the compile times).
LINKED: dict[str, tuple[str, ...]] = {"decode_layer.c": ("paged_decode.c",)}
T = TypeVar("T")
P = TypeVar("P")  # a plan dataclass (`kept_plan`)


def cache_dir() -> Path:
    """Where built libraries and measured plans are kept."""
    return environ.cache_root() / "kernels"


def _march() -> str:
    return "-march=x86-64-v3" if environ.cpu_capped_to_avx2() else "-march=native"


def cpu_flags() -> str:
    """The CPU's flags line from /proc/cpuinfo (else the processor name): part of every cache
    key, so a library or plan never moves to another CPU."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


@dataclasses.dataclass(frozen=True)
class _Build:
    """How csrc/ sources compile here: the compiler, its flags, and what names a library."""

    compiler: str
    flags: tuple[str, ...]
    fingerprint: str  # every source and header, the flags, the compiler version, the CPU

    @classmethod
    def here(cls) -> _Build:
        compiler = shutil.which(environ.C_COMPILER.get()) or shutil.which("cc")
        if compiler is None:
            raise RuntimeError("no C compiler (gcc or cc) on PATH")
        flags = (
            "-O3",
            _march(),
            "-fopenmp",
            "-fPIC",
            "-shared",
            "-std=gnu11",
            "-ffp-contract=fast",
        )
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, check=False
        ).stdout
        # Every source and header: a source may include others (decode_layer.c does).
        sources = [f.read_text() for f in sorted(CSRC.glob("*.[ch]"))]
        fingerprint = "\0".join([*sources, " ".join(flags), version, cpu_flags()])
        return cls(compiler, flags, fingerprint)

    def target(self, source: str) -> Path:
        key = hashlib.sha256(f"{source}\0{self.fingerprint}".encode()).hexdigest()[:16]
        return cache_dir() / f"{Path(source).stem}-{key}.so"

    def compile(self, source: str) -> Path:
        """The library of csrc/`source`, compiled unless there (by this or another process)."""
        target = self.target(source)
        if target.exists():
            return target
        # The libraries it links against first (each under its own lock), beside it: the
        # loader finds them there by their names ($ORIGIN), wherever the cache is.
        linked = [f"-l:{self.compile(dep).name}" for dep in LINKED.get(source, ())]
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target.with_name(target.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if target.exists():  # another process built it while this one waited
                return target
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                built = Path(tmp) / target.name
                cmd = [self.compiler, *self.flags, str(CSRC / source), "-o", str(built)]
                cmd += [f"-Wl,-soname,{target.name}", "-lm"]
                if linked:
                    cmd += [f"-L{target.parent}", *linked, "-Wl,-rpath,$ORIGIN"]
                result = subprocess.run(cmd, capture_output=True, text=True, check=False)
                if result.returncode != 0:
                    raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr.strip()}")
                os.replace(built, target)
        logger.info("Built CPU kernel %s", target)
        return target


def build_library(source: str) -> Path:
    """Compile csrc/`source` into a cached shared library; return its path.

    Raises RuntimeError naming the command and the compiler's output when the build fails.
    """
    return _Build.here().compile(source)


def build_with_the_rest(source: str) -> Path:
    """`build_library(source)`, compiling every other missing source beside it (`build_all`):
    a process that needs one kernel soon needs the others, and built one at a time they keep
    a core idle for most of a minute. Only `source`'s failure is raised; another source's is
    raised when that source is loaded."""
    target = _Build.here().target(source)
    if target.exists():
        return target
    built = build_all().get(source)
    if built is None:  # not one of csrc/'s sources: its own build names what is missing
        return build_library(source)
    if isinstance(built, RuntimeError):
        raise built
    return built


def build_all() -> dict[str, Path | RuntimeError]:
    """Every csrc/ library, compiled where missing, one compiler per core (those others link
    against first, then the largest): each source's library, or the error that stopped its
    build."""
    how = _Build.here()
    linked_to = {dep for deps in LINKED.values() for dep in deps}
    files = sorted(CSRC.glob("*.c"), key=lambda f: (f.name not in linked_to, -f.stat().st_size))
    sources = [f.name for f in files]
    workers = max(1, min(len(sources), len(os.sched_getaffinity(0))))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {source: pool.submit(how.compile, source) for source in sources}
    built: dict[str, Path | RuntimeError] = {}
    for source, future in futures.items():
        try:
            built[source] = future.result()
        except RuntimeError as exc:
            built[source] = exc
    return built


def builds_here() -> bool:
    """Whether the kernels are built on this machine's architecture (x86-64 only)."""
    return platform.machine() in ("x86_64", "AMD64")


def load(source: str, wrapper: Callable[[ctypes.CDLL], T], what: str) -> T | None:
    """`wrapper` around the library built from csrc/`source`, or None (logged, with why)."""
    if not builds_here():
        logger.info("%s: not built on %s; torch path", what, platform.machine())
        return None
    try:
        return wrapper(ctypes.CDLL(str(build_with_the_rest(source))))
    except (OSError, RuntimeError) as exc:
        logger.warning("%s unavailable, using the torch path: %s", what, exc)
        return None


def has_contiguous_rows(x: torch.Tensor) -> bool:
    """A 2-D tensor whose rows are contiguous (any row stride): what the kernels read."""
    return x.dim() == 2 and x.stride(1) == 1


def median_ms(fn: Callable[[], object], reps: int = 7) -> float:
    """The median wall time of `fn` over `reps` calls after one warm-up call, in ms."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[reps // 2] * 1000


def kept_plan(saved: Path, cls: type[P], measure: Callable[[], P]) -> P:
    """The plan saved in `saved` (JSON of a dataclass `cls`), or `measure()`'s, saved there
    first: made once per file, under a lock beside it, so that every process on a machine
    reads the same plan. An unreadable file is measured again and replaced."""
    saved.parent.mkdir(parents=True, exist_ok=True)
    with open(saved.with_name(saved.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return cls(**json.loads(saved.read_text()))
        except (OSError, ValueError, TypeError):
            pass
        plan = measure()
        tmp = saved.with_name(saved.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(plan)))
        os.replace(tmp, saved)
    return plan


def build_and_report() -> bool:
    """`build_all`, each library's path printed (a failure's error to stderr); False when one
    failed. What `python -m srt.prepare` and `python -m srt.kernels.build` run."""
    ok = True
    for source, built in build_all().items():
        if isinstance(built, Path):
            print(f"kernel {source}: {built}")
        else:
            print(f"kernel {source}: build failed: {built}", file=sys.stderr)
            ok = False
    return ok


if __name__ == "__main__":
    # Only the build, without torch: `tests/install.sh` compiles while it downloads.
    raise SystemExit(0 if not builds_here() or build_and_report() else 1)
