"""`LeaderStepSource` / `FollowerStepSource` over the real control group of two rank
processes (the `tp2` fixture): every rank gets rank 0's step inputs, in order, empty ones
included. The schedulers' lockstep on those inputs is `tests/managers/test_tp_step_sync.py`."""

from __future__ import annotations

from typing import Any

from managers.io_struct import (
    AbortReq,
    FlushCacheReq,
    GetInternalStateReq,
    StepInput,
    TokenizedGenerateReqInput,
)
from managers.tp_sync import FollowerStepSource, LeaderStepSource, StepSource
from srt.distributed import TPGroup
from srt.sampling.sampling_params import SamplingParams


class ListSource:
    """Test double of rank 0's local source: the given steps, one per call."""

    def __init__(self, steps: list[StepInput]) -> None:
        self.left = list(steps)

    def next_step(self, idle: bool) -> StepInput:
        return self.left.pop(0)


def broadcast_steps(tp: TPGroup, steps: list[StepInput]) -> list[StepInput]:
    """Runs on every rank: rank 0 sends `steps`, the others receive them."""
    source: StepSource
    if tp.is_leader:
        source = LeaderStepSource(ListSource(steps), tp)
    else:
        source = FollowerStepSource(tp)
    return [source.next_step(idle=False) for _ in steps]


def test_every_rank_gets_rank_0s_steps(tp2: Any) -> None:
    req = TokenizedGenerateReqInput("a", [5, 6, 7], SamplingParams(max_new_tokens=3))
    steps = [
        StepInput([req, AbortReq("a")], 10.0, [1, 2]),
        StepInput([], 10.5, []),  # empty steps go out too: the lockstep
        StepInput([FlushCacheReq(), GetInternalStateReq()], 11.0, None),
    ]
    on_leader, on_follower = tp2.run(broadcast_steps, steps)
    assert on_leader == steps
    assert on_follower == steps
