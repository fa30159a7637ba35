"""Typed messages between the tokenizer side, the scheduler and the detokenizer.

One dataclass per message; many requests travel together in a `Batch*` wrapper. Everything
here is plain data (lists, ints, strings) so it pickles cheaply across a ZMQ socket.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import Any, Literal, TypeVar

from srt.configs.pooling import PoolingConfig
from srt.sampling.sampling_params import SamplingParams


@dataclass
class GenerateReqInput:
    """One prompt as the HTTP layer or `Engine` hands it to the tokenizer manager.

    Exactly one of `text` / `input_ids`. Batches are lists of these; `n > 1` in
    `sampling_params` makes the tokenizer manager yield n outputs tagged with "index".
    """

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] = field(default_factory=dict)
    rid: str | None = None
    stream: bool = False
    return_logprob: bool = False
    # First prompt position whose logprob is returned; -1 = no prompt logprobs.
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    # Prefill/decode disaggregation (sent by a PD router): (bootstrap_host, port, room).
    bootstrap: tuple[str, int, int] | None = None
    # Admission: seconds the request may take in all (waiting and running), and its
    # priority (needs --enable-priority-scheduling unless 0).
    timeout: float | None = None
    priority: int | None = None
    # Prefix-cache namespace (SGLang's extra_key / cache_salt): only equal keys share KV.
    extra_key: str | None = None
    # An embedding server's request (`--is-embedding`): pool the prompt, generate nothing.
    embed: EmbedOptions | None = None


@dataclass(frozen=True, slots=True)
class EmbedOptions:
    """What an embedding request asks beyond its prompt."""

    dimensions: int | None = None  # Matryoshka truncation (then normalized, if the model is)


@dataclass
class TokenizedGenerateReqInput:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    input_text: str | None = None
    return_logprob: bool = False
    # First prompt position whose logprob is returned; -1 = no prompt logprobs.
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    extra_key: str | None = None
    bootstrap: tuple[str, int, int] | None = None
    timeout: float | None = None  # seconds from arrival in the scheduler to the finish
    priority: int = 0
    embed: EmbedOptions | None = None
    # Who sent it (the HTTP peer's address; None in process): per-client caps count by it.
    client: str | None = None


@dataclass
class AbortReq:
    rid: str
    # Abort every request when True (rid is ignored).
    abort_all: bool = False


@dataclass
class FlushCacheReq:
    pass


# ---- outputs (scheduler -> detokenizer -> tokenizer manager) ------------------------
FinishType = Literal["stop", "length", "abort"]
T = TypeVar("T")


def _pickle_as_tuple(cls: type[T]) -> type[T]:
    """Pickle a slotted dataclass as (class, field values). The default reduce of a slots
    class builds a state dict per object, slow for records that cross two sockets every
    scheduler step. Measured by `python -m timeit -s "import pickle; from managers.io_struct
    import BatchTokenIDOut as B, DecodeOptions as D, ReqOutput as R; b = B([R('r', [1], None,
    4, 1, 0, D()) for _ in range(256)])" "pickle.loads(pickle.dumps(b))"`, with and without
    this decorator."""
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    assert len(names) > 1, "attrgetter of one name returns a bare value, not a tuple"
    values = attrgetter(*names)

    def __reduce__(self: T) -> tuple[type[T], tuple[Any, ...]]:
        return cls, values(self)

    cls.__reduce__ = __reduce__  # type: ignore[method-assign, assignment]
    return cls


@_pickle_as_tuple
@dataclass(frozen=True, slots=True)
class FinishReason:
    """Why a request finished. `to_json()` gives SGLang's `meta_info.finish_reason`, which
    only the HTTP / Engine edge builds; inside the server the record itself travels."""

    type: FinishType
    matched: int | str | None = None  # stop: the stop token id or stop string
    length: int | None = None  # length: the limit that was reached
    message: str | None = None  # abort
    status_code: int | None = None  # abort: set when the server refused or failed

    @property
    def is_abort(self) -> bool:
        return self.type == "abort"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        if self.type == "stop":
            out["matched"] = self.matched
        elif self.type == "length":
            out["length"] = self.length
        else:
            out["message"] = self.message
            if self.status_code is not None:
                out["status_code"] = self.status_code
        return out


def finish_matched(matched: int | str) -> FinishReason:
    return FinishReason("stop", matched=matched)


def finish_length(length: int) -> FinishReason:
    return FinishReason("length", length=length)


def finish_abort(message: str, status_code: int | None = None) -> FinishReason:
    return FinishReason("abort", message=message, status_code=status_code)


@_pickle_as_tuple
@dataclass(frozen=True, slots=True)
class DecodeOptions:
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stop: tuple[str, ...] = ()
    no_stop_trim: bool = False


@_pickle_as_tuple
@dataclass(slots=True)
class LogprobDelta:
    """Logprobs produced for one request since its previous message: (logprob, token id)
    pairs, and per position the top alternatives (None for the first prompt token)."""

    output_token_logprobs: list[tuple[float, int]]
    output_top_logprobs: list[list[tuple[float, int]]]
    input_token_logprobs: list[tuple[float | None, int]]
    input_top_logprobs: list[list[tuple[float, int]] | None]


@_pickle_as_tuple
@dataclass(slots=True)
class ReqOutput:
    """One request's news in one scheduler step. Consumers accumulate `new_token_ids`;
    full outputs never travel."""

    rid: str
    # Token ids produced since the previous message for this request.
    new_token_ids: list[int]
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # Read by the detokenizer when it first sees the rid.
    decode_options: DecodeOptions
    # None when the request did not ask for logprobs.
    logprobs: LogprobDelta | None = None
    # An embedding request's vector, in its finishing message only.
    embedding: list[float] | None = None


@dataclass
class BatchTokenIDOut:
    """One scheduler step's outputs, for every request that produced something (scheduler
    -> detokenizer)."""

    outputs: list[ReqOutput]


@_pickle_as_tuple
@dataclass(slots=True)
class ReqStrOutput:
    """A `ReqOutput` plus the text released since the request's previous message."""

    output: ReqOutput
    new_text: str


@dataclass
class BatchStrOut:
    """`BatchTokenIDOut` with texts (detokenizer -> tokenizer manager)."""

    outputs: list[ReqStrOutput]


# ---- control messages (tokenizer manager <-> scheduler) ------------------------------
@dataclass
class FlushCacheReqOutput:
    success: bool
    message: str


@dataclass
class GetInternalStateReq:
    pass


@dataclass(slots=True)
class MemoryIntegrity:
    """The scheduler's latest KV integrity check: ok is None until one has run."""

    ok: bool | None = None
    error: str | None = None
    time: float | None = None  # time.time() of the check


@dataclass(slots=True)
class SchedulerState:
    """The scheduler's answer to `GetInternalStateReq` (`/get_server_info` internal_states)."""

    num_running_reqs: int
    num_queue_reqs: int
    token_usage: float
    max_total_tokens: int
    max_running_requests: int
    num_retracted_reqs: int  # cumulative
    num_aborted_reqs: int  # cumulative
    overlap_schedule: bool
    worker_idle_s: float
    worker_busy_s: float
    pid: int
    new_token_ratio: float
    forward_ct: int
    memory_integrity: MemoryIntegrity
    tp_rank: int = 0
    grammar_cache_entries: int = 0  # compiled grammars kept (bounded by the cache's size)
    num_grammar_queue_reqs: int = 0  # requests waiting for their grammar to compile
    # Speculative decoding (cumulative): tokens a request gains per verify step, draft
    # tokens verified and accepted.
    avg_spec_accept_length: float = 0.0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


@dataclass
class GetInternalStateReqOutput:
    state: SchedulerState  # tensor-parallel rank 0's
    ranks: list[SchedulerState] = field(default_factory=list)  # ranks 1.. (tp > 1 only)


@dataclass(slots=True)
class StepInput:
    """Tensor-parallel rank 0 -> every rank, once per event-loop iteration (even when empty),
    so that every rank's scheduler takes the same decisions from the same inputs."""

    msgs: list[Any]  # what rank 0 received: requests, aborts, flushes, state queries
    now: float  # rank 0's time.monotonic(): the clock of every rank's deadlines
    # The grammar compiles rank 0 saw done (`GrammarQueue` entry seqs; the others time out
    # by `now`); None: each scheduler decides for itself (tp=1).
    grammar_done: list[int] | None


@dataclass
class SchedulerStats:
    """Sent by the scheduler about twice a second while busy and once a second while idle:
    the main process also reads it as the scheduler's heartbeat (/health, the watchdog)."""

    num_running_reqs: int
    num_queue_reqs: int
    token_usage: float
    cache_hit_rate: float
    gen_throughput: float
    num_retracted_reqs: int  # cumulative
    max_total_tokens: int
    # Cumulative seconds the model worker waited for the scheduler between consecutive
    # forwards, and spent in forwards.
    worker_idle_s: float = 0.0
    worker_busy_s: float = 0.0
    # Load, as SGLang's /get_load reports it: KV slots held by requests (neither free nor
    # evictable from the prefix tree), and the prompt tokens of the requests not admitted yet
    # (waiting, or compiling their grammar).
    num_used_tokens: int = 0
    num_queued_tokens: int = 0
    # What `--max-queued-requests` bounds: requests not admitted beyond the free rows the
    # next step admits into (the main process refuses from it, `managers/admission.py`).
    num_backlog_reqs: int = 0


@dataclass
class SchedulerReady:
    """Sent once through the readiness pipe when the scheduler has loaded the model."""

    model_path: str
    context_len: int
    vocab_size: int
    max_total_tokens: int
    max_running_requests: int
    eos_token_ids: list[int]
    device: str  # what `--device auto` resolved to, so the main process never imports torch
    pooling: PoolingConfig | None = None  # an embedding server's (`--is-embedding`)
