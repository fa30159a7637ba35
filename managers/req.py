"""`Req`: one generation request inside the scheduler, and its finish reasons.

Lifecycle (who moves a request where):

    arrival ──▶ waiting_queue ──(PrefillAdder admits)──▶ prefill batch
        ▲                │                                  │ chunk left: cache_unfinished_req,
        │                │ aborted / impossible             │ stays the scheduler's chunked_req
        │                ▼                                  ▼
        │            finished ◀──(stop condition)── running batch (decode)
        └──(retract: KV inserted into the tree, row freed)──┘

KV ownership: positions [0, cache_protected_len) are tree-owned slots locked through
`last_node`; positions [cache_protected_len, kv_allocated_len) are slots this request
allocated itself. `kv_token_ids()` names the tokens those slots hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from managers.io_struct import DecodeOptions

if TYPE_CHECKING:
    from constrained.base_grammar_backend import BaseGrammarObject
    from mem_cache.base_prefix_cache import BasePrefixCache
    from srt.sampling.sampling_params import SamplingParams


@dataclass(slots=True)
class FinishReason:
    """`type` is stop|length|abort, as in SGLang's meta_info.finish_reason."""

    type: str
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None

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


_EMPTY = torch.empty(0, dtype=torch.int64)


class Req:
    def __init__(
        self,
        rid: str,
        origin_input_ids: list[int],
        sampling_params: SamplingParams,
        *,
        sampling_seed: int,
        eos_token_ids: frozenset[int] = frozenset(),
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        stream: bool = False,
        extra_key: str | None = None,
        bootstrap: tuple[str, int, int] | None = None,
    ) -> None:
        self.rid = rid
        self.origin_input_ids = origin_input_ids
        self.sampling_params = sampling_params
        self.sampling_seed = sampling_seed
        self.eos_token_ids = eos_token_ids
        self.stream = stream
        self.extra_key = extra_key
        # Disaggregation: (bootstrap_host, port, room) and the KVPoll state of its transfer.
        self.bootstrap = bootstrap
        self.kv_poll: int | None = None
        self.output_ids: list[int] = []
        # Overlap loop: the future token id of a launched, not yet processed sample.
        self.pending_token: int | None = None
        # Constrained decoding: the request's matcher, set once its grammar has compiled.
        self.grammar: BaseGrammarObject | None = None
        self._decode_options: DecodeOptions | None = None

        # Tokens that will have KV after the next extend (prompt + output so far, or a chunk).
        self.fill_ids: list[int] = []
        self.extend_input_len = 0
        self.is_chunked = False  # a chunk of the prompt is done, more chunks remain

        # KV ownership (see module docstring).
        self.req_pool_idx: int | None = None
        self.prefix_indices: torch.Tensor = _EMPTY
        self.last_node: Any = None
        self.cache_protected_len = 0
        self.kv_allocated_len = 0

        self.finished_reason: FinishReason | None = None
        self.to_abort: FinishReason | None = None
        self.cached_tokens = 0
        self.admitted = False
        self.retract_count = 0

        # Logprobs (token logprob, token id) pairs, and how many of each were streamed.
        self.return_logprob = return_logprob
        self.logprob_start_len = logprob_start_len
        self.top_logprobs_num = top_logprobs_num
        self.input_logprobs_done = not return_logprob or logprob_start_len < 0
        self.input_token_logprobs: list[tuple[float | None, int]] = []
        self.input_top_logprobs: list[list[tuple[float, int]] | None] = []
        self.output_token_logprobs: list[tuple[float, int]] = []
        self.output_top_logprobs: list[list[tuple[float, int]]] = []
        self.sent_output_len = 0
        self.sent_output_logprob_len = 0
        self.sent_input_logprob_len = 0

    # ---- token views -------------------------------------------------------------
    def all_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def kv_token_ids(self) -> list[int]:
        return self.all_ids()[: self.kv_allocated_len]

    def finished(self) -> bool:
        return self.finished_reason is not None

    def next_input_token(self) -> int:
        """The token the next decode feeds: a future placeholder while the overlap loop has
        not processed the forward that samples it."""
        return self.pending_token if self.pending_token is not None else self.output_ids[-1]

    def needs_sync(self) -> bool:
        """Whether building this request's next batch needs its latest token on the host
        (penalties count output tokens; a grammar's mask depends on them)."""
        p = self.sampling_params
        return (
            self.grammar is not None
            or p.frequency_penalty != 0.0
            or p.presence_penalty != 0.0
            or p.repetition_penalty != 1.0
        )

    def decode_options(self) -> DecodeOptions:
        if self._decode_options is None:
            p = self.sampling_params
            self._decode_options = DecodeOptions(
                p.skip_special_tokens,
                p.spaces_between_special_tokens,
                tuple(p.stop or ()),
                p.no_stop_trim,
            )
        return self._decode_options

    # ---- scheduling ----------------------------------------------------------------
    def init_next_round_input(self, tree_cache: BasePrefixCache) -> None:
        """Match the tree for the whole sequence so far; at least one token is computed."""
        self.fill_ids = self.all_ids()
        max_prefix = len(self.fill_ids) - 1
        if not self.input_logprobs_done:
            # Prompt logprobs need logits from position logprob_start_len - 1 on.
            max_prefix = min(max_prefix, max(self.logprob_start_len - 1, 0))
        match = tree_cache.match_prefix(self.fill_ids[:max_prefix], extra_key=self.extra_key)
        self.prefix_indices = match.device_indices
        self.last_node = match.last_node
        self.extend_input_len = len(self.fill_ids) - len(self.prefix_indices)

    def set_chunk(self, chunk_len: int) -> None:
        """Limit the next extend to `chunk_len` new tokens; the rest waits for later rounds."""
        prefix = len(self.prefix_indices)
        self.fill_ids = self.all_ids()[: prefix + chunk_len]
        self.extend_input_len = chunk_len
        self.is_chunked = len(self.fill_ids) < self.seq_len()

    def reset_for_retract(self) -> None:
        self.pending_token = None  # that sample is dropped; it is recomputed on resume
        self.fill_ids = []
        self.extend_input_len = 0
        self.is_chunked = False
        self.retract_count += 1

    # ---- stop conditions -----------------------------------------------------------
    def check_finished(self, context_len: int, tail_text: Any = None) -> None:
        """Set `finished_reason` if a stop condition holds after the last appended token.

        `tail_text(n)` decodes the last n output tokens; it is only called when the request
        has stop strings.
        """
        if self.finished_reason is not None:
            return
        if self.to_abort is not None:
            self.finished_reason = self.to_abort
            return
        params = self.sampling_params
        n_out = len(self.output_ids)
        if params.max_new_tokens is not None and n_out >= params.max_new_tokens:
            self.finished_reason = finish_length(params.max_new_tokens)
            return
        if n_out > 0 and n_out >= params.min_new_tokens:
            last = self.output_ids[-1]
            if not params.ignore_eos and last in self.eos_token_ids:
                self.finished_reason = finish_matched(last)
                return
            if params.stop_token_ids and last in params.stop_token_ids:
                self.finished_reason = finish_matched(last)
                return
            if params.stop and tail_text is not None:
                tail = tail_text(self, params.stop_str_max_len + 2)
                for stop in params.stop:
                    if stop in tail:
                        self.finished_reason = finish_matched(stop)
                        return
        if self.seq_len() >= context_len:
            self.finished_reason = finish_length(n_out)
