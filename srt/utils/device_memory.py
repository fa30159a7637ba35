"""Where host and device memory meet: pinned staging memory, copies, and completion events.

A GPU has memory of its own. The runtime keeps its bookkeeping (the request table's mirror,
free lists, token ids) on the host and moves one staging buffer per step to the device
(`step_inputs.py`); results come back by one non-blocking copy into pinned memory plus an
event the scheduler waits on only where it reads them. `CudaMemory` does this with CUDA
streams and events. On a CPU there is nothing to move: `SharedMemory` says so
(`separate = False`), and the callers skip the copies and the mirror.

`device_memory(device)` picks one; tests replace it to run the GPU path's logic on a CPU with
a test double whose "device" tensors are separate CPU tensors, counting copies and waits.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class Event(Protocol):
    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class DeviceMemory(Protocol):
    device: torch.device
    separate: bool  # the device has memory of its own: host data must be copied there

    def host_buffer(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        """A host tensor the device can copy from asynchronously (pinned on a GPU)."""

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue `dst.copy_(src)` on the current stream without waiting for it."""

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue `dst.copy_(src)` (device -> pinned host) without waiting for it."""

    def record(self) -> Event | None:
        """An event completed once everything queued so far on the current stream is done;
        None where work is done when it returns (a CPU)."""


def wait(event: Event | None) -> None:
    """Block until `event` completed; no call into the driver's blocking wait when it has."""
    if event is not None and not event.query():
        event.synchronize()


class SharedMemory:
    """A CPU: one memory, every op done when it returns."""

    separate = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def host_buffer(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(n, dtype=dtype)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def record(self) -> None:
        return None


class CudaMemory:
    """A GPU: pinned host buffers, non-blocking copies on the current stream, CUDA events."""

    separate = True

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def host_buffer(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(n, dtype=dtype, pin_memory=True)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def record(self) -> Any:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event


def device_memory(device: str | torch.device) -> DeviceMemory:
    device = torch.device(device)
    return CudaMemory(device) if device.type == "cuda" else SharedMemory(device)


class StandInMemory(SharedMemory):
    """A CPU standing in for a device with memory of its own: every "device" tensor is a
    separate CPU tensor, so the GPU path's host work (the request table's mirror, the
    staging copy, the result channel, the overlap loop without its thread) runs and can be
    timed on a CPU (`bench/host_overhead.py --loops overlap-gpu`). Copies are done when they
    return, so there are no events."""

    separate = True
