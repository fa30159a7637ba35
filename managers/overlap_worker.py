"""`OverlapWorker`: the overlap loop's side of the model worker. `launch` queues a forward and
returns at once with its future token ids; `wait_result` hands back the oldest launched
forward's result. The scheduler launches batch N+1 before it waits for batch N, so the host
builds and stages N+1 while the device (or the forward thread) still runs N.

Future token ids: each request of a launched batch gets a placeholder `-(slot)`, naming a
slot of the future buffer that the forward's sampled id is written to. The next batch may
carry placeholders as input ids (the scheduler built it before N's tokens were known); they
are replaced by the real ids just before that forward. Slots form a ring that a batch reuses
only `FUTURE_MAP_BATCHES` batches later.

Two ways to run, one per kind of device:

- **GPU: no thread.** `launch` calls `worker.launch` on the scheduler's thread, which only
  queues work on the current CUDA stream: the staging copy, the device's request-table
  writes, the placeholder swap (`resolve_future_ids`: a gather from the future buffer, on the
  device), the forward, the sampler, the write of the sampled ids into the future buffer and
  their copy into pinned memory. Stream order makes every hazard safe (batch N+1 reads N's ids
  and N's table writes after N ran), so no event is waited on before a launch. `wait_result`
  waits for batch N's copy event, the one sync of a steady step. A second Python thread would
  add GIL contention and nothing else: the device already runs N+1 while the host waits.
- **CPU: a forward thread.** A CPU forward runs on the calling thread until it is done, so
  overlap needs a thread: it swaps placeholders (from a host future map) and runs
  `worker.forward_batch_generation` while the scheduler processes the previous result.
  (On a CPU the overlap loop is off by default: the forward's threads already use every
  core; see `ServerArgs.overlap_schedule`.)
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from managers.schedule_batch import GenerationBatchResult, ModelWorkerBatch
from srt.model_executor.step_inputs import FutureSlots, resolve_future_ids
from srt.utils.device_memory import device_memory

# Placeholders name a ring of slots; a batch's slots are reused only many batches later.
FUTURE_MAP_BATCHES = 8
# How long exit waits for the forward thread to finish a forward in flight.
THREAD_JOIN_TIMEOUT_S = 60.0


@dataclass(slots=True)
class Launch:
    """A batch handed to the forward thread."""

    mwb: ModelWorkerBatch
    first: int  # its first future slot


@dataclass(slots=True)
class LaunchedForward:
    result: GenerationBatchResult | None = None
    error: BaseException | None = None
    wait_s: float = 0.0  # the forward thread idled this long before starting this forward
    forward_s: float = 0.0


class OverlapWorker:
    def __init__(self, worker: Any, max_batch_size: int) -> None:
        self.worker = worker
        self.model_config = worker.model_config
        device = torch.device(getattr(worker, "device", "cpu"))
        self.size = FUTURE_MAP_BATCHES * (max_batch_size + 1) + 1
        self.next_slot = 1  # slot 0 is never named: -0 is not a placeholder
        self.threaded = not device_memory(device).separate
        self.future = torch.zeros(self.size, dtype=torch.int64, device=device)
        self.launched: deque[Any] = deque()  # no thread: launched, not yet waited for
        self.thread: threading.Thread | None = None
        if self.threaded:
            self._start_thread()

    def _start_thread(self) -> None:
        self.inputs: queue.Queue[Launch | None] = queue.Queue()
        self.outputs: queue.Queue[LaunchedForward] = queue.Queue()
        # The thread holds only a weak reference, so a dropped scheduler frees its model and
        # KV pool; the finalizer then ends the thread. The finalizer also runs at interpreter
        # exit, and waits for the thread there: a thread that has run torch ops and is still
        # alive when the interpreter finalizes aborts the process ("terminate called without
        # an active exception", exit status 134).
        self.thread = threading.Thread(
            target=_forward_loop,
            args=(weakref.ref(self), self.inputs, self.outputs),
            name="radixrt-forward",
            daemon=True,
        )
        self.thread.start()
        self._finalizer = weakref.finalize(self, _end_thread, self.inputs, self.thread)

    def get_memory_pool(self) -> Any:
        return self.worker.get_memory_pool()

    # ---- scheduler side ------------------------------------------------------------
    def launch(self, mwb: ModelWorkerBatch) -> list[int]:
        """Queue a forward; return its future token ids (one placeholder per request)."""
        n = len(mwb.seq_lens)
        if self.next_slot + n > self.size:
            self.next_slot = 1
        first = self.next_slot
        self.next_slot += n
        if self.threaded:
            self.inputs.put(Launch(mwb, first))
        else:
            try:
                self.launched.append(self.worker.launch(mwb, FutureSlots(self.future, first)))
            except BaseException as e:  # noqa: BLE001 - raised where its result is read
                self.launched.append(LaunchedForward(error=e))
        return list(range(-first, -first - n, -1))

    def wait_result(self) -> LaunchedForward:
        """The oldest launched forward's result (blocks until it is done)."""
        if self.threaded:
            done = self.outputs.get()
        else:
            launched = self.launched.popleft()
            done = launched if isinstance(launched, LaunchedForward) else self._resolve(launched)
        if done.error is not None:
            raise RuntimeError("the model worker failed") from done.error
        return done

    @staticmethod
    def _resolve(launched: Any) -> LaunchedForward:
        """Wait for a launched batch's ids on the host. The device's idle time is not seen
        from here: the time the host blocked counts as forward time."""
        tic = time.perf_counter()
        try:
            result = launched.resolve()
        except BaseException as e:  # noqa: BLE001 - re-raised by wait_result
            return LaunchedForward(error=e)
        return LaunchedForward(result=result, forward_s=time.perf_counter() - tic)

    def stop(self) -> None:
        if self.threaded:
            self.inputs.put(None)

    def close(self, timeout: float = THREAD_JOIN_TIMEOUT_S) -> None:
        """Stop the forward thread, if any, and wait for it to end."""
        if self.thread is not None and self.thread.is_alive():
            self.stop()
            self.thread.join(timeout=timeout)

    # ---- forward thread ------------------------------------------------------------
    def run_one(self, mwb: ModelWorkerBatch, first: int, done: LaunchedForward) -> None:
        try:
            self._resolve_placeholders(mwb)
            result = self.worker.forward_batch_generation(mwb)
            ids = torch.tensor(result.next_token_ids, dtype=torch.int64)
            self.future[first : first + len(ids)] = ids
            done.result = result
        except BaseException as e:  # noqa: BLE001 - handed to the scheduler thread
            done.error = e

    def _resolve_placeholders(self, mwb: ModelWorkerBatch) -> None:
        if min(mwb.input_ids, default=0) < 0:
            ids = torch.tensor(mwb.input_ids, dtype=torch.int64)
            resolve_future_ids(ids, self.future)
            mwb.input_ids = ids.tolist()


def _end_thread(inputs: queue.Queue[Launch | None], thread: threading.Thread) -> None:
    """Tell the forward thread to stop; wait for it (a forward in flight finishes first)."""
    inputs.put(None)
    if thread is not threading.current_thread():
        thread.join(timeout=THREAD_JOIN_TIMEOUT_S)


def _forward_loop(
    owner_ref: weakref.ref[OverlapWorker],
    inputs: queue.Queue[Launch | None],
    outputs: queue.Queue[LaunchedForward],
) -> None:
    last_end = time.perf_counter()
    while (item := inputs.get()) is not None:
        owner = owner_ref()
        if owner is None:
            return
        start = time.perf_counter()
        done = LaunchedForward(wait_s=start - last_end)
        owner.run_one(item.mwb, item.first, done)
        del owner  # no strong reference while waiting for the next batch
        last_end = time.perf_counter()
        done.forward_s = last_end - start
        outputs.put(done)
