"""Tensor-parallel lockstep of the scheduler (`managers/tp_sync.py`), in one process.

A leader and a follower `Scheduler`, each with its own scripted worker, step on the same
`StepInput`s: the leader's come from the real `LocalStepSource` (over a scripted socket and
a scripted clock), and the follower gets a pickled copy of each, as the broadcast would give
it. The two grammar backends are test doubles: the leader's compiles finish when the script
says, the follower's on a timer thread a moment after they start (later than the leader's),
and one never finishes on the leader but does on the follower. Deadlines of all three kinds
expire, requests are aborted, the KV pool is small enough to force retraction, and flushes
and state queries arrive. After every step the queues, the radix trees, the KV allocators,
the request rows and the outputs of the two schedulers must be equal.

The sources over the real control group of two rank processes are tested in
`tests/distributed/test_tp_step_sources.py` (the `tp2` fixture lives there).
"""

from __future__ import annotations

import pickle
import random
import threading
from concurrent.futures import Future
from typing import Any

import pytest
import torch

from constrained.base_grammar_backend import BaseGrammarObject, GrammarError, GrammarKey
from managers.io_struct import (
    AbortReq,
    BatchTokenIDOut,
    FlushCacheReq,
    GetInternalStateReq,
    StepInput,
    TokenizedGenerateReqInput,
)
from managers.scheduler import Scheduler
from managers.tp_sync import (
    LocalStepSource,
    StepClock,
)
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs
from tests.managers.scripted_io import ScriptedSocket, ScriptedTime
from tests.managers.scripted_worker import ScriptedWorker

STEP_S = 0.5  # scripted seconds between two steps
FOLLOWER_COMPILE_S = 0.05  # real seconds the follower's compiles take


# ---- test doubles --------------------------------------------------------------------------
class CountingMatcher(BaseGrammarObject):
    """Test double of a matcher: accepts every token, terminates after `length` of them."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.accepted = 0

    def accept_token(self, token: int) -> bool:
        self.accepted += 1
        return True

    def fill_vocab_mask(self, mask: torch.Tensor, row: int) -> None:
        pass

    def is_terminated(self) -> bool:
        return self.accepted >= self.length

    def rollback(self, num_tokens: int) -> None:
        self.accepted -= num_tokens


class ScriptedGrammarBackend:
    """Test double of a grammar backend. A spec "len-N" compiles to a matcher that ends after
    N tokens, "invalid" fails to compile, "slow" never finishes on the leader. With
    `compile_s` None (the leader), compiles finish only when the script calls `release`;
    otherwise each finishes on a timer thread `compile_s` after it started, "slow" included."""

    def __init__(self, compile_s: float | None) -> None:
        self.compile_s = compile_s
        self.pending: list[tuple[GrammarKey, Future[Any]]] = []

    def num_cached(self) -> int:
        return 0  # nothing is kept: each compile is scripted anew

    def compile_async(self, key: GrammarKey) -> Future[Any]:
        future: Future[Any] = Future()
        if self.compile_s is None:
            self.pending.append((key, future))
        else:
            threading.Timer(self.compile_s, _finish_compile, (key, future)).start()
        return future

    def release(self, spec: str) -> None:
        """Finish the pending compiles of `spec` (leader only)."""
        for key, future in self.pending:
            if key.spec == spec and not future.done():
                _finish_compile(key, future)

    def new_matcher(self, compiled: int) -> CountingMatcher:
        return CountingMatcher(compiled)

    def allocate_mask(self, batch_size: int) -> torch.Tensor:
        return torch.zeros((batch_size, 1), dtype=torch.int32)

    def apply_mask(self, logits: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> None:
        pass


def _finish_compile(key: GrammarKey, future: Future[Any]) -> None:
    if future.cancelled():
        return
    if key.spec == "invalid":
        future.set_exception(GrammarError("unbalanced parenthesis at 3"))
    else:
        future.set_result(int(key.spec.removeprefix("len-")) if key.spec != "slow" else 1)


# ---- one rank ------------------------------------------------------------------------------
class Rank:
    """A scheduler as `SchedulerServer.event_loop` drives it, minus sockets and threads."""

    def __init__(self, args: ServerArgs, backend: ScriptedGrammarBackend, rank: int) -> None:
        self.outputs: list[BatchTokenIDOut] = []
        self.clock = StepClock()
        worker = ScriptedWorker(max_total_tokens=400, max_running_requests=8)
        self.scheduler = Scheduler(
            args, worker, self.outputs.append, None, clock=self.clock, tp_rank=rank
        )
        self.scheduler.grammar_backend = backend  # type: ignore[assignment]
        self.scheduler.intake.grammar_backend = backend  # type: ignore[assignment]
        self.backend = backend
        self.replies: list[Any] = []

    def run(self, step: StepInput) -> bool:
        self.clock.set(step.now)
        for msg in step.msgs:
            self.replies.append(self.scheduler.handle(msg))
        return self.scheduler.step(grammar_done=step.grammar_done)


def snapshot(s: Scheduler) -> dict[str, Any]:
    """Everything the two ranks must agree on (no object ids, no wall-clock times)."""
    q = s.queues
    table = s.kv.rows.req_to_token

    def req(r: Any) -> tuple[Any, ...]:
        kv = r.kv
        row = None if kv.row is None else table[kv.row, : kv.allocated_len].tolist()
        return (
            r.rid,
            list(r.output_ids),
            r.finished_reason and r.finished_reason.to_json(),
            r.to_abort and r.to_abort.to_json(),
            kv.row,
            row,
            kv.protected_len,
            kv.prefix_indices.tolist(),
            r.retract_count,
            None if r.grammar is None else r.grammar.accepted,
            r.admission.arrival,
            r.admission.admitted,
        )

    def node(n: Any) -> tuple[Any, ...]:
        children = [node(c) for c in n.children.values()]
        return (
            list(n.key),
            n.value.tolist(),
            n.lock_ref,
            n.last_access_time,
            n.hit_count,
            children,
        )

    last = q.last_batch
    return {
        "waiting": [req(r) for r in q.waiting],
        "running": [req(r) for r in q.running],
        "chunked": None if q.chunked is None else req(q.chunked),
        "last_batch": None
        if last is None
        else (last.forward_mode.name, [r.rid for r in last.reqs]),
        "grammar": [(e.seq, e.req.rid, e.deadline) for e in s.intake.grammar_queue.entries],
        "deadlines": sorted((e.due, e.seq, e.limit, e.req.rid) for e in s.deadlines.heap),
        "tree": node(s.kv.tree.root_node),
        "free_pages": s.kv.allocator.free_pages().tolist(),
        "free_rows": list(s.kv.rows._free_rows),
        "counters": (
            s.intake.num_aborted_reqs,
            s.intake.num_timed_out_reqs,
            s.decode.num_retracted_reqs,
            s.output.forward_ct,
            s.decode.ratio.value,
        ),
    }


# ---- the script ----------------------------------------------------------------------------
def request(rid: str, rng: random.Random, **params: Any) -> TokenizedGenerateReqInput:
    timeout = params.pop("timeout", None)
    prompt = [rng.randrange(1, 1000) for _ in range(rng.randint(20, 60))]
    params.setdefault("max_new_tokens", rng.randint(25, 40))
    return TokenizedGenerateReqInput(rid, prompt, SamplingParams(**params), timeout=timeout)


def script(rng: random.Random) -> dict[int, list[Any]]:
    """Messages by the step before which they arrive."""
    shared = [rng.randrange(1, 1000) for _ in range(40)]
    first = [request(f"r{i}", rng) for i in range(10)]
    for msg in first[:4]:  # a shared system prompt: tree hits
        msg.input_ids = shared + msg.input_ids
    return {
        0: [
            request("long", rng, max_new_tokens=120),  # cut by --running-timeout
            request("client-timeout", rng, max_new_tokens=100, timeout=4.0),
            request("g-ok", rng, regex="len-3", max_new_tokens=30),
            request("g-bad", rng, regex="invalid"),
            request("g-slow", rng, regex="slow"),  # times out on the leader's clock
        ]
        + first,
        1: [FlushCacheReq()],  # refused: requests are running
        2: [AbortReq("r3"), request("g-late", rng, regex="len-5", max_new_tokens=30)],
        3: [request(f"s{i}", rng) for i in range(8)],  # some wait past --waiting-timeout
        5: [AbortReq("s7"), AbortReq("g-late"), GetInternalStateReq()],
        6: [request("g-again", rng, regex="len-2")],
        9: [request("r-late", rng)],
        40: [GetInternalStateReq()],
    }


# Leader only: the step before which each spec's compiles finish.
RELEASES = {1: ["invalid"], 2: ["len-3"], 7: ["len-2"]}


def make_args(overlap: bool) -> ServerArgs:
    return ServerArgs(
        disable_overlap_schedule=not overlap,
        waiting_timeout=30.0,
        running_timeout=20.0,
        grammar_compile_timeout=3.0,
        chunked_prefill_size=64,
        schedule_conservativeness=0.1,  # admit eagerly: the pool runs out, requests retract
    )


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "normal"])
def test_follower_fed_the_leaders_steps_stays_identical(overlap: bool) -> None:
    args = make_args(overlap)
    leader = Rank(args, ScriptedGrammarBackend(None), 0)
    follower = Rank(args, ScriptedGrammarBackend(FOLLOWER_COMPILE_S), 1)
    socket, wall = ScriptedSocket(), ScriptedTime()
    source = LocalStepSource(socket, leader.scheduler.intake.grammar_done_seqs, wall)  # type: ignore[arg-type]
    messages = script(random.Random(7))
    steps = 0
    while steps <= max(messages) or not leader.scheduler.is_idle():
        assert steps < 2000, "the scheduler never went idle"
        socket.queue.extend(messages.get(steps, []))
        for spec in RELEASES.get(steps, []):
            leader.backend.release(spec)
        step = source.next_step(idle=leader.scheduler.is_idle())
        leader_ran = leader.run(step)
        follower_ran = follower.run(pickle.loads(pickle.dumps(step)))
        assert leader_ran == follower_ran, f"step {steps}"
        assert snapshot(leader.scheduler) == snapshot(follower.scheduler), f"step {steps}"
        assert leader.outputs == follower.outputs, f"step {steps}"
        wall.now += STEP_S
        steps += 1

    # The script reached what it meant to: every kind of deadline, grammar outcome, abort.
    finished = {
        o.rid: o.finish_reason.to_json()
        for batch in leader.outputs
        for o in batch.outputs
        if o.finish_reason is not None
    }
    # The follower's compile of "slow" finished, yet it timed out there too, as on rank 0.
    assert "did not finish within 3 s" in finished["g-slow"]["message"]
    assert finished["g-bad"]["message"].startswith("Invalid grammar")
    assert finished["g-ok"]["type"] == "stop"  # its grammar ended it
    assert finished["g-late"]["message"] == "Aborted by request."
    assert "--running-timeout" in finished["long"]["message"]
    assert "the request's timeout" in finished["client-timeout"]["message"]
    assert any("--waiting-timeout" in f.get("message", "") for f in finished.values())
    assert finished["r3"]["message"] == "Aborted by request."
    assert leader.scheduler.decode.num_retracted_reqs > 0
    assert _same_replies(leader.replies, follower.replies)

    flush = StepInput([FlushCacheReq()], wall.now, [])
    leader.run(flush)
    follower.run(pickle.loads(pickle.dumps(flush)))
    assert leader.replies[-1].success and follower.replies[-1].success
    assert snapshot(leader.scheduler) == snapshot(follower.scheduler)
    for rank in (leader, follower):
        rank.scheduler.check_memory()


def _same_replies(a: list[Any], b: list[Any]) -> bool:
    """Replies equal but for what differs per rank (its number, its wall-clock times)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if hasattr(x, "state"):
            keep = (
                "num_running_reqs",
                "num_queue_reqs",
                "token_usage",
                "num_retracted_reqs",
                "num_aborted_reqs",
                "forward_ct",
                "new_token_ratio",
            )
            if any(getattr(x.state, k) != getattr(y.state, k) for k in keep):
                return False
            if (x.state.tp_rank, y.state.tp_rank) != (0, 1):
                return False
        elif x != y:
            return False
    return True


def test_follower_deciding_grammar_readiness_itself_diverges() -> None:
    """The check above can fail: a follower that looks at its own compiles (as at tp=1)
    instead of rank 0's decision admits the request at another step."""
    args = make_args(overlap=False)
    leader = Rank(args, ScriptedGrammarBackend(None), 0)
    follower = Rank(args, ScriptedGrammarBackend(None), 1)  # compiles not done yet
    msg = request("g", random.Random(0), regex="len-3")
    leader.run(StepInput([msg], 0.0, []))
    follower.run(StepInput([pickle.loads(pickle.dumps(msg))], 0.0, None))
    leader.backend.release("len-3")
    done = leader.scheduler.intake.grammar_done_seqs(False)
    assert done == [1]
    leader.run(StepInput([], 0.5, done))
    follower.run(StepInput([], 0.5, None))
    assert snapshot(leader.scheduler) != snapshot(follower.scheduler)
