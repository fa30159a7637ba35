"""`srt/kernels/build.py`: every C source compiles where a compiler is, and the library cache
is keyed by the content of every source and header."""

from __future__ import annotations

import shutil

import pytest

from srt.kernels import attention as kernels
from srt.kernels import build

needs_kernel = pytest.mark.skipif(
    kernels.paged_extend_kernel() is None, reason="no C compiler: the kernels cannot build"
)


@pytest.mark.skipif(
    shutil.which("gcc") is None and shutil.which("cc") is None, reason="no C compiler"
)
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
    assert list((tmp_path / "kernels").iterdir()) == [first]  # no temporary left behind


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
