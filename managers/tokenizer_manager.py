"""`TokenizerManager`: the main process's side of every request.

Lifecycle of one `generate_request` call:

    validate + tokenize ──▶ ReqState per sample (rid -> state) ──PUSH──▶ scheduler
                                   ▲
    _drain ◀──PULL── BatchStrOut (detokenizer), stats and control replies (scheduler)
        │ appends text / ids / logprobs to the state, records metrics, and wakes the caller
        ▼
    caller (HTTP route or Engine) yields cumulative outputs; leaving early (client gone,
    generator closed or cancelled) sends an AbortReq so the scheduler frees the KV.

All of it runs on one asyncio loop (uvicorn's for the server, a background one for the
offline `Engine`); the ZMQ sockets are created on that loop the first time it is used. Only
tokenizing and checking a prompt runs elsewhere, on a small thread pool: a prompt as large as
a body may be takes long to tokenize, and the loop must keep serving every other client
meanwhile (`pytest tests/server -k test_4mb_prompt_is_tokenized_without_stalling_others`).

A request holds its rid, and every rid derived from it, in `rids` (a `RidTable`) from
admission until its generator ends; a request whose names collide is refused. Shutting down
(`drain`, on SIGTERM) refuses new requests, waits for the running ones, and fails the rest
with a 503 the way a dead child does (`fail_all`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import zmq
import zmq.asyncio

from managers.admission import FrontAdmission
from managers.errors import RequestError
from managers.io_struct import (
    AbortReq,
    BatchStrOut,
    FlushCacheReq,
    FlushCacheReqOutput,
    GenerateReqInput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    SchedulerReady,
    SchedulerState,
    SchedulerStats,
    TokenizedGenerateReqInput,
)
from managers.metrics import ServerMetrics
from managers.parallel_sampling import RidTable, make_requests, prefill_rid
from managers.req_state import ReqState, wait_outputs
from managers.server_status import load_report
from managers.validation import (
    check_admission_fields,
    grammar_limits,
    load_chat_template,
    prepare_prompt,
)
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs
from srt.utils.process import PortArgs, zmq_socket

logger = logging.getLogger(__name__)
T = TypeVar("T")

CONTROL_TIMEOUT_S = 30.0
# Threads that tokenize and check prompts. Few: a large prompt must not stall the event loop,
# but tokenizing is CPU work that competes with the scheduler for the same cores.
TOKENIZE_THREADS = 2
DRAIN_POLL_S = 0.05
# The idle scheduler beats once a second: never call it hung after less than this.
MIN_HEARTBEAT_SILENCE_S = 2.0
# Output messages handled per reader callback before the loop serves its other work.
DRAIN_BATCH = 64


class TokenizerManager:
    def __init__(
        self,
        server_args: ServerArgs,
        port_args: PortArgs,
        ready: SchedulerReady,
        served_model_name: str,
        tokenizer: Any = None,
    ) -> None:
        """`tokenizer`: the model's, when the caller loaded it already; else loaded here
        (unless the server runs without one)."""
        self.server_args = server_args
        self.port_args = port_args
        self.model_path = ready.model_path
        self.served_model_name = served_model_name
        self.context_len = ready.context_len
        self.vocab_size = ready.vocab_size
        self.max_total_tokens = ready.max_total_tokens
        self.max_running_requests = ready.max_running_requests
        self.pooling = ready.pooling  # an embedding server's (`--is-embedding`), else None
        self.tokenizer: Any = tokenizer
        if tokenizer is None and not server_args.skip_tokenizer_init:
            from srt.model_loader.sources import get_tokenizer

            self.tokenizer = get_tokenizer(self.model_path, server_args.tokenizer_path)
        self.chat_template = load_chat_template(server_args.chat_template)
        self.metrics = ServerMetrics(served_model_name)
        self.last_stats: SchedulerStats | None = None
        # When the scheduler was last heard from (its stats are its heartbeat).
        self.last_heartbeat = time.monotonic()
        self.rid_to_state: dict[str, ReqState] = {}
        # With priorities, an urgent newcomer may take a queued request's place: only the
        # scheduler, which sees the queue's priorities, can refuse then.
        front_bound = (
            None if server_args.enable_priority_scheduling else server_args.max_queued_requests
        )
        self.admission = FrontAdmission(front_bound, self.max_running_requests)
        self.rids = RidTable()
        self.tokenize_pool = ThreadPoolExecutor(TOKENIZE_THREADS, "radixrt-tokenize")
        self.control_waiters: dict[type, deque[asyncio.Future[Any]]] = {}
        self.dead_reason: str | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    # ---- sockets and the receive loop ----------------------------------------------
    def ensure_started(self) -> None:
        loop = asyncio.get_running_loop()
        if self.loop is loop:
            return
        if self.loop is not None:
            raise RuntimeError("a TokenizerManager serves one event loop; this is another one")
        self.loop = loop
        self.last_heartbeat = time.monotonic()  # nothing was read before this loop ran
        # The outputs arrive on a plain socket read from the loop's reader callback
        # (`_drain`), the requests leave through an asyncio one.
        self.recv_socket = zmq_socket(
            zmq.Context.instance(), zmq.PULL, self.port_args.tokenizer_ipc, bind=True
        )
        self.send_to_scheduler = zmq_socket(
            zmq.asyncio.Context(1), zmq.PUSH, self.port_args.scheduler_input_ipc, bind=False
        )
        loop.add_reader(self.recv_socket.getsockopt(zmq.FD), self._drain)
        loop.call_soon(self._drain)  # anything that came before the reader was added

    def _drain(self) -> None:
        """Handle the messages waiting, up to `DRAIN_BATCH`; more are left to a callback
        after the loop's other ready work (the streams woken by these ones).

        Reading many messages per wake-up is what lets a stream that fell behind catch up:
        its state takes every step's tokens and is queued once, so its next event carries
        them all. Awaiting one message at a time (pyzmq's asyncio socket) wakes every stream
        between two steps' messages, so a front process slower than the scheduler sent one
        event per token and fell further behind. The socket's file descriptor signals only
        when the queue goes from empty to not empty, so the loop reads until it is empty or
        schedules itself again."""
        if self.recv_socket.closed:
            return  # closed since this callback was scheduled
        for _ in range(DRAIN_BATCH):
            try:
                msg = self.recv_socket.recv_pyobj(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self.dispatch(msg)
            except Exception:  # a bad message must not stop every other request
                logger.exception("Failed to handle %s", type(msg).__name__)
        assert self.loop is not None
        self.loop.call_soon(self._drain)

    def dispatch(self, msg: Any) -> None:
        if isinstance(msg, BatchStrOut):
            self.on_batch_output(msg)
        elif isinstance(msg, SchedulerStats):
            self.last_stats = msg
            self.admission.on_stats(msg)
            self.last_heartbeat = time.monotonic()
            self.metrics.on_scheduler_stats(msg)
        elif isinstance(msg, (FlushCacheReqOutput, GetInternalStateReqOutput)):
            waiters = self.control_waiters.get(type(msg))
            while waiters:
                fut = waiters.popleft()
                if not fut.done():
                    fut.set_result(msg)
                    break
        else:
            logger.warning("Unexpected message %s", type(msg).__name__)

    def on_batch_output(self, batch: BatchStrOut) -> None:
        now = time.perf_counter()
        for item in batch.outputs:
            out = item.output
            state = self.rid_to_state.get(out.rid)
            if state is None:
                continue  # a prefill-only request of n > 1, or one already abandoned
            if out.new_token_ids:
                if state.first_token_time is None:
                    state.first_token_time = now
                    self.metrics.on_first_token(now - state.created_time)
                else:
                    self.metrics.on_tokens(now - state.last_token_time, len(out.new_token_ids))
                state.last_token_time = now
            state.apply(out, item.new_text, self.token_text)
            if state.finished:
                self.metrics.on_finish(
                    now - state.created_time,
                    out.prompt_tokens,
                    out.completion_tokens,
                    out.cached_tokens,
                )
                del self.rid_to_state[out.rid]
                self.admission.on_ended(1)
            state.notify()

    def token_text(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id])

    # ---- generation ----------------------------------------------------------------
    async def generate_request(
        self, obj: GenerateReqInput, request: Any = None
    ) -> AsyncIterator[dict[str, Any]]:
        """Yield outputs for one prompt (n of them when sampling_params has n > 1).

        Streaming: cumulative snapshots, tagged with "index", the last per index finished.
        Otherwise: one final output per index; a request the scheduler refused raises
        `RequestError`.
        """
        self.check_alive()
        check_admission_fields(obj, self.server_args)
        if obj.embed is not None and self.pooling is not None:
            error = self.pooling.check_dimensions(obj.embed.dimensions)
            if error is not None:
                raise RequestError(error, param="dimensions")
        with self.admission.arrival(len(self.rid_to_state)) as arrival:
            self.ensure_started()
            loop = asyncio.get_running_loop()
            input_ids, params = await loop.run_in_executor(
                self.tokenize_pool, self.tokenize_and_validate, obj
            )
            self.check_alive()  # shutdown may have begun while the prompt was tokenized
            rid = obj.rid if obj.rid is not None else uuid.uuid4().hex
            msgs, states = self.build_requests(rid, obj, input_ids, params, _client(request))
            self.rids.reserve(rid, params.n)  # 400 if any of its rids is a running request's
            try:
                for state in states:
                    self.rid_to_state[state.rid] = state
                for msg in msgs:
                    self.send_to_scheduler.send_pyobj(msg)
                # n > 1 also sends a prefill-only request, which ends unseen: not counted.
                arrival.sent(len(states))
                async for out in wait_outputs(states, states[0].ready, obj.stream, request):
                    yield out
            finally:
                unfinished = [s for s in states if not s.finished]
                for state in unfinished:
                    self.rid_to_state.pop(state.rid, None)
                    self.send_to_scheduler.send_pyobj(AbortReq(state.rid))
                self.admission.on_ended(len(unfinished))
                if unfinished and params.n > 1:
                    self.send_to_scheduler.send_pyobj(AbortReq(prefill_rid(rid)))
                self.rids.release(rid)

    def build_requests(
        self,
        rid: str,
        obj: GenerateReqInput,
        input_ids: list[int],
        params: SamplingParams,
        client: str | None = None,
    ) -> tuple[list[TokenizedGenerateReqInput], list[ReqState]]:
        """The scheduler's messages for `obj` (one per sample, and a shared prefill first
        when n > 1) and the states that collect their outputs, one per sample."""
        msgs = make_requests(
            rid,
            input_ids,
            params,
            input_text=obj.text,
            return_logprob=obj.return_logprob,
            logprob_start_len=obj.logprob_start_len if obj.return_logprob else -1,
            top_logprobs_num=obj.top_logprobs_num if obj.return_logprob else 0,
            stream=obj.stream,
            bootstrap=obj.bootstrap,
            timeout=obj.timeout,
            priority=obj.priority or 0,
            extra_key=obj.extra_key,
            embed=obj.embed,
            client=client,
        )
        samples = msgs if params.n == 1 else msgs[1:]
        ready: asyncio.Queue[ReqState] = asyncio.Queue()
        states = [
            ReqState(
                m.rid, rid, j, ready, obj.stream, obj.return_logprob, obj.return_text_in_logprobs
            )
            for j, m in enumerate(samples)
        ]
        return msgs, states

    def tokenize_and_validate(self, obj: GenerateReqInput) -> tuple[list[int], SamplingParams]:
        """Runs on `tokenize_pool`: it only reads the manager."""
        return prepare_prompt(
            obj,
            self.tokenizer,
            self.context_len,
            self.vocab_size,
            self.server_args.max_batch_size,
            grammar_limits(self.server_args),
        )

    # ---- control -------------------------------------------------------------------
    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.ensure_started()
        if abort_all:
            self.send_to_scheduler.send_pyobj(AbortReq("", abort_all=True))
            return
        for r in self.rids.rids_to_abort(rid):
            self.send_to_scheduler.send_pyobj(AbortReq(r))

    async def flush_cache(self) -> FlushCacheReqOutput:
        return await self._control(FlushCacheReq(), FlushCacheReqOutput)

    async def get_internal_states(self) -> list[SchedulerState]:
        """Every scheduler rank's state, rank 0's first (one entry at tp=1)."""
        out = await self._control(GetInternalStateReq(), GetInternalStateReqOutput)
        return [out.state, *out.ranks]

    async def _control(self, req: Any, reply_type: type) -> Any:
        self.check_alive()
        self.ensure_started()
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.control_waiters.setdefault(reply_type, deque()).append(fut)
        self.send_to_scheduler.send_pyobj(req)
        try:
            return await asyncio.wait_for(fut, CONTROL_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise RequestError("The scheduler did not answer in time.", status_code=503) from None

    async def off_loop(self, work: Callable[[], T]) -> T:
        """`work()` run on `tokenize_pool`: tokenizer work as large as a body can make it
        (see the module docstring)."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, work)

    def close(self) -> None:
        """Stop receiving (call on the manager's loop)."""
        self.tokenize_pool.shutdown(wait=False, cancel_futures=True)
        if self.loop is not None:
            self.loop.remove_reader(self.recv_socket.getsockopt(zmq.FD))
            self.recv_socket.close()
            self.send_to_scheduler.close()

    # ---- liveness and load ---------------------------------------------------------
    def scheduler_silent_s(self) -> float:
        """Seconds since the scheduler was last heard from; 0 until this manager's loop runs
        (nothing reads its messages before that)."""
        if self.loop is None:
            return 0.0
        return time.monotonic() - self.last_heartbeat

    def scheduler_stalled(self) -> str | None:
        """Why the scheduler counts as hung, or None: silent for longer than one step may
        take (`--watchdog-timeout`; at least two idle heartbeats)."""
        limit = max(self.server_args.watchdog_timeout, MIN_HEARTBEAT_SILENCE_S)
        silent = self.scheduler_silent_s()
        if silent <= limit:
            return None
        return f"the scheduler sent no heartbeat for {silent:.1f} s (limit {limit:.1f} s)"

    def load(self) -> list[dict[str, int]]:
        """SGLang's /get_load, from the latest scheduler stats (see `load_report`)."""
        return load_report(self.last_stats)

    # ---- failure -------------------------------------------------------------------
    def check_alive(self) -> None:
        if self.dead_reason is not None:
            raise RequestError(shutting_down(self.dead_reason), None, 503)

    async def drain(self, grace_s: float, reason: str) -> None:
        """Shut down gently: refuse new requests with a 503 at once, give the running ones up
        to `grace_s` seconds to finish, then fail the rest as `fail_all` does. Cancelling the
        wait (a second signal) fails them at once."""
        self.dead_reason = reason
        logger.info(
            "Shutting down (%s): refusing new requests; %d running get up to %.1f s.",
            reason,
            len(self.rids),
            grace_s,
        )
        deadline = time.monotonic() + grace_s
        try:
            while self.rids and time.monotonic() < deadline:
                await asyncio.sleep(DRAIN_POLL_S)
        finally:
            if self.rids:
                logger.warning("Failing %d request(s) still running: %s", len(self.rids), reason)
            self.fail_all(reason)

    def fail_all(self, reason: str) -> None:
        """Finish every waiting request with a 503 (loop thread): a child process died, or
        the server is shutting down."""
        self.dead_reason = reason
        for state in list(self.rid_to_state.values()):
            state.fail(shutting_down(reason))
        self.rid_to_state.clear()


def shutting_down(reason: str) -> str:
    return f"The server is shutting down: {reason}"


def _client(request: Any) -> str | None:
    """Who sent `request` (an HTTP request, or None in process), as per-client caps count:
    the peer's address, so every client behind one proxy or router counts as one."""
    peer = getattr(request, "client", None)
    return peer.host if peer is not None else None
