"""Typed messages between the tokenizer side, the scheduler and the detokenizer.

One dataclass per message; many requests travel together in a `Batch*` wrapper. Everything
here is plain data (lists, ints, strings) so it pickles cheaply across a ZMQ socket.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from srt.sampling.sampling_params import SamplingParams


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
    """One scheduler step's news for every request that produced something."""

    rids: list[str]
    # Token ids produced since the previous message for that request.
    new_token_ids: list[list[int]]
    # Full output so far, for incremental detokenization and stop-string trimming.
    output_ids: list[list[int]]
    finished_reasons: list[dict[str, Any] | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    # Logprobs produced since the previous message (empty lists when not requested).
    output_token_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    output_top_logprobs: list[list[list[tuple[float, int]]]] = field(default_factory=list)
    input_token_logprobs: list[list[tuple[float | None, int]]] = field(default_factory=list)
    input_top_logprobs: list[list[list[tuple[float, int]] | None]] = field(default_factory=list)
