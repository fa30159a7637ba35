"""Decode steps as the server runs them: batch B in steady decode through the overlap loop.

`bench_one_batch` times a decode step end to end on its own (build, stage, forward, sample,
ids back on the host), so the host's part adds to the GPU's. Serving runs the overlap loop,
where the host builds and stages step N+1 while the GPU runs step N: here B requests of
`input_len` random ids are brought into steady decode by an in-process scheduler (overlap
loop), then `steps` scheduler steps are timed wall clock, the device synchronized at both
ends. The step time is then what the slower of host and device costs.
"""

from __future__ import annotations

import dataclasses
import random
import time
from typing import Any

import torch

READY_STEP_LIMIT = 400


def bench_decode_overlap(
    worker: Any, sargs: Any, batch: int, input_len: int, steps: int, held: list[Any]
) -> float:
    """Seconds per steady decode step of `batch` requests in the overlap loop."""
    from managers.inprocess import InProcessDriver

    args = dataclasses.replace(sargs, disable_overlap_schedule=False)
    driver = InProcessDriver(args, worker=worker)
    held.append(driver)
    rng = random.Random(batch)
    vocab = driver.scheduler.vocab_size
    params = {"max_new_tokens": steps + 64, "ignore_eos": True, "temperature": 0}
    for _ in range(batch):
        driver.submit([rng.randrange(vocab) for _ in range(input_len)], dict(params))
    queues = driver.scheduler.queues
    for _ in range(READY_STEP_LIMIT):
        driver.step()
        last = queues.last_batch
        if last is not None and last.forward_mode.is_decode() and len(last.reqs) == batch:
            break
    else:
        raise RuntimeError(f"{batch} requests never decoded together")
    for _ in range(4):
        driver.step()
    torch.cuda.synchronize()
    tic = time.perf_counter()
    for _ in range(steps):
        driver.step()
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - tic) / steps
    driver.run_until_idle()
    driver.scheduler.check_memory()
    driver.scheduler.forward_worker.close()
    assert driver.scheduler.flush_cache(), "flush refused: requests still held"
    return step_s
