"""A batch's sampling parameters as tensors, built once per batch from its requests.

`SamplingBatchInfo.from_reqs` reads each request's `SamplingParams`, token history and seed;
`Sampler.forward` reads only this object and the logits. Penalty state (output token counts,
the prompt+output "seen" mask) is rebuilt from the token lists with one scatter each, and only
when some request in the batch actually uses that penalty. The same holds for logit_bias:
sparse (row, id, value) tensors, built only when some request has a bias.

Logits processing (`apply_logits_processing`, in this order, before temperature):
  1. logit_bias (OpenAI): logit += bias for each listed token of the row; a bias of exactly
     -100 is a ban (the logit becomes -inf), as OpenAI documents -100 "should result in a
     ban". First: the bias edits the model's logits, and the steps below act on the result
     (a penalty scales a biased logit; a masked token stays -inf whatever its bias);
  2. repetition (HF): for tokens seen in prompt + output, logit > 0 ? logit / rp : logit * rp;
  3. frequency / presence (OpenAI): logit -= freq * count + presence * (count > 0), where count
     is the token's number of occurrences in the OUTPUT so far;
  4. min_new_tokens: while len(output_ids) < min_new_tokens, the EOS ids and the request's
     stop_token_ids get -inf;
  5. grammar: the constrained rows' disallowed tokens get -inf.
Greedy requests get all of these too (argmax of the processed logits), and the logprobs the
sampler returns are computed from the processed logits, so they include the bias.

The bias depends on the request's parameters alone (not on its output so far), so it holds on
every step, the overlap loop's included, without the host waiting for the previous token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from srt.sampling.sampling_params import MAX_LOGIT_BIAS_VALUE, SAMPLING_EPS, SamplingParams


class VocabMaskLike(Protocol):
    def apply(self, logits: torch.Tensor) -> None: ...


class ReqLike(Protocol):
    """What sampling needs from the scheduler's Req."""

    sampling_params: SamplingParams
    origin_input_ids: list[int]
    output_ids: list[int]
    sampling_seed: int  # the user's seed, or one the scheduler assigned; always set


@dataclass(slots=True)
class SamplingBatchInfo:
    vocab_size: int
    temperatures: torch.Tensor  # float32 [B, 1]; 1.0 for greedy rows (never divided by 0)
    top_ps: torch.Tensor  # float32 [B]
    top_ks: torch.Tensor  # int64 [B]; "off" (-1) is stored as vocab_size
    min_ps: torch.Tensor  # float32 [B]
    seeds: torch.Tensor  # int64 [B]; the 64-bit seed reinterpreted as signed
    positions: torch.Tensor  # int64 [B]; index (in the output) of the token being sampled
    greedy: torch.Tensor  # bool [B]
    sampled_rows: torch.Tensor  # int64 [S]: indices of the non-greedy rows
    is_all_greedy: bool
    need_top_p_sampling: bool  # over non-greedy rows only
    need_top_k_sampling: bool
    need_min_p_sampling: bool
    has_penalties: bool  # frequency, presence or repetition used by some row
    # logit_bias: logits[bias_rows[i], bias_ids[i]] += bias_values[i] (-inf for a ban); None
    # when no row has a bias.
    bias_rows: torch.Tensor | None = None  # int64 [L]
    bias_ids: torch.Tensor | None = None  # int64 [L]
    bias_values: torch.Tensor | None = None  # float32 [L]
    # Penalty state; None when no row uses the penalty.
    frequency_penalties: torch.Tensor | None = None  # float32 [B, 1]
    presence_penalties: torch.Tensor | None = None  # float32 [B, 1]
    output_counts: torch.Tensor | None = None  # float32 [B, V]
    repetition_penalties: torch.Tensor | None = None  # float32 [B, 1]
    seen_mask: torch.Tensor | None = None  # bool [B, V]: token in prompt or output
    # min_new_tokens: logits[min_tokens_rows[i], min_tokens_ids[i]] = -inf.
    min_tokens_rows: torch.Tensor | None = None  # int64 [M]
    min_tokens_ids: torch.Tensor | None = None  # int64 [M]
    # Constrained decoding: masks the disallowed tokens of the constrained rows, in place.
    vocab_mask: VocabMaskLike | None = None

    def to(self, device: torch.device | str) -> SamplingBatchInfo:
        """This batch's tensors on `device` (the logits' device): the scheduler builds them on
        the CPU. Itself when they are there already (always on a CPU server)."""
        if self.top_ps.device == torch.device(device):
            return self
        moved = {
            f.name: value.to(device, non_blocking=True)
            for f in dataclasses.fields(self)
            if isinstance(value := getattr(self, f.name), torch.Tensor)
        }
        return dataclasses.replace(self, **moved)

    @property
    def batch_size(self) -> int:
        return self.top_ps.shape[0]

    @property
    def argmax_only(self) -> bool:
        """Whether sampling reads nothing of the logits but each row's argmax: every row
        greedy, and no logit_bias, penalty, min-token mask or grammar mask to apply first."""
        return (
            self.is_all_greedy
            and self.bias_rows is None
            and not self.has_penalties
            and self.min_tokens_rows is None
            and self.vocab_mask is None
        )

    @classmethod
    def from_reqs(
        cls,
        reqs: Sequence[ReqLike],
        vocab_size: int,
        device: torch.device | str = "cpu",
        eos_token_ids: Sequence[int] = (),
        output_lens: Sequence[int] | None = None,
        vocab_mask: VocabMaskLike | None = None,
    ) -> SamplingBatchInfo:
        """`output_lens[i]`: output tokens request i has before this sample (default
        `len(output_ids)`); it indexes the seeded draw and gates `min_new_tokens`."""
        params = [r.sampling_params for r in reqs]
        if output_lens is None:
            output_lens = [len(r.output_ids) for r in reqs]
        greedy = [p.temperature < SAMPLING_EPS or p.top_k == 1 for p in params]
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        top_ks = [vocab_size if p.top_k < 0 else min(p.top_k, vocab_size) for p in params]
        sampled = [(p, k) for p, k, g in zip(params, top_ks, greedy) if not g]

        def f32(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        def i64(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        info = cls(
            vocab_size=vocab_size,
            temperatures=f32(temps).unsqueeze(1),
            top_ps=f32([p.top_p for p in params]),
            top_ks=i64(top_ks),
            min_ps=f32([p.min_p for p in params]),
            seeds=i64([_as_int64(r.sampling_seed) for r in reqs]),
            positions=i64(list(output_lens)),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            sampled_rows=i64([i for i, g in enumerate(greedy) if not g]),
            is_all_greedy=all(greedy),
            need_top_p_sampling=any(p.top_p < 1.0 for p, _ in sampled),
            need_top_k_sampling=any(k < vocab_size for _, k in sampled),
            need_min_p_sampling=any(p.min_p > 0.0 for p, _ in sampled),
            has_penalties=False,
            vocab_mask=vocab_mask,
        )
        info._build_logit_bias(params, device)
        info._build_penalties(reqs, device)
        info._build_min_tokens_mask(reqs, output_lens, eos_token_ids, device)
        return info

    def _build_logit_bias(
        self, params: Sequence[SamplingParams], device: torch.device | str
    ) -> None:
        """Sparse bias tensors from normalised, verified `logit_bias` maps (int keys)."""
        if not any(p.logit_bias for p in params):
            return
        rows: list[int] = []
        ids: list[int] = []
        values: list[float] = []
        for i, p in enumerate(params):
            for token, bias in (p.logit_bias or {}).items():
                rows.append(i)
                ids.append(int(token))
                values.append(float("-inf") if bias <= -MAX_LOGIT_BIAS_VALUE else float(bias))
        self.bias_rows = torch.tensor(rows, dtype=torch.int64, device=device)
        self.bias_ids = torch.tensor(ids, dtype=torch.int64, device=device)
        self.bias_values = torch.tensor(values, dtype=torch.float32, device=device)

    def _build_penalties(self, reqs: Sequence[ReqLike], device: torch.device | str) -> None:
        params = [r.sampling_params for r in reqs]
        if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
            self.frequency_penalties = _column([p.frequency_penalty for p in params], device)
            self.presence_penalties = _column([p.presence_penalty for p in params], device)
            self.output_counts = token_counts([r.output_ids for r in reqs], self.vocab_size, device)
            self.has_penalties = True
        if any(p.repetition_penalty != 1.0 for p in params):
            self.repetition_penalties = _column([p.repetition_penalty for p in params], device)
            seen = token_counts(
                [r.origin_input_ids + r.output_ids for r in reqs], self.vocab_size, device
            )
            self.seen_mask = seen > 0
            self.has_penalties = True

    def _build_min_tokens_mask(
        self,
        reqs: Sequence[ReqLike],
        output_lens: Sequence[int],
        eos_token_ids: Sequence[int],
        device: torch.device | str,
    ) -> None:
        rows: list[int] = []
        ids: list[int] = []
        for i, (r, n_out) in enumerate(zip(reqs, output_lens, strict=True)):
            p = r.sampling_params
            if n_out >= p.min_new_tokens:
                continue
            blocked = set(eos_token_ids) | set(p.stop_token_ids or ())
            blocked = {t for t in blocked if 0 <= t < self.vocab_size}
            rows.extend([i] * len(blocked))
            ids.extend(sorted(blocked))
        if rows:
            self.min_tokens_rows = torch.tensor(rows, dtype=torch.int64, device=device)
            self.min_tokens_ids = torch.tensor(ids, dtype=torch.int64, device=device)

    def apply_logits_processing(self, logits: torch.Tensor) -> torch.Tensor:
        """logit_bias, penalties, min-token masks and grammar masks, in the module docstring's
        order. Returns a new tensor when anything applies, else `logits` itself; the caller's
        tensor is never modified."""
        fresh = False  # whether `logits` is already our own tensor
        if self.bias_rows is not None:
            assert self.bias_ids is not None and self.bias_values is not None
            device = logits.device
            # Out of place: one indexed add that also makes the copy the later steps modify.
            # Keys are unique per row, so `accumulate` only means "add", never "sum twice".
            logits = logits.index_put(
                (self.bias_rows.to(device), self.bias_ids.to(device)),
                self.bias_values.to(device, logits.dtype),
                accumulate=True,
            )
            fresh = True
        if self.repetition_penalties is not None and self.seen_mask is not None:
            rp = self.repetition_penalties
            penalised = torch.where(logits > 0, logits / rp, logits * rp)
            logits = torch.where(self.seen_mask, penalised, logits)
            fresh = True
        if self.output_counts is not None:
            assert self.frequency_penalties is not None and self.presence_penalties is not None
            counts = self.output_counts
            logits = logits - (
                self.frequency_penalties * counts + self.presence_penalties * (counts > 0)
            )
            fresh = True
        if self.min_tokens_rows is not None and self.min_tokens_ids is not None:
            logits = logits if fresh else logits.clone()
            fresh = True
            logits[self.min_tokens_rows, self.min_tokens_ids] = float("-inf")
        if self.vocab_mask is not None:
            logits = logits if fresh else logits.clone()
            self.vocab_mask.apply(logits)
        return logits


def token_counts(
    id_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """float32 [B, V]: occurrences of each token id per row (one scatter_add, padded ids)."""
    batch = len(id_lists)
    width = max((len(ids) for ids in id_lists), default=0)
    counts = torch.zeros((batch, vocab_size), dtype=torch.float32, device=device)
    if width == 0:
        return counts
    padded = torch.zeros((batch, width), dtype=torch.int64)
    weights = torch.zeros((batch, width), dtype=torch.float32)
    for i, ids in enumerate(id_lists):
        if ids:
            padded[i, : len(ids)] = torch.as_tensor(ids, dtype=torch.int64)
            weights[i, : len(ids)] = 1.0
    counts.scatter_add_(1, padded.to(device), weights.to(device))
    return counts


def _column(values: list[float], device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def _as_int64(seed: int) -> int:
    """Reinterpret any Python int seed's low 64 bits as a signed int64."""
    s = seed & ((1 << 64) - 1)
    return s - (1 << 64) if s >= (1 << 63) else s
