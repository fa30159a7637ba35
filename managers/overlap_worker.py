"""`OverlapWorker`: runs the model worker's forwards on a thread of their own, so the
scheduler builds batch N+1 and post-processes batch N while forward N+1 runs.

Future token ids: `launch` returns at once with one negative placeholder per request,
`-(slot)`, naming a slot of `future_map` that the thread fills with the sampled token when
the forward is done (with tensor parallelism, rank 0's token: the worker broadcasts the ids
on this thread, over the model group, before it returns them). The next batch may carry placeholders as input ids; the thread swaps
them for the real tokens just before that forward (it runs forwards in order, so the slot is
always filled by then). Results come back in launch order through a queue; a result is put
there only once its token lists are on the host, which is the copy-done point (on a GPU the
`.tolist()` in the worker waits for the forward's stream).

Streams (CUDA only): the scheduler thread builds each batch on its own current stream (the
default one): it writes `req_to_token` and copies the new KV slots (`out_cache_loc`) to the
device with `non_blocking=True`. The forward thread runs on a stream of its own, so nothing
orders its kernels after those writes. `launch` therefore records a CUDA event on the
scheduler's stream once the batch is built, and the forward thread makes its stream wait on
that event before it starts the forward (a device-side wait: neither thread blocks). The
other direction needs no event: every result the scheduler reads is a host list, made by
`.tolist()` on the forward stream, which blocks the forward thread until the forward's
kernels are done, and the thread drops the batch's tensors only after that, so no block the
scheduler's stream frees is still read by the forward stream.

The thread also measures how long it sat waiting for the scheduler between two forwards.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from managers.schedule_batch import GenerationBatchResult, ModelWorkerBatch

# Placeholders name a ring of slots; a batch's slots are reused only many batches later.
FUTURE_MAP_BATCHES = 8
# How long exit waits for the forward thread to finish a forward in flight.
THREAD_JOIN_TIMEOUT_S = 60.0


@dataclass(slots=True)
class Launch:
    """A batch handed to the forward thread."""

    mwb: ModelWorkerBatch
    first: int  # its first future_map slot
    built: Any = None  # CUDA: the torch.cuda.Event the forward stream waits on; CPU: None


@dataclass(slots=True)
class LaunchedForward:
    result: GenerationBatchResult | None = None
    error: BaseException | None = None
    wait_s: float = 0.0  # the thread idled this long before starting this forward
    forward_s: float = 0.0


class OverlapWorker:
    def __init__(self, worker: Any, max_batch_size: int) -> None:
        self.worker = worker
        self.model_config = worker.model_config
        self.size = FUTURE_MAP_BATCHES * (max_batch_size + 1) + 1
        self.future_map = torch.zeros(self.size, dtype=torch.int64)
        self.next_slot = 1  # slot 0 is never named: -0 is not a placeholder
        self.inputs: queue.Queue[Launch | None] = queue.Queue()
        self.outputs: queue.Queue[LaunchedForward] = queue.Queue()
        device = torch.device(getattr(worker, "device", "cpu"))
        if device.type == "cuda" and device.index is None:
            # The current device is per thread and a new thread starts on cuda:0; a
            # tensor-parallel rank's is its own GPU, so name it for the forward thread.
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        # The thread holds only a weak reference, so a dropped scheduler frees its model and
        # KV pool; the finalizer then ends the thread. The finalizer also runs at interpreter
        # exit, and waits for the thread there: a thread that has run torch ops and is still
        # alive when the interpreter finalizes aborts the process ("terminate called without
        # an active exception", exit status 134).
        self.thread = threading.Thread(
            target=_forward_loop,
            args=(weakref.ref(self), self.inputs, self.outputs, device),
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
        n = len(mwb.seq_lens_cpu)
        if self.next_slot + n > self.size:
            self.next_slot = 1
        first = self.next_slot
        self.next_slot += n
        self.inputs.put(Launch(mwb, first, self._record_built()))
        return list(range(-first, -first - n, -1))

    def _record_built(self) -> Any:
        """On CUDA, an event on the scheduler's current stream marking that the batch's
        device writes (req_to_token rows, the non-blocking out_cache_loc copy) are queued;
        the forward stream waits on it (module doc). None on CPU, where every write is done
        when it returns."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def wait_result(self) -> LaunchedForward:
        """The oldest launched forward's result (blocks until it is done)."""
        done = self.outputs.get()
        if done.error is not None:
            raise RuntimeError("the model worker failed") from done.error
        return done

    def stop(self) -> None:
        self.inputs.put(None)

    # ---- forward thread ------------------------------------------------------------
    def run_one(self, mwb: ModelWorkerBatch, first: int, done: LaunchedForward) -> None:
        try:
            self._resolve_placeholders(mwb)
            result = self.worker.forward_batch_generation(mwb)
            ids = torch.tensor(result.next_token_ids, dtype=torch.int64)
            self.future_map[first : first + len(ids)] = ids
            done.result = result
        except BaseException as e:  # noqa: BLE001 - handed to the scheduler thread
            done.error = e

    def _resolve_placeholders(self, mwb: ModelWorkerBatch) -> None:
        ids = mwb.input_ids
        future = ids < 0
        if bool(future.any()):
            ids[future] = self.future_map[-ids[future]]


def _end_thread(inputs: queue.Queue[Launch | None], thread: threading.Thread) -> None:
    """Tell the forward thread to stop; wait for it (a forward in flight finishes first)."""
    inputs.put(None)
    if thread is not threading.current_thread():
        thread.join(timeout=THREAD_JOIN_TIMEOUT_S)


def _forward_loop(
    owner_ref: weakref.ref[OverlapWorker],
    inputs: queue.Queue[Launch | None],
    outputs: queue.Queue[LaunchedForward],
    device: torch.device,
) -> None:
    stream = None
    if device.type == "cuda":
        # Forwards go on a stream of their own, off the scheduler's default stream (the
        # current stream is per thread, so this changes only this thread's), on the
        # scheduler thread's device (the current device is per thread too).
        torch.cuda.set_device(device)
        stream = torch.cuda.Stream(device)
        torch.cuda.set_stream(stream)
    last_end = time.perf_counter()
    while (item := inputs.get()) is not None:
        owner = owner_ref()
        if owner is None:
            return
        start = time.perf_counter()
        done = LaunchedForward(wait_s=start - last_end)
        if stream is not None and item.built is not None:
            # Before any kernel of this forward: order it after the scheduler's writes.
            stream.wait_event(item.built)
        owner.run_one(item.mwb, item.first, done)
        del owner  # no strong reference while waiting for the next batch
        last_end = time.perf_counter()
        done.forward_s = last_end - start
        outputs.put(done)
