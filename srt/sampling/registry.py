"""Samplers by name (`--sampling-backend`).

"seeded" (the default) is the per-request reproducible sampler (`srt/sampling/sampler.py`).
"flashinfer" uses FlashInfer's top-k / top-p kernels (`srt/model_executor/flashinfer_sampler.py`)
when the device is CUDA and flashinfer is installed; otherwise it warns and uses the seeded
sampler.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from srt.utils.registry import Registry, is_package_installed

if TYPE_CHECKING:  # the HTTP server reads the names here without importing torch
    from srt.sampling.sampler import Sampler

logger = logging.getLogger(__name__)


def _seeded_sampler(device: str) -> Sampler:
    from srt.sampling.sampler import Sampler

    return Sampler()


def _flashinfer_sampler(device: str) -> Sampler:
    if device.startswith("cuda") and is_package_installed("flashinfer"):
        from srt.model_executor.flashinfer_sampler import FlashInferSampler

        logger.info("Sampling with FlashInfer's top-k/top-p kernels (not seed-reproducible)")
        return FlashInferSampler()
    logger.warning("--sampling-backend flashinfer needs CUDA and flashinfer; using seeded")
    return _seeded_sampler(device)


SAMPLERS: Registry[Sampler] = Registry("sampling backend")
SAMPLERS.register("seeded", _seeded_sampler)
SAMPLERS.register("flashinfer", _flashinfer_sampler)


def make_sampler(backend: str, device: str) -> Sampler:
    """The seeded sampler, or FlashInfer's kernels when asked for and usable."""
    return SAMPLERS.create(backend, device)
