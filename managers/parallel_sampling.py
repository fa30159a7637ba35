"""Parallel sampling (`n > 1`): one prompt becomes a prefill-only request plus n samples."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from managers.io_struct import TokenizedGenerateReqInput
from srt.sampling.sampling_params import SamplingParams


def prefill_rid(rid: str) -> str:
    return f"{rid}-prefill"


def sample_rid(rid: str, j: int) -> str:
    return f"{rid}-{j}"


def make_requests(
    rid: str,
    input_ids: list[int],
    params: SamplingParams,
    **fields: Any,
) -> list[TokenizedGenerateReqInput]:
    """One request, or for n > 1 a prefill-only request followed by n samples.

    The prefill-only request (max_new_tokens=0) puts the prompt in the radix tree once; the n
    samples, admitted after it, share it through the tree. Sample j gets seed `seed + j` when
    the user gave a seed, so the n outputs differ but are reproducible.
    """
    if params.n == 1:
        return [TokenizedGenerateReqInput(rid, input_ids, params, **fields)]
    warm = replace(params, n=1, max_new_tokens=0, min_new_tokens=0)
    reqs = [TokenizedGenerateReqInput(prefill_rid(rid), input_ids, warm, **fields)]
    for j in range(params.n):
        seed = None if params.seed is None else params.seed + j
        sample = replace(params, n=1, seed=seed)
        reqs.append(TokenizedGenerateReqInput(sample_rid(rid, j), input_ids, sample, **fields))
    return reqs
