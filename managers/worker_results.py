"""A launched forward's result, on its way back to the host.

`ResultChannel.send` queues the sampled ids (and their logprobs, when asked) into pinned host
memory with one non-blocking copy each and records an event; `LaunchedBatch.resolve` waits
for that event and turns them into the `GenerationBatchResult` the scheduler processes. The
overlap loop resolves batch N only after it launched N+1, so the wait is where the host has
nothing left to prepare. On a CPU the sampled tensors are already on the host: no copy, no
event.

Pinned buffers come from a small ring, each reused `RING` sends later: the overlap loop holds
at most two results unresolved, so a buffer is never rewritten before it was read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from managers.schedule_batch import GenerationBatchResult
from srt.utils.device_memory import DeviceMemory, Event, wait

if TYPE_CHECKING:
    from srt.sampling.sampler import SampleOutput

RING = 4
# Prompt logprobs per request (None where not asked): values, and top-k lists.
InputLogprobs = tuple[list[list[float] | None], list[list[list[tuple[float, int]]] | None]]


@dataclass(slots=True)
class LaunchedBatch:
    ids: torch.Tensor  # host: the sampled ids once `ready` completed
    ready: Event | None  # None: already on the host
    logprobs: torch.Tensor | None = None  # host, like ids
    differ: torch.Tensor | None = None  # tensor parallelism: ids this rank sampled unlike rank 0
    top_logprobs: list[list[tuple[float, int]]] | None = None
    input_logprobs: InputLogprobs | None = None
    pooled: torch.Tensor | None = None  # host: an embedding server's pooling parts [N, hidden]
    on_differ: Callable[[int, int], None] | None = field(default=None, repr=False)

    def resolve(self) -> GenerationBatchResult:
        """Wait for the ids to reach the host (the one sync of a steady decode step)."""
        wait(self.ready)
        result = GenerationBatchResult(next_token_ids=self.ids.tolist())
        if self.logprobs is not None:
            result.next_token_logprobs = self.logprobs.tolist()
            result.next_top_logprobs = self.top_logprobs
        result.pooled = self.pooled
        if self.input_logprobs is not None:
            result.input_token_logprobs, result.input_top_logprobs = self.input_logprobs
        if self.differ is not None and self.on_differ is not None:
            self.on_differ(int(self.differ), len(self.ids))
        return result


class ResultChannel:
    def __init__(self, memory: DeviceMemory, max_batch_size: int) -> None:
        self.memory = memory
        self.capacity = max(max_batch_size, 1)
        self.ring: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.next = 0

    def _buffers(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.ring or n > self.capacity:
            self.capacity = max(self.capacity, n)
            self.ring = [
                (
                    self.memory.host_buffer(self.capacity, torch.int64),
                    self.memory.host_buffer(self.capacity, torch.float32),
                )
                for _ in range(RING)
            ]
        ids, logprobs = self.ring[self.next]
        self.next = (self.next + 1) % RING
        return ids[:n], logprobs[:n]

    def send(
        self, next_ids: torch.Tensor, out: SampleOutput | None, differ: torch.Tensor | None
    ) -> LaunchedBatch:
        logprobs = out.next_token_logprobs if out is not None else None
        if not self.memory.separate:
            return LaunchedBatch(next_ids, None, logprobs, differ)
        ids_host, logprobs_host = self._buffers(len(next_ids))
        self.memory.to_host(ids_host, next_ids)
        if logprobs is not None:
            self.memory.to_host(logprobs_host, logprobs)
        differ_host = None
        if differ is not None:
            differ_host = self.memory.host_buffer(1, torch.int64)
            self.memory.to_host(differ_host, differ.view(1))
        return LaunchedBatch(
            ids_host,
            self.memory.record(),
            logprobs_host if logprobs is not None else None,
            differ_host,
        )
