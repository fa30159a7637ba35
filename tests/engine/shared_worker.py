"""Several schedulers on one model worker, one after another: a driver built on a shared
worker is released (its forward thread stopped, its cached pages returned to the worker's KV
pool) before the next scheduler takes the pool over."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from managers.inprocess import InProcessDriver
from srt.server_args import ServerArgs


def release(driver: InProcessDriver) -> None:
    """Stop the driver's forward thread (overlap loop) and empty its radix cache."""
    forward_worker = getattr(driver.scheduler, "forward_worker", None)
    if forward_worker is not None:
        forward_worker.close()
    assert driver.scheduler.flush_cache(), "flush refused: requests still held"


@contextmanager
def driver_on(worker: Any, tokenizer: Any = None, **args: Any) -> Iterator[InProcessDriver]:
    """A float32 driver of the default model on `worker` (see `default_worker` in
    tests/conftest.py), released on exit."""
    driver = InProcessDriver(
        ServerArgs(dtype="float32", quantization="none", **args), worker=worker, tokenizer=tokenizer
    )
    try:
        yield driver
    finally:
        release(driver)
