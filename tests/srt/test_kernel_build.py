"""`srt/kernels/build.py`: every C source compiles where a compiler is, the library cache is
keyed by the content of every source and header, and the first load builds every missing
source at once, each once however many processes start together."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from srt.kernels import attention as kernels
from srt.kernels import build

needs_compiler = pytest.mark.skipif(
    shutil.which("gcc") is None and shutil.which("cc") is None, reason="no C compiler"
)
needs_kernel = pytest.mark.skipif(
    kernels.paged_extend_kernel() is None, reason="no C compiler: the kernels cannot build"
)


@needs_compiler
@pytest.mark.parametrize("source", sorted(p.name for p in build.CSRC.glob("*.c")))
def test_every_kernel_source_compiles_where_a_compiler_is(source):
    """Where a compiler exists a kernel must build: a source that stops compiling (one file's
    signature changed, another still calls the old one) would otherwise only show as a
    fallback to the torch path, every kernel test of it skipped."""
    build.build_library(source)  # raises with the compiler's output


@needs_kernel
def test_build_is_cached_by_content(monkeypatch, tmp_path):
    """A fresh cache builds once; a second build returns the same file without compiling."""
    monkeypatch.setenv("RADIXRT_CACHE_DIR", str(tmp_path))
    first = build.build_library("paged_extend.c")  # the quickest source to compile
    assert first.parent == tmp_path / "kernels" and first.exists()
    mtime = first.stat().st_mtime_ns
    assert build.build_library("paged_extend.c") == first
    assert first.stat().st_mtime_ns == mtime
    left = [p for p in (tmp_path / "kernels").iterdir() if p.suffix != ".lock"]
    assert left == [first]  # no temporary left behind


@needs_kernel
def test_build_key_covers_every_source_and_header(monkeypatch, tmp_path):
    """Editing any csrc/ file, even a header the built source does not include, builds anew."""
    monkeypatch.setenv("RADIXRT_CACHE_DIR", str(tmp_path / "cache"))
    csrc = tmp_path / "csrc"
    shutil.copytree(build.CSRC, csrc)
    monkeypatch.setattr(build, "CSRC", csrc)
    first = build.build_library("paged_extend.c")
    with open(csrc / "panels.h", "a") as header:
        header.write("/* edited */\n")
    second = build.build_library("paged_extend.c")
    assert second != first and first.exists() and second.exists()


# A test double for the C compiler: it logs each compile (not `--version`), waits so that two
# processes' builds overlap, then runs the real compiler.
LOGGING_COMPILER = """#!/bin/sh
case "$*" in *" -o "*) echo "$*" >> "{log}"; sleep 0.5;; esac
exec {cc} "$@"
"""


@pytest.fixture
def toy_sources(monkeypatch, tmp_path) -> Path:
    """Three tiny C sources in place of csrc/, an empty cache, and the logging compiler;
    returns the compiler's log."""
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    for i, name in enumerate(("a", "b", "c")):
        (csrc / f"{name}.c").write_text(f"int {name}_value(void) {{ return {i}; }}\n")
    log = tmp_path / "compiles.log"
    compiler = tmp_path / "cc-double"
    real = shutil.which("gcc") or shutil.which("cc")
    compiler.write_text(LOGGING_COMPILER.format(log=log, cc=real))
    compiler.chmod(0o755)
    monkeypatch.setattr(build, "CSRC", csrc)
    monkeypatch.setenv("RADIXRT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(compiler))
    return log


def compiled(log: Path) -> list[str]:
    if not log.exists():
        return []
    lines = log.read_text().splitlines()
    return sorted(Path(arg).name for line in lines for arg in line.split() if arg.endswith(".c"))


@needs_compiler
def test_first_load_builds_every_missing_source(toy_sources):
    lib = build.load("b.c", lambda lib: lib, "toy kernel")
    assert lib is not None and lib.b_value() == 1
    assert compiled(toy_sources) == ["a.c", "b.c", "c.c"]
    assert build.load("c.c", lambda lib: lib, "toy kernel").c_value() == 2
    assert compiled(toy_sources) == ["a.c", "b.c", "c.c"]  # nothing compiled again


@needs_compiler
def test_a_linked_source_calls_the_library_it_is_linked_against(toy_sources, monkeypatch):
    """A source in `LINKED` is built after the libraries it names and calls into them (found
    beside it by name, as decode_layer.c calls paged_decode.c's), not into a copy of its own."""
    csrc = build.CSRC
    (csrc / "c.c").write_text("int a_value(void);\nint c_value(void) { return 40 + a_value(); }\n")
    monkeypatch.setattr(build, "LINKED", {"c.c": ("a.c",)})
    lib = build.load("c.c", lambda lib: lib, "toy kernel")
    assert lib is not None and lib.c_value() == 40
    assert compiled(toy_sources) == ["a.c", "b.c", "c.c"]  # a.c once, for both
    # c's library names a's by its file name, not its path: the cache may move.
    [a_library] = build.cache_dir().glob("a-*.so")
    c_library = Path(lib._name).read_bytes()
    assert a_library.name.encode() in c_library and str(a_library).encode() not in c_library


@needs_compiler
def test_another_sources_failure_is_raised_at_its_own_load(toy_sources):
    (build.CSRC / "broken.c").write_text("this is not C\n")
    assert build.build_with_the_rest("a.c").exists()
    with pytest.raises(RuntimeError, match="broken.c"):
        build.build_library("broken.c")
    assert build.load("broken.c", lambda lib: lib, "toy kernel") is None  # the torch path


@needs_compiler
def test_processes_starting_together_compile_each_source_once(toy_sources):
    code = (
        "import sys; from pathlib import Path; from srt.kernels import build; "
        "build.CSRC = Path(sys.argv[1]); build.build_with_the_rest(sys.argv[2])"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(build.CSRC), source])
        for source in ("a.c", "c.c")
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    assert compiled(toy_sources) == ["a.c", "b.c", "c.c"]


@needs_compiler
def test_build_all_builds_each_source_once_and_names_a_failure(toy_sources):
    (build.CSRC / "broken.c").write_text("this is not C\n")
    built = build.build_all()
    assert sorted(built) == ["a.c", "b.c", "broken.c", "c.c"]
    assert all(built[s].exists() for s in ("a.c", "b.c", "c.c"))
    assert isinstance(built["broken.c"], RuntimeError) and "broken.c" in str(built["broken.c"])
    assert build.build_all()["b.c"] == built["b.c"]
    assert compiled(toy_sources) == ["a.c", "b.c", "broken.c", "broken.c", "c.c"]
