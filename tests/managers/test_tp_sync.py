"""The pieces of tensor-parallel lockstep (`managers/tp_sync.py`) on their own: the step clock,
the leader's local step source, and how a lost peer is found and ends the process. The
lockstep of two whole schedulers is `test_tp_step_sync.py`."""

from __future__ import annotations

import subprocess
import sys

from managers.io_struct import StepInput
from managers.tp_sync import LocalStepSource, StepClock, exit_if_peer_lost, peer_lost
from srt.distributed import TPPeerLost
from srt.utils.process import TP_PEER_LOST_EXIT_CODE
from tests.managers.scripted_io import ScriptedSocket, ScriptedTime


def test_step_clock_reads_the_step_time_and_live_reads_monotonic() -> None:
    clock = StepClock()
    clock.set(12.5)
    assert clock() == 12.5 and clock() == 12.5
    live = StepClock(live=True)
    live.set(-1.0)
    assert live() > 0


def test_local_source_drains_everything_and_blocks_only_when_idle() -> None:
    socket, wall = ScriptedSocket(), ScriptedTime()
    asked: list[bool] = []

    def grammar_done(may_wait: bool) -> list[int]:
        asked.append(may_wait)
        return [3]

    source = LocalStepSource(socket, grammar_done, wall)  # type: ignore[arg-type]
    socket.queue.extend(["a", "b", "c"])
    step = source.next_step(idle=True)
    assert step == StepInput(["a", "b", "c"], 1000.0, [3])
    assert source.next_step(idle=True) == StepInput([], 1000.0, [3])
    assert asked == [False, True]  # waits for a compile only when nothing else arrived
    assert LocalStepSource(socket).next_step(idle=False).grammar_done is None  # type: ignore[arg-type]


def test_peer_lost_is_found_behind_the_forward_threads_error() -> None:
    lost = TPPeerLost("TP rank 1: all_reduce failed: Connection closed by peer")
    try:
        try:
            raise lost
        except TPPeerLost as e:
            raise RuntimeError("the model worker failed") from e
    except RuntimeError as wrapped:
        assert peer_lost(wrapped) is lost
    assert peer_lost(RuntimeError("the model worker failed")) is None
    exit_if_peer_lost(ValueError("not a peer"), 0)  # returns: other errors are not ours


def test_a_lost_peer_ends_the_process_with_its_exit_code() -> None:
    code = (
        "from managers.tp_sync import exit_if_peer_lost\n"
        "from srt.distributed import TPPeerLost\n"
        "from srt.utils.process import configure_logging\n"
        "configure_logging('info', 'scheduler rank 1')\n"
        "try:\n"
        "    raise TPPeerLost('TP rank 1: broadcast_object failed: Connection closed by peer')\n"
        "except TPPeerLost as e:\n"
        "    exit_if_peer_lost(RuntimeError('wrapped'), 1)  # not from a peer: returns\n"
        "    exit_if_peer_lost(e, 1)\n"
        "raise SystemExit(5)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == TP_PEER_LOST_EXIT_CODE, done.stderr
    assert "TP rank 1: lost a peer (TP rank 1: broadcast_object failed" in done.stderr
