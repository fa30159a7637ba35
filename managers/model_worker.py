"""`ModelWorker`: turns a `ModelWorkerBatch` into a forward, a sample and a result.

The scheduler only talks to this interface (`model_config`, `get_memory_pool()`,
`forward_batch_generation()`), which is what lets tests swap in a scripted worker; the
overlap loop on a GPU also calls `launch`, which returns before the forward is done.

A step: the batch's host inputs go to the device in one staging copy (`to_forward_batch`,
`srt/model_executor/step_inputs.py`), the forward and the sampler are queued, and the
sampled ids come back through `ResultChannel` (one non-blocking copy into pinned memory and
an event; `worker_results.py`). A batch that samples only by argmax (greedy, nothing applied
to the logits, no logprobs) has no `SamplingBatchInfo` at all; another keeps its sampling
tensors on the device for as long as the scheduler hands the same one.

Tensor parallelism: every rank samples from the same all-gathered float32 logits with the
same seeded sampler, then takes rank 0's ids (`TPGroup.broadcast_tensor`, on the thread
that runs forwards). So the ids every rank feeds back into its scheduler are rank 0's by
construction, even where ranks' CPUs round differently. A follower counts the ids it had
sampled differently in `tp_sample_mismatches` (tests assert 0 on one machine).
"""

from __future__ import annotations

import dataclasses
import logging
import threading

import numpy as np
import torch

from managers.schedule_batch import GenerationBatchResult, ModelWorkerBatch, token_positions
from managers.worker_results import InputLogprobs, LaunchedBatch, ResultChannel
from srt.configs.model_config import ModelConfig
from srt.configs.pooling import read_pooling_config
from srt.distributed import TPGroup
from srt.model_executor.forward_batch import ForwardBatch
from srt.model_executor.model_runner import ModelRunner
from srt.model_executor.step_inputs import (
    GRAPH_PADDING,
    FutureSlots,
    Pack,
    resolve_future_ids,
    write_on_device,
)
from srt.sampling.sampler import get_token_logprobs, get_top_logprobs, greedy_ids
from srt.sampling.sampling_batch_info import SamplingBatchInfo
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
        # An embedding server pools hidden states instead of sampling (`launch_pooled`).
        self.pooling = (
            read_pooling_config(self.model_config.model_path, self.model_config.hf_config.to_dict())
            if server_args.is_embedding
            else None
        )
        self.device = self.model_runner.device
        self.num_forwards = 0
        self.tp_sample_mismatches = 0  # ids this rank sampled unlike rank 0 (tp > 1 only)
        self.hang_at_forward = hang_at_forward
        self.results = ResultChannel(
            self.model_runner.memory, self.model_runner.max_running_requests
        )
        # The last step's sampling tensors, host and device (`_sampling_on_device`).
        self._sampling_host: SamplingBatchInfo | None = None
        self._sampling_device: SamplingBatchInfo | None = None
        if hang_at_forward:
            logger.warning("Test hook: forward %d will hang.", hang_at_forward)

    def get_memory_pool(self):
        return self.model_runner.req_to_token_pool, self.model_runner.allocator

    # ---- one forward ---------------------------------------------------------------
    def forward_batch_generation(self, mwb: ModelWorkerBatch) -> GenerationBatchResult:
        """Run `mwb` and wait for its result (the normal loop, and the CPU's overlap thread)."""
        return self.launch(mwb).resolve()

    @torch.inference_mode()
    def launch(self, mwb: ModelWorkerBatch, future: FutureSlots | None = None) -> LaunchedBatch:
        """Queue `mwb`'s forward and sampling; return at once with a handle on the result.

        On a GPU nothing here waits for the device: the inputs go up in one staging copy
        (`to_forward_batch`), the sampled ids come back by a non-blocking copy into pinned
        memory, and `LaunchedBatch.resolve` waits for that copy's event. Batches that return
        logprobs are the exception: their top-k lists and prompt logprobs are read here.
        `future`: where to also write the sampled ids on the device, for later batches whose
        input ids name them (the overlap loop)."""
        self.num_forwards += 1
        if self.num_forwards == self.hang_at_forward:
            logger.warning("Test hook: forward %d hangs.", self.num_forwards)
            threading.Event().wait()  # forever
        if self.pooling is not None:
            return self.launch_pooled(mwb)
        forward_batch, staged = self.to_forward_batch(mwb, future)
        logits = self.model_runner.forward(forward_batch)
        sample_indices = staged.get("sample_indices")
        sample_logits = logits if sample_indices is None else logits[sample_indices]
        out = None
        with torch.profiler.record_function("sampling"):
            if mwb.sampling_info is None:
                next_ids = greedy_ids(sample_logits)
            else:
                out = self.model_runner.sampler.forward(
                    sample_logits,
                    self._sampling_on_device(mwb, staged),
                    return_logprob=mwb.return_logprob,
                    top_logprobs_nums=mwb.top_logprobs_nums,
                )
                next_ids = out.next_token_ids
        differ = None
        if self.tp.size > 1:
            next_ids, differ = self._take_leader_ids(next_ids)
        if future is not None:
            future.buffer[future.first : future.first + len(next_ids)] = next_ids
        launched = self.results.send(next_ids, out, differ)
        if mwb.return_logprob and out is not None and out.top_logprobs_val is not None:
            launched.top_logprobs = [
                list(zip(v, i, strict=True))
                for v, i in zip(out.top_logprobs_val, out.top_logprobs_idx, strict=True)
            ]
        if any(spec is not None for spec in mwb.input_logprob_specs):
            launched.input_logprobs = self._input_logprobs(logits, mwb)
        launched.on_differ = self._count_mismatches
        return launched

    def launch_pooled(self, mwb: ModelWorkerBatch) -> LaunchedBatch:
        """An embedding server's forward: each request's pooling part comes back to the host
        (`srt/layers/pooler.py`); nothing is sampled (its requests generate no token)."""
        assert self.pooling is not None
        forward_batch, _ = self.to_forward_batch(mwb)
        parts = self.model_runner.forward_pooled(forward_batch, self.pooling.method)
        no_ids = torch.zeros(len(mwb.seq_lens), dtype=torch.int64)
        return LaunchedBatch(no_ids, None, pooled=parts.cpu())

    def to_forward_batch(
        self, mwb: ModelWorkerBatch, future: FutureSlots | None = None
    ) -> tuple[ForwardBatch, dict[str, torch.Tensor]]:
        """The batch's inputs staged on the device in one copy (`step_inputs.py`), the
        device's request table written, future ids resolved; and the staged fields."""
        runner = self.model_runner
        decode = mwb.forward_mode.is_decode()
        bs = len(mwb.seq_lens)
        graph_bs = runner.graph_batch_size(bs) if decode else None
        logged = runner.req_to_token_pool.take_logged()
        pack = _pack(mwb, graph_bs, logged, runner.req_to_token_pool.mirrored)
        if graph_bs is not None and not runner.stager.fits_graph(pack):
            graph_bs = None  # too much else to stage this step: run it eagerly
            pack = _pack(mwb, None, logged, runner.req_to_token_pool.mirrored)
        staged = runner.stager.send(pack, graph_bs)
        tokens = len(mwb.input_ids)
        write_on_device(runner.req_to_token_pool, staged, bs if decode else tokens, decode)
        if future is not None:
            resolve_future_ids(staged["input_ids"][:tokens], future.buffer)
        extend = mwb.forward_mode.is_extend()
        prefix_lens = mwb.prefix_lens if extend else None
        return (
            ForwardBatch(
                forward_mode=mwb.forward_mode,
                batch_size=bs,
                input_ids=staged["input_ids"][:tokens],
                positions=staged["positions"][:tokens],
                out_cache_loc=staged["out_cache_loc"][:tokens],
                req_pool_indices=staged["req_pool_indices"][:bs],
                seq_lens=staged["seq_lens"][:bs],
                seq_lens_cpu=mwb.seq_lens,
                extend_prefix_lens=staged.get("extend_prefix_lens"),
                extend_seq_lens=staged.get("extend_seq_lens"),
                extend_prefix_lens_cpu=prefix_lens,
                extend_seq_lens_cpu=mwb.extend_lens() if extend else None,
                logits_indices=staged.get("logits_indices"),
                argmax_only=mwb.argmax_only(),
                graph_bs=graph_bs,
            ),
            staged,
        )

    def _sampling_on_device(
        self, mwb: ModelWorkerBatch, staged: dict[str, torch.Tensor]
    ) -> SamplingBatchInfo:
        """The batch's sampling tensors on the device: copied when the scheduler hands a new
        `SamplingBatchInfo` (the batch's requests or parameters changed), else the copy kept
        from the last step; the per-step positions come from the staging copy."""
        info = mwb.sampling_info
        assert info is not None
        if info is not self._sampling_host:
            self._sampling_host = info
            self._sampling_device = info.to(self.device)
        return dataclasses.replace(self._sampling_device, positions=staged["sample_positions"])

    def _take_leader_ids(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank 0's sampled ids, on every rank, and how many of this rank's differed (a
        device scalar, counted when the result is resolved: `_count_mismatches`)."""
        own = ids.clone()
        leader = self.tp.broadcast_tensor(ids.contiguous(), 0)
        return leader, (own != leader).sum()

    def _count_mismatches(self, differ: int, batch_size: int) -> None:
        if differ:
            self.tp_sample_mismatches += differ
            logger.debug(
                "TP rank %d: %d of %d sampled ids differ from rank 0's (%d so far)",
                self.tp.rank,
                differ,
                batch_size,
                self.tp_sample_mismatches,
            )

    @staticmethod
    def _input_logprobs(logits: torch.Tensor, mwb: ModelWorkerBatch) -> InputLogprobs:
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
        return values, tops


def _pack(
    mwb: ModelWorkerBatch,
    graph_bs: int | None,
    logged: tuple[list[int], list[int], torch.Tensor] | None,
    mirrored: bool,
) -> Pack:
    """The step's host inputs as one `Pack`: for a decode step that a graph replays, the
    graph's fields first, padded to its size (`GRAPH_FIELDS`, `GRAPH_PADDING`)."""
    pack = Pack()
    if mwb.forward_mode.is_decode():
        n = graph_bs or len(mwb.seq_lens)
        pack.add("input_ids", mwb.input_ids, n)
        pack.add("positions", mwb.prefix_lens, n)  # a decode token sits at its prefix length
        pack.add("out_cache_loc", mwb.out_cache_loc, n)
        pack.add("req_pool_indices", mwb.req_pool_indices, n)
        pack.add("seq_lens", mwb.seq_lens, n, GRAPH_PADDING["seq_lens"])
    else:
        prefix = np.asarray(mwb.prefix_lens, dtype=np.int64)
        new = np.asarray(mwb.seq_lens, dtype=np.int64) - prefix
        pack.add("input_ids", mwb.input_ids)
        pack.add("positions", token_positions(mwb.prefix_lens, mwb.seq_lens))
        pack.add("out_cache_loc", mwb.out_cache_loc)
        pack.add("req_pool_indices", mwb.req_pool_indices)
        pack.add("seq_lens", mwb.seq_lens)
        pack.add("extend_prefix_lens", prefix)
        pack.add("extend_seq_lens", new)
        if mirrored:  # each new token's request row, for the device table's write
            pack.add("token_rows", np.repeat(np.asarray(mwb.req_pool_indices), new))
        pack.add("logits_indices", mwb.logits_indices)
        if mwb.sample_indices is not None:
            pack.add("sample_indices", mwb.sample_indices)
    if mwb.sampling_info is not None:
        pack.add("sample_positions", mwb.sample_positions)
    if logged is not None:
        rows, cols, slots = logged
        pack.add("logged_rows", rows)
        pack.add("logged_cols", cols)
        pack.add("logged_slots", slots)
    return pack
