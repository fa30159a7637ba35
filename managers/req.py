"""`Req`: one generation request inside the scheduler, made of a few parts.

Lifecycle (who moves a request where):

    Intake.add ──▶ waiting ──(PrefillPlanner admits)──▶ prefill batch
        ▲             │                                  │ chunk left: KVManager.cache_unfinished,
        │             │ aborted / impossible             │ stays the scheduler's `chunked`
        │             ▼                                  ▼
        │         finished ◀──(stop condition)── running (decode)
        └──(DecodePlanner retracts: KV cached in the tree, row freed)──┘

Parts: `kv` (a `KVSpan`: its row and which positions the tree owns; only `KVManager` changes
it), `admission` (an `Admission`: priority, time limit, arrival and admission times),
`logprobs` (a `LogprobState`, only when logprobs were asked for), `spec` (a `DraftState`,
only when speculative decoding drafts for it), `disagg` (a
`DisaggState`, only for a request of a prefill/decode pair), `embed` (an `EmbedState`, only on
an embedding server: such a request runs its prompt and generates nothing), and the sampling state
(`sampling_params`, `sampling_seed`, `grammar`). The rest is the token history and where the
request stands in the loop.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from disagg.base import KVPoll
from managers.io_struct import (
    DecodeOptions,
    FinishReason,
    LogprobDelta,
    finish_length,
    finish_matched,
)
from mem_cache.kv_manager import KVSpan

if TYPE_CHECKING:
    from constrained.base_grammar_backend import BaseGrammarObject
    from mem_cache.kv_manager import KVManager
    from srt.sampling.sampling_params import SamplingParams
    from srt.speculative.proposers import DraftState

TopLogprobs = list[tuple[float, int]]


@dataclass(slots=True)
class LogprobState:
    """Logprobs of a request that asked for them: (logprob, token id) pairs, and how many of
    each were already sent."""

    start_len: int  # first prompt position whose logprob is returned; -1 = none
    top_n: int
    input_done: bool = False
    input_token: list[tuple[float | None, int]] = field(default_factory=list)
    input_top: list[TopLogprobs | None] = field(default_factory=list)
    output_token: list[tuple[float, int]] = field(default_factory=list)
    output_top: list[TopLogprobs] = field(default_factory=list)
    sent_input: int = 0
    sent_output: int = 0

    def add_input(
        self,
        values: list[float],
        tops: list[TopLogprobs] | None,
        prefix_len: int,
        prompt: list[int],
    ) -> None:
        """Prompt logprobs computed by an extend that started at `prefix_len`."""
        if prefix_len == 0 and self.start_len == 0:
            self.input_token.append((None, prompt[0]))
            self.input_top.append(None)
        lo = max(prefix_len, self.start_len - 1)
        targets = prompt[lo + 1 : lo + 1 + len(values)]
        self.input_token.extend(zip(values, targets, strict=True))
        if self.top_n:
            self.input_top.extend(tops or [[] for _ in values])

    def add_output(self, logprob: float, token: int, top: TopLogprobs | None) -> None:
        self.output_token.append((logprob, token))
        if self.top_n and top is not None:
            self.output_top.append(top)

    def take_delta(self) -> LogprobDelta:
        """What was produced since the previous call."""
        o, i = self.sent_output, self.sent_input
        self.sent_output, self.sent_input = len(self.output_token), len(self.input_token)
        return LogprobDelta(
            self.output_token[o:], self.output_top[o:], self.input_token[i:], self.input_top[i:]
        )


@dataclass(slots=True)
class Admission:
    """When a request may run and for how long: its priority, the client's `timeout`, and the
    scheduler clock's reading at arrival and at first admission (`Deadlines` sets both)."""

    priority: int = 0
    timeout: float | None = None  # seconds from arrival to finish, the client's limit
    arrival: float = 0.0
    admitted: float | None = None  # first admission to a prefill batch; None while waiting


@dataclass(slots=True)
class EmbedState:
    """An embedding request's pooling: its options, the parts combined so far
    (`srt/layers/pooler.py`), and the finished vector."""

    dimensions: int | None
    every_token: bool  # mean / CLS pooling: the prompt is computed whole, no cached prefix
    acc: Any = None  # a float32 tensor once the first chunk ran
    vector: list[float] | None = None


@dataclass(slots=True)
class DisaggState:
    """A request of a prefill/decode pair: where its peer is, and how far its KV got."""

    bootstrap: tuple[str, int, int]  # (bootstrap_host, port, room)
    poll: KVPoll = KVPoll.Bootstrapping

    @property
    def room(self) -> int:
        return self.bootstrap[2]


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
        priority: int = 0,
        timeout: float | None = None,
        embed: EmbedState | None = None,
    ) -> None:
        self.rid = rid
        self.origin_input_ids = origin_input_ids
        self.output_ids: list[int] = []
        self.stream = stream
        self.extra_key = extra_key
        # Sampling state; `grammar` is the request's matcher once its grammar has compiled.
        self.sampling_params = sampling_params
        self.sampling_seed = sampling_seed
        self.eos_token_ids = eos_token_ids
        self.grammar: BaseGrammarObject | None = None
        # Parts.
        self.kv = KVSpan()
        self.admission = Admission(priority, timeout)
        self.logprobs = (
            LogprobState(logprob_start_len, top_logprobs_num, input_done=logprob_start_len < 0)
            if return_logprob
            else None
        )
        self.disagg = DisaggState(bootstrap) if bootstrap is not None else None
        self.embed = embed
        self.spec: DraftState | None = None  # speculative decoding's state, once it drafts
        # The next extend: tokens up to `fill_ids` are computed, from the matched prefix on.
        self.fill_ids: list[int] = []
        self.is_chunked = False  # a chunk of the prompt is done, more chunks remain
        # Overlap loop: the future token id of a launched, not yet processed sample, and how
        # often the request was retracted (a sample launched before a retraction is dropped).
        self.pending_token: int | None = None
        self.retract_count = 0
        self.finished_reason: FinishReason | None = None
        self.to_abort: FinishReason | None = None  # applied at the next stop check
        self.cached_tokens: int | None = None  # prefix hit at first admission
        self.sent_output_len = 0
        self._decode_options: DecodeOptions | None = None
        self._plain_greedy: bool | None = None

    # ---- token views -------------------------------------------------------------
    def all_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def kv_token_ids(self) -> list[int]:
        """The tokens whose KV the request's allocated slots hold."""
        return self.all_ids()[: self.kv.allocated_len]

    def extend_input_len(self) -> int:
        return len(self.fill_ids) - self.kv.prefix_len()

    def finished(self) -> bool:
        return self.finished_reason is not None

    def needs_input_logprobs(self) -> bool:
        return self.logprobs is not None and not self.logprobs.input_done

    def waits_for_kv_transfer(self) -> bool:
        """A prefill-side request whose first token exists but whose KV is not sent yet."""
        return self.disagg is not None and self.disagg.poll == KVPoll.WaitingForInput

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

    def samples_by_argmax(self, output_len: int) -> bool:
        """Whether its token at `output_len` is the argmax of the model's logits, with
        nothing applied to them first and no logprobs asked (then its batch needs no
        sampling tensors)."""
        if self._plain_greedy is None:
            p = self.sampling_params
            self._plain_greedy = (
                p.is_greedy
                and not p.logit_bias
                and self.grammar is None
                and self.logprobs is None
                and p.frequency_penalty == 0.0
                and p.presence_penalty == 0.0
                and p.repetition_penalty == 1.0
            )
        return self._plain_greedy and output_len >= self.sampling_params.min_new_tokens

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
    def init_next_round_input(self, kv: KVManager) -> None:
        """Match the tree for the whole sequence so far; at least one token is computed."""
        self.fill_ids = self.all_ids()
        max_prefix = len(self.fill_ids) - 1
        if self.needs_input_logprobs():
            # Prompt logprobs need logits from position logprob_start_len - 1 on.
            assert self.logprobs is not None
            max_prefix = min(max_prefix, max(self.logprobs.start_len - 1, 0))
        if self.embed is not None and self.embed.every_token:
            max_prefix = 0  # its vector reads every position's hidden state
        self.kv.set_match(kv.match_prefix(self.fill_ids[:max_prefix], self.extra_key))

    def set_chunk(self, chunk_len: int) -> None:
        """Limit the next extend to `chunk_len` new tokens; the rest waits for later rounds."""
        self.fill_ids = self.all_ids()[: self.kv.prefix_len() + chunk_len]
        self.is_chunked = len(self.fill_ids) < self.seq_len()

    def reset_for_retract(self) -> None:
        self.pending_token = None  # that sample is dropped; it is recomputed on resume
        self.fill_ids = []
        self.is_chunked = False
        self.retract_count += 1

    # ---- stop conditions -----------------------------------------------------------
    def check_finished(
        self, context_len: int, tail_text: Callable[[Req, int], str] | None = None
    ) -> None:
        """Set `finished_reason` if a stop condition holds after the last appended token.

        `tail_text(req, n)` decodes the last n output tokens; it is only called when the
        request has stop strings or stop_regex patterns.
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
            if params.stop_regex and tail_text is not None:
                # SGLang's stop_regex: a match anywhere in the decoded tail; the finish
                # reason names the pattern (`re` caches the compiled patterns).
                tail = tail_text(self, params.stop_regex_tail)
                for pattern in params.stop_regex:
                    if re.search(pattern, tail):
                        self.finished_reason = finish_matched(pattern)
                        return
        if self.seq_len() >= context_len:
            self.finished_reason = finish_length(n_out)
