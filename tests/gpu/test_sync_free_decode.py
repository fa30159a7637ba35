"""On a GPU: 200 overlapped decode steps of the default model (bf16, flashinfer, CUDA graphs)
make no host sync except where the scheduler reads a batch's sampled ids
(`LaunchedBatch.resolve`). `torch.cuda.set_sync_debug_mode("error")` turns every synchronizing
CUDA call PyTorch makes (a blocking copy to the host, `.item()`, `.tolist()` of a device
tensor, a stream or device synchronize) into an error; it is lifted only inside `resolve`."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

from managers.inprocess import InProcessDriver
from managers.worker_results import LaunchedBatch
from srt.model_executor.forward_batch import ForwardMode
from srt.server_args import ServerArgs

pytestmark = pytest.mark.gpu

BATCH = 48
STEPS = 200


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_overlapped_decode_steps_sync_only_to_read_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    args = ServerArgs(
        dtype="bfloat16",
        device="cuda",
        skip_tokenizer_init=True,
        max_total_tokens=65536,
        disable_overlap_schedule=False,
    )
    d = InProcessDriver(args)
    try:
        assert d.scheduler.forward_worker.threaded is False
        d.generate([[1, 2, 3]], {"max_new_tokens": 4})  # warm-up: lazy inits may sync
        modes: list[ForwardMode] = []
        launch = d.worker.launch

        def recording_launch(mwb: Any, future: Any = None) -> Any:
            modes.append(mwb.forward_mode)
            return launch(mwb, future)

        resolve = LaunchedBatch.resolve
        reads = 0

        def designated_read(self: LaunchedBatch) -> Any:
            nonlocal reads
            reads += 1
            torch.cuda.set_sync_debug_mode(0)
            try:
                return resolve(self)
            finally:
                torch.cuda.set_sync_debug_mode("error")

        params = {"max_new_tokens": STEPS + 50, "temperature": 0, "ignore_eos": True}
        for i in range(BATCH):
            d.submit([(7 * i + j) % 1000 + 5 for j in range(64 + i)], dict(params))
        d.worker.launch = recording_launch
        while sum(m.is_decode() for m in modes) < 2:  # every prompt prefilled, decoding
            d.step()
        monkeypatch.setattr(LaunchedBatch, "resolve", designated_read)
        modes.clear()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(STEPS):
                d.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert len(modes) == STEPS and all(m.is_decode() for m in modes), set(modes)
        assert reads == STEPS  # one read per step: the previous batch's ids
        monkeypatch.undo()
        d.worker.launch = launch
        d.run_until_idle()
        d.scheduler.check_memory()
    finally:
        d.scheduler.forward_worker.close()
        del d
        gc.collect()
        torch.cuda.empty_cache()
