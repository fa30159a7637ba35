"""A cold GGUF -> HF-folder conversion (what a first start with a GGUF model pays once),
into a fresh temporary cache, with and without reading the file once:

    python -m bench.gguf_convert                 # the default model's GGUF, both ways
    python -m bench.gguf_convert --gguf model.gguf --repeat 3

Each conversion runs in its own interpreter, so imports are paid as a first start pays them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = """
import sys, time
import srt.model_loader.gguf_convert as gc
if sys.argv[2] == "every-read":
    gc._gguf_read_once = __import__("contextlib").nullcontext
tic = time.perf_counter()
gc.convert_gguf(sys.argv[1], cache_dir=sys.argv[3])
print(time.perf_counter() - tic)
"""


def convert_once(gguf: str, mode: str) -> tuple[float, float]:
    """(seconds inside `convert_gguf`, seconds of the whole interpreter)."""
    with tempfile.TemporaryDirectory() as cache:
        tic = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-c", CHILD, gguf, mode, cache],
            check=True,
            capture_output=True,
            text=True,
        )
        return float(out.stdout.split()[-1]), time.perf_counter() - tic


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", help="a GGUF file (default: the default model's)")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args(argv)
    if args.gguf is None:
        from srt.model_loader.default_model import find_default_gguf

        args.gguf = str(find_default_gguf())
    report: dict = {"gguf": args.gguf}
    for mode in ("every-read", "read-once"):
        runs = [convert_once(args.gguf, mode) for _ in range(args.repeat)]
        report[mode] = {
            "convert_s": round(statistics.median(r[0] for r in runs), 2),
            "process_s": round(statistics.median(r[1] for r in runs), 2),
        }
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
