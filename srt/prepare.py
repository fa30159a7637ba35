"""`python -m srt.prepare`: do ahead of time what the first server start on a machine does once.

python -m srt.prepare                                 # the default model
python -m srt.prepare --model-path /models/x.gguf    # another model

A machine's first start compiles the CPU kernels, times the float32 matmul libraries (and the
bf16 kernels where they are built), converts a GGUF file to a folder the loader reads, and
snapshots the model's config; every later start reads all four from the cache root
(`RADIXRT_CACHE_DIR`, default `~/.cache/radixrt`). Running this first moves that minute out of
the first start: into an image build, or beside another job that leaves a core idle (the test
command runs it beside its slowest install step, `tests/install.sh`). It serves nothing, and
exits non-zero when the model cannot be found or a kernel fails to build.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time


def _kernels() -> bool:
    """Build every kernel, then make the plans a process measures on first use."""
    from srt.kernels.build import build_and_report

    ok = build_and_report()
    from srt.kernels.linear import packed_linear_kernel
    from srt.layers.cpu_packed import f32_matmul_plan

    kernel = packed_linear_kernel()  # measures the bf16 plan where bf16 kernels are built
    if kernel is not None and kernel.bf16_plan is not None:
        print(f"bf16 matmuls: {kernel.bf16_plan.describe()}")
    print(f"float32 matmuls: {f32_matmul_plan().describe()}")
    return ok


def _model(model_path: str | None) -> None:
    """Convert the model where it is a GGUF file, and snapshot its config."""
    from srt.configs.hf_config_cache import load_hf_config
    from srt.model_loader.sources import resolve_model_path

    folder = resolve_model_path(model_path)
    load_hf_config(folder)
    print(f"model: {folder}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m srt.prepare", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--model-path", default=None, help="as for launch_server; default: the default model"
    )
    parser.add_argument("--skip-kernels", action="store_true", help="only prepare the model")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from srt.model_loader.default_model import ModelNotFoundError

    start = time.perf_counter()
    ok = True
    from srt.kernels.build import builds_here

    if not args.skip_kernels and builds_here():
        ok = _kernels()
    try:
        _model(args.model_path)
    except ModelNotFoundError as exc:
        print(f"model: {exc}", file=sys.stderr)
        ok = False
    print(f"prepared in {time.perf_counter() - start:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
