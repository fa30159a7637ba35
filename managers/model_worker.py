"""`ModelWorker`: turns a `ModelWorkerBatch` into a forward, a sample and a result.

The scheduler only talks to this interface (`model_config`, `get_memory_pool()`,
`forward_batch_generation()`), which is what lets tests swap in a scripted worker.

Tensor parallelism: every rank samples from the same all-gathered float32 logits with the
same seeded sampler, then takes rank 0's ids (`TPGroup.broadcast_tensor`, on the thread
that runs forwards). So the ids every rank feeds back into its scheduler are rank 0's by
construction, even where ranks' CPUs round differently. A follower counts the ids it had
sampled differently in `tp_sample_mismatches` (tests assert 0 on one machine).
"""

from __future__ import annotations

import logging
import threading

import torch

from managers.schedule_batch import GenerationBatchResult, ModelWorkerBatch
from srt.configs.model_config import ModelConfig
from srt.distributed import TPGroup
from srt.model_executor.forward_batch import ForwardBatch
from srt.model_executor.model_runner import ModelRunner
from srt.sampling.sampler import get_token_logprobs, get_top_logprobs
from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


class ModelWorker:
    def __init__(
        self,
        server_args: ServerArgs,
        model_config: ModelConfig | None = None,
        tp: TPGroup | None = None,
        hang_at_forward: int = 0,
    ) -> None:
        """`hang_at_forward`: a test hook, not a setting: the N-th forward (1-based) never
        returns, to prove the scheduler's watchdog (0: none; see `srt/environ.py`)."""
        self.server_args = server_args
        self.tp = tp or TPGroup.single()
        self.model_config = model_config or ModelConfig.from_path(
            server_args.model_path,
            dtype=server_args.dtype,
            context_length=server_args.context_length,
            cache_dir=server_args.cache_dir,
            device=server_args.resolved_device(),
        )
        self.model_runner = ModelRunner(self.model_config, server_args, self.tp)
        self.device = self.model_runner.device
        self.num_forwards = 0
        self.tp_sample_mismatches = 0  # ids this rank sampled unlike rank 0 (tp > 1 only)
        self.hang_at_forward = hang_at_forward
        if hang_at_forward:
            logger.warning("Test hook: forward %d will hang.", hang_at_forward)

    def get_memory_pool(self):
        return self.model_runner.req_to_token_pool, self.model_runner.allocator

    def to_forward_batch(self, mwb: ModelWorkerBatch) -> ForwardBatch:
        dev = self.device

        def lens(xs: list[int] | None) -> torch.Tensor | None:
            return None if xs is None else torch.tensor(xs, dtype=torch.int64, device=dev)

        return ForwardBatch(
            forward_mode=mwb.forward_mode,
            batch_size=len(mwb.seq_lens_cpu),
            input_ids=mwb.input_ids.to(dev),
            positions=mwb.positions.to(dev),
            out_cache_loc=mwb.out_cache_loc.to(dev),
            req_pool_indices=mwb.req_pool_indices.to(dev),
            seq_lens=mwb.seq_lens.to(dev),
            seq_lens_cpu=mwb.seq_lens_cpu,
            extend_prefix_lens=lens(mwb.extend_prefix_lens_cpu),
            extend_seq_lens=lens(mwb.extend_seq_lens_cpu),
            extend_prefix_lens_cpu=mwb.extend_prefix_lens_cpu,
            extend_seq_lens_cpu=mwb.extend_seq_lens_cpu,
            logits_indices=mwb.logits_indices.to(dev),
            # One logits row per request, read only by its argmax: no logprobs of the
            # output or of the prompt, and sampling that takes the argmax alone.
            argmax_only=not mwb.return_logprob
            and all(spec is None for spec in mwb.input_logprob_specs)
            and mwb.sampling_info.argmax_only,
        )

    @torch.inference_mode()
    def forward_batch_generation(self, mwb: ModelWorkerBatch) -> GenerationBatchResult:
        self.num_forwards += 1
        if self.num_forwards == self.hang_at_forward:
            logger.warning("Test hook: forward %d hangs.", self.num_forwards)
            threading.Event().wait()  # forever
        logits = self.model_runner.forward(self.to_forward_batch(mwb))
        if mwb.forward_mode.is_decode():
            sample_logits = logits  # one logits row per request, in order: no [B, V] gather
        else:
            sample_logits = logits[mwb.sample_indices.to(logits.device)]
        with torch.profiler.record_function("sampling"):
            out = self.model_runner.sampler.forward(
                sample_logits,
                mwb.sampling_info.to(sample_logits.device),
                return_logprob=mwb.return_logprob,
                top_logprobs_nums=mwb.top_logprobs_nums,
            )
        next_ids = out.next_token_ids
        if self.tp.size > 1:
            next_ids = self._take_leader_ids(next_ids)
        result = GenerationBatchResult(next_token_ids=next_ids.tolist())
        if mwb.return_logprob:
            result.next_token_logprobs = out.next_token_logprobs.tolist()
            if out.top_logprobs_val is not None:
                result.next_top_logprobs = [
                    list(zip(v, i, strict=True))
                    for v, i in zip(out.top_logprobs_val, out.top_logprobs_idx, strict=True)
                ]
        if any(spec is not None for spec in mwb.input_logprob_specs):
            self._input_logprobs(logits, mwb, result)
        return result

    def _take_leader_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Rank 0's sampled ids, on every rank; counts where this rank's differed."""
        own = ids.clone()
        leader = self.tp.broadcast_tensor(ids.contiguous(), 0)
        differ = int((own != leader).sum())
        if differ:
            self.tp_sample_mismatches += differ
            logger.debug(
                "TP rank %d: %d of %d sampled ids differ from rank 0's (forward %d, %d so far)",
                self.tp.rank,
                differ,
                len(own),
                self.num_forwards,
                self.tp_sample_mismatches,
            )
        return leader

    @staticmethod
    def _input_logprobs(
        logits: torch.Tensor, mwb: ModelWorkerBatch, result: GenerationBatchResult
    ) -> None:
        """Prompt logprobs: the raw model distribution at each prompt position."""
        values: list[list[float] | None] = []
        tops: list[list[list[tuple[float, int]]] | None] = []
        for spec, k in zip(mwb.input_logprob_specs, mwb.top_logprobs_nums, strict=True):
            if spec is None:
                values.append(None)
                tops.append(None)
                continue
            first_row, targets = spec
            rows = torch.log_softmax(logits[first_row : first_row + len(targets)].float(), dim=-1)
            ids = torch.tensor(targets, dtype=torch.int64, device=rows.device)
            values.append(get_token_logprobs(rows, ids).tolist())
            if k:
                vals, idx = get_top_logprobs(rows, [k] * len(targets))
                tops.append([list(zip(v, i, strict=True)) for v, i in zip(vals, idx, strict=True)])
            else:
                tops.append(None)
        result.input_token_logprobs = values
        result.input_top_logprobs = tops
