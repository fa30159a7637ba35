"""`SeparateMemoryDouble`: a test double of a GPU's memory, so the GPU path runs on a CPU.

`device_memory` (srt/utils/device_memory.py) tells the runtime whether the device has
memory of its own. With this double installed it says yes for the CPU: the request table gets
a host mirror, batches go up through the staging copy, sampled ids come back through the
result channel, and the overlap loop runs without its forward thread, exactly as on a GPU.
"Device" tensors are ordinary CPU tensors, and every op completes when it returns, but the
double keeps a log of what a CUDA stream would see: each host-to-device and device-to-host
copy, each recorded event, and each host wait on an event that had not completed.

Events model one stream: waiting on an event completes it and every event recorded before
it, and `query` says whether that happened. So a wait is logged as a sync only when the host
would really have blocked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch


@dataclass
class FakeEvent:
    """Test double of a torch.cuda.Event on the one stream of `SeparateMemoryDouble`."""

    memory: SeparateMemoryDouble
    seq: int

    def query(self) -> bool:
        return self.seq <= self.memory.completed

    def synchronize(self) -> None:
        self.memory.log.append(("sync", self.seq))
        self.memory.completed = max(self.memory.completed, self.seq)


@dataclass
class SeparateMemoryDouble:
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    separate: bool = True
    log: list[tuple[Any, ...]] = field(default_factory=list)
    recorded: int = 0
    completed: int = 0
    pinned: set[int] = field(default_factory=set)  # data_ptrs of host buffers handed out

    def host_buffer(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        buf = torch.empty(n, dtype=dtype)
        self.pinned.add(buf.untyped_storage().data_ptr())
        return buf

    def _is_pinned(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self.pinned

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.log.append(("h2d", src.numel(), self._is_pinned(src)))
        dst.copy_(src)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.log.append(("d2h", src.numel(), self._is_pinned(dst)))
        dst.copy_(src)

    def record(self) -> FakeEvent:
        self.recorded += 1
        self.log.append(("record", self.recorded))
        return FakeEvent(self, self.recorded)

    def mark(self, *entry: Any) -> None:
        self.log.append(entry)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Every module that asks `device_memory` gets this double for the CPU."""
        import managers.overlap_worker
        import mem_cache.memory_pool
        import srt.model_executor.model_runner

        def pick(device: Any) -> Any:
            return self

        for module in (
            managers.overlap_worker,
            mem_cache.memory_pool,
            srt.model_executor.model_runner,
        ):
            monkeypatch.setattr(module, "device_memory", pick)
