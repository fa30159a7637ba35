"""Turn one step's logits into next tokens (and logprobs), batch-composition independent.

Order of operations in `Sampler.forward`:
  1. logit_bias, penalties, min-token and grammar masks
     (`SamplingBatchInfo.apply_logits_processing`);
  2. logprobs to return = log_softmax of those processed logits, BEFORE temperature and
     filtering: they describe the model's (biased, penalised) distribution, not the sampling
     distribution, and they are the same for greedy and sampled requests (OpenAI / SGLang
     behaviour). So a request's logit_bias shows in its returned logprobs (a banned token's
     is -inf);
  3. greedy rows: argmax;
  4. sampled rows: softmax(logits / T), keep the intersection of top_k, top_p and min_p
     (each judged on that full distribution; the top token is always kept), and draw from
     the kept tokens renormalised.

The draw is an exponential race (Gumbel-max): token = argmax_v p_v / E_v with
E_v = -log(u_v) and u_v = hash(seed, output position, v) (`seeded_noise`). It is exactly a
draw from p_v / sum(p), and a function of the request alone, whatever shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from srt.sampling.sampling_batch_info import SamplingBatchInfo
from srt.sampling.seeded_noise import seeded_exponential


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)`; on CPU float32 rows through the compiled kernel
    (`srt/kernels/layer_ops.py`): the same ids, several times sooner than torch's over a large
    vocabulary (`python -m bench.bench_one_batch --dtype float32` shows it in the decode step)."""
    if logits.device.type == "cpu" and logits.dim() == 2 and logits.dtype == torch.float32:
        from srt.kernels.layer_ops import layer_ops_kernel

        kernel = layer_ops_kernel()
        if kernel is not None and logits.shape[1] > 0 and logits.stride(1) == 1:
            return kernel.argmax(logits)
    return logits.argmax(dim=-1)


@dataclass(slots=True)
class SampleOutput:
    next_token_ids: torch.Tensor  # int64 [B]
    next_token_logprobs: torch.Tensor | None = None  # float32 [B]
    top_logprobs_val: list[list[float]] | None = None
    top_logprobs_idx: list[list[int]] | None = None


class Sampler:
    """Stateless; `candidate_budget` bounds the partial sort tried before a full-vocab sort."""

    def __init__(self, candidate_budget: int = 1024) -> None:
        self.candidate_budget = candidate_budget

    def __call__(
        self,
        logits: torch.Tensor,
        info: SamplingBatchInfo,
        return_logprob: bool = False,
        top_logprobs_nums: list[int] | None = None,
    ) -> SampleOutput:
        return self.forward(logits, info, return_logprob, top_logprobs_nums)

    def forward(
        self,
        logits: torch.Tensor,
        info: SamplingBatchInfo,
        return_logprob: bool = False,
        top_logprobs_nums: list[int] | None = None,
    ) -> SampleOutput:
        """`logits`: [B, V] (float32; other dtypes are upcast), never modified in place."""
        logits = info.apply_logits_processing(logits.float())
        if info.is_all_greedy:
            next_ids = greedy_ids(logits)
        else:
            next_ids = self._sample(logits, info)
        out = SampleOutput(next_token_ids=next_ids)
        if return_logprob:
            logprobs = torch.log_softmax(logits, dim=-1)
            out.next_token_logprobs = get_token_logprobs(logprobs, next_ids)
            if top_logprobs_nums and max(top_logprobs_nums) > 0:
                out.top_logprobs_val, out.top_logprobs_idx = get_top_logprobs(
                    logprobs, top_logprobs_nums
                )
        return out

    def _sample(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        rows = info.sampled_rows
        all_sampled = rows.numel() == logits.shape[0]

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t if all_sampled else t[rows]

        seeds, positions = pick(info.seeds), pick(info.positions)
        probs = torch.softmax(pick(logits) / pick(info.temperatures), dim=-1)
        need_k, need_p = info.need_top_k_sampling, info.need_top_p_sampling
        need_min_p = info.need_min_p_sampling
        if not (need_k or need_p or need_min_p):
            vocab = torch.arange(probs.shape[1], device=probs.device).unsqueeze(0)
            sampled = (probs / seeded_exponential(seeds, positions, vocab)).argmax(dim=-1)
        else:
            top_ks, top_ps, min_ps = pick(info.top_ks), pick(info.top_ps), pick(info.min_ps)
            cand_p, cand_ids = self._candidates(probs, top_ks, top_ps, min_ps, need_p, need_min_p)
            cand_p = filter_sorted(cand_p, top_ks, top_ps, min_ps, need_k, need_p, need_min_p)
            # Every filter keeps a prefix of the sorted order: drop the all-zero tail. At least
            # one column stays: a row whose every token is masked (its grammar allows only EOS,
            # which min_new_tokens forbids) has no positive probability, and like a greedy row
            # it gets a token its grammar then rejects.
            kept = max(1, int((cand_p > 0).sum(dim=-1).max()))
            cand_p, cand_ids = cand_p[:, :kept], cand_ids[:, :kept]
            noise = seeded_exponential(seeds, positions, cand_ids)
            best = (cand_p / noise).argmax(dim=-1, keepdim=True)
            sampled = cand_ids.gather(1, best).squeeze(1)
        if all_sampled:
            return sampled
        next_ids = logits.argmax(dim=-1)
        next_ids[rows] = sampled
        return next_ids

    def _candidates(
        self,
        probs: torch.Tensor,
        top_ks: torch.Tensor,
        top_ps: torch.Tensor,
        min_ps: torch.Tensor,
        need_p: bool,
        need_min_p: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Probabilities sorted descending with their token ids: a prefix of the vocabulary's
        sorted order long enough to hold every row's kept set (a partial sort when possible)."""
        vocab = probs.shape[1]
        k_max = int(top_ks.max())
        budget = self.candidate_budget
        if k_max <= budget or budget >= vocab:
            return probs.topk(min(k_max, vocab), dim=-1)
        vals, ids = probs.topk(budget, dim=-1)
        # The token at rank `budget` is dropped when some filter already cuts before it.
        fits = top_ks <= budget
        if need_p:
            fits |= vals.cumsum(dim=-1)[:, -1] > top_ps
        if need_min_p:
            fits |= vals[:, -1] < vals[:, 0] * min_ps
        if bool(fits.all()):
            return vals, ids
        if k_max < vocab:
            return probs.topk(k_max, dim=-1)
        return probs.sort(dim=-1, descending=True, stable=True)


def filter_sorted(
    sorted_probs: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
    need_k: bool = True,
    need_p: bool = True,
    need_min_p: bool = True,
) -> torch.Tensor:
    """Zero the tokens outside top_k / top_p / min_p in descending-sorted probabilities
    ([N, K], a prefix of the sorted vocabulary). Not renormalised."""
    out = sorted_probs
    if need_k:
        ranks = torch.arange(sorted_probs.shape[1], device=sorted_probs.device)
        out = out.masked_fill(ranks.unsqueeze(0) >= top_ks.unsqueeze(1), 0.0)
    if need_p:
        # Exclusive cumulative mass: the token that crosses top_p is kept, so is the top one.
        # Shifted, not `cumsum - p`, so the value at a rank does not depend on the prefix length.
        cum = sorted_probs.cumsum(dim=-1)
        before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=1)
        drop = (before > top_ps.unsqueeze(1)) & (top_ps.unsqueeze(1) < 1.0)
        out = out.masked_fill(drop, 0.0)
    if need_min_p:
        threshold = sorted_probs[:, :1] * min_ps.unsqueeze(1)
        out = out.masked_fill(sorted_probs < threshold, 0.0)
    return out


def top_k_top_p_min_p_filter(
    probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor
) -> torch.Tensor:
    """[N, V] probabilities -> the renormalised distribution over the kept tokens.

    `top_ks` int64 [N] (use V or more for "off"), `top_ps` and `min_ps` float [N]."""
    sorted_probs, ids = probs.sort(dim=-1, descending=True, stable=True)
    kept = filter_sorted(sorted_probs, top_ks, top_ps, min_ps)
    out = torch.zeros_like(probs).scatter_(1, ids, kept)
    return out / out.sum(dim=-1, keepdim=True)


def get_token_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """logprobs [N, V], token_ids int64 [N] -> [N]: each row's logprob of its token."""
    return logprobs.gather(1, token_ids.view(-1, 1).to(torch.int64)).squeeze(1)


def get_top_logprobs(
    logprobs: torch.Tensor, nums: list[int]
) -> tuple[list[list[float]], list[list[int]]]:
    """Row i's `nums[i]` largest logprobs (descending) and their token ids, as lists."""
    k = min(max(nums, default=0), logprobs.shape[1])
    if k <= 0:
        return [[] for _ in nums], [[] for _ in nums]
    vals, ids = logprobs.topk(k, dim=-1)
    vals_l, ids_l = vals.tolist(), ids.tolist()
    return (
        [row[:n] for row, n in zip(vals_l, nums)],
        [row[:n] for row, n in zip(ids_l, nums)],
    )
