"""Parallel sampling (`n > 1`): one prompt becomes a prefill-only request plus n samples.

`RidTable` keeps every rid a running request uses (its own and the ones derived here) apart
from every other request's: the scheduler and the receive loop know requests only by rid, so
two requests sharing one would receive each other's outputs and aborts.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from managers.errors import RequestError
from managers.io_struct import TokenizedGenerateReqInput
from srt.sampling.sampling_params import SamplingParams


def prefill_rid(rid: str) -> str:
    return f"{rid}-prefill"


def sample_rid(rid: str, j: int) -> str:
    return f"{rid}-{j}"


def scheduler_rids(rid: str, n: int) -> list[str]:
    """The rids of the requests `make_requests(rid, ...)` sends to the scheduler."""
    if n == 1:
        return [rid]
    return [prefill_rid(rid), *(sample_rid(rid, j) for j in range(n))]


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


class RidTable:
    """The rids of the running requests: each request's own rid and its scheduler rids.

    A new request is refused (400) when any of its names is taken, whichever arrived first:
    rid "X" with n = 2 holds "X", "X-prefill", "X-0" and "X-1", so a client rid
    "X-prefill" is refused while X runs, and X is refused while "X-prefill" runs.
    """

    def __init__(self) -> None:
        self.owner: dict[str, str] = {}  # every name in use -> the request's own rid
        self.requests: dict[str, list[str]] = {}  # a request's rid -> its scheduler rids

    def __len__(self) -> int:
        return len(self.requests)

    def reserve(self, rid: str, n: int) -> list[str]:
        """Take every name of request `rid` with `n` samples; return its scheduler rids."""
        rids = scheduler_rids(rid, n)
        names = dict.fromkeys([rid, *rids])
        for name in names:
            if name in self.owner:
                raise RequestError(
                    f"Request id {rid!r} is in use: it or an id derived from it ({name!r}) "
                    "belongs to a running request.",
                    param="rid",
                )
        for name in names:
            self.owner[name] = rid
        self.requests[rid] = rids
        return rids

    def release(self, rid: str) -> None:
        for name in [rid, *self.requests.pop(rid, [])]:
            if self.owner.get(name) == rid:
                del self.owner[name]

    def rids_to_abort(self, rid: str) -> list[str]:
        """The scheduler rids an abort of `rid` reaches: all of a request's, given its own
        rid; else `rid` alone (one sample, or a request this table does not hold)."""
        return self.requests.get(rid, [rid])
