"""The overlap loop's forward thread ends when the process exits: the worker's finalizer (run
at interpreter exit, or when the worker is dropped) tells it to stop and waits for it. A
forward thread still alive while the interpreter finalizes, after it has run torch ops,
aborted the process ("terminate called without an active exception", exit status 134): the
end of every `python -m bench.bench_offline` did."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from managers.overlap_worker import OverlapWorker
from tests.managers.scripted_worker import ScriptedWorker

# The driver stays referenced until the interpreter exits, as in bench_offline's main().
SCRIPT = """
from managers.inprocess import InProcessDriver
from srt.server_args import ServerArgs
driver = InProcessDriver(ServerArgs(model_path=None, dtype="float32", disable_overlap_schedule=False))
out = driver.generate([[5, 6, 7, 8]], {"max_new_tokens": 4, "ignore_eos": True})
print(len(out[0]["output_ids"]))
"""


def test_finalizer_waits_for_the_forward_thread() -> None:
    worker = OverlapWorker(ScriptedWorker(), max_batch_size=4)
    thread = worker.thread
    assert thread.is_alive()
    worker._finalizer()  # what interpreter exit runs
    assert not thread.is_alive()


def test_process_with_an_overlap_driver_exits_cleanly(default_model_path: str) -> None:
    """The default model in process, as bench_offline runs it (this aborted in most runs)."""
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert "terminate called" not in done.stderr
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "4"
