"""Optional FlashInfer top-k / top-p sampling kernels (`--sampling-backend flashinfer`).

The default stays the seeded sampler (`srt/sampling/sampler.py`): its draws are a
function of (request seed, output position, token), so a request samples the same tokens
whatever shares its batch, with or without overlap, retraction or CUDA graphs. FlashInfer's
rejection-sampling kernels avoid the sort and are faster for large vocabularies, but they
draw from torch's CUDA generator, so outputs depend on batch composition and are not
reproducible per request; that is why they are opt-in.

Only the draw of sampled rows changes: `forward` is the seeded sampler's, so logit_bias,
penalties and grammar masks (`apply_logits_processing`), logprobs, greedy rows and the filter
semantics (top_k and top_p both judged on the full distribution: FlashInfer's "joint"
order) are the seeded sampler's. Batches with min_p or CPU logits fall back to the seeded
draw. `srt/sampling/registry.py` builds this sampler only on CUDA with flashinfer installed.
"""

from __future__ import annotations

import torch

from srt.sampling.sampler import Sampler
from srt.sampling.sampling_batch_info import SamplingBatchInfo


class FlashInferSampler(Sampler):
    def _sample(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        if not logits.is_cuda or info.need_min_p_sampling:
            return super()._sample(logits, info)
        from flashinfer.sampling import top_k_top_p_sampling_from_probs

        device = logits.device
        rows = info.sampled_rows.to(device)
        all_sampled = rows.numel() == logits.shape[0]

        def pick(t: torch.Tensor) -> torch.Tensor:
            t = t.to(device)
            return t if all_sampled else t[rows]

        probs = torch.softmax(pick(logits) / pick(info.temperatures), dim=-1)
        sampled = top_k_top_p_sampling_from_probs(
            probs,
            pick(info.top_ks).to(torch.int32),
            pick(info.top_ps).float(),
            filter_apply_order="joint",
        ).to(torch.int64)
        if all_sampled:
            return sampled
        next_ids = logits.argmax(dim=-1)
        next_ids[rows] = sampled
        return next_ids
