"""Typed messages between the tokenizer side, the scheduler and the detokenizer.

One dataclass per message; many requests travel together in a `Batch*` wrapper. Everything
here is plain data (lists, ints, strings) so it pickles cheaply across a ZMQ socket.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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


@dataclass
class AbortReq:
    rid: str
    # Abort every request when True (rid is ignored).
    abort_all: bool = False


@dataclass
class FlushCacheReq:
    pass


@dataclass
class BatchTokenIDOut:
    """One scheduler step's news for every request that produced something (scheduler ->
    detokenizer). Consumers accumulate `new_token_ids`; full outputs never travel."""

    rids: list[str]
    # Token ids produced since the previous message for that request.
    new_token_ids: list[list[int]]
    finished_reasons: list[dict[str, Any] | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    # Decode options, per request (the detokenizer reads them when it first sees a rid).
    decode_options: list[DecodeOptions] = field(default_factory=list)
    # Logprobs produced since the previous message (empty lists when not requested).
    output_token_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    output_top_logprobs: list[list[list[tuple[float, int]]]] = field(default_factory=list)
    input_token_logprobs: list[list[tuple[float | None, int]]] = field(default_factory=list)
    input_top_logprobs: list[list[list[tuple[float, int]] | None]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class DecodeOptions:
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stop: tuple[str, ...] = ()
    no_stop_trim: bool = False


@dataclass
class BatchStrOut:
    """`BatchTokenIDOut` plus the text released since the previous message (detokenizer ->
    tokenizer manager)."""

    tokens: BatchTokenIDOut
    new_texts: list[str]


# ---- control messages (tokenizer manager <-> scheduler) ------------------------------
@dataclass
class FlushCacheReqOutput:
    success: bool
    message: str


@dataclass
class GetInternalStateReq:
    pass


@dataclass
class GetInternalStateReqOutput:
    state: dict[str, Any]


@dataclass
class SchedulerStats:
    """Sent by the scheduler about twice a second while busy, and when it goes idle."""

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


@dataclass
class SchedulerReady:
    """Sent once through the readiness pipe when the scheduler has loaded the model."""

    model_path: str
    context_len: int
    vocab_size: int
    max_total_tokens: int
    max_running_requests: int
    eos_token_ids: list[int]
