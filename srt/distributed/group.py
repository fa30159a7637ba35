"""Tensor-parallel process groups on torch.distributed (gloo on CPU, NCCL on GPU).

A `TPGroup` is passed explicitly to whatever needs it (layers, the model runner, the
scheduler loop); nothing reaches it through module state. It holds two process groups, each
used by one thread only, because collectives on one group issued from two threads could run
in a different order on different ranks:

- `model`: the forward thread (in the overlap loop, the `OverlapWorker` thread). All-reduce,
  all-gather of the logits, the broadcast of the sampled ids. gloo or NCCL.
- `control`: the scheduler thread. The per-step broadcast of rank 0's `StepInput`, start-up
  agreement (`agree_min`), gathering every rank's state. Always gloo: it carries pickles.

Every collective that fails (a peer died, or did not answer within `op_timeout_s`) raises
`TPPeerLost`; a group that does not form within `init_timeout_s` raises `TPInitError`.
`TPGroup.single()` is the size-1 group: every op returns its input and torch.distributed is
never touched, so tp=1 runs exactly the code it ran before tensor parallelism existed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch

from srt import environ
from srt.distributed.spec import TPSpec

logger = logging.getLogger(__name__)

T = TypeVar("T")
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


class TPPeerLost(RuntimeError):
    """A collective failed: a peer rank died, hung past the op timeout, or is unreachable."""


class TPInitError(RuntimeError):
    """The tensor-parallel group did not form in time."""


class TPGroup:
    """This rank's view of its tensor-parallel group (see the module docstring)."""

    def __init__(self, rank: int, size: int, model: Any = None, control: Any = None) -> None:
        self.rank = rank
        self.size = size
        self._model = model
        self._control = control

    @classmethod
    def single(cls) -> TPGroup:
        return cls(0, 1)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def __repr__(self) -> str:
        return f"TPGroup(rank={self.rank}, size={self.size})"

    def _guard(self, op: str, fn: Callable[[], T]) -> T:
        import torch.distributed as dist

        try:
            return fn()
        except (RuntimeError, dist.DistError) as e:
            raise TPPeerLost(f"TP rank {self.rank}: {op} failed: {e}") from e

    # --- model group: the forward thread only -------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks in place and return it. gloo reduces half types in float32
        (identical bits on every rank either way: gloo hands all ranks one result)."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        if x.device.type == "cpu" and x.dtype != torch.float32:
            wide = x.float()
            self._guard("all_reduce", lambda: dist.all_reduce(wide, group=self._model))
            return x.copy_(wide)
        self._guard("all_reduce", lambda: dist.all_reduce(x, group=self._model))
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` (equal shapes) along the last dim, in rank order."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._guard("all_gather", lambda: dist.all_gather(parts, x, group=self._model))
        return torch.cat(parts, dim=-1)

    def broadcast_tensor(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite `x` with rank `src`'s `x` (in place) and return it."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        self._guard("broadcast", lambda: dist.broadcast(x, src, group=self._model))
        return x

    # --- control group (gloo): the scheduler thread only --------------------------------

    def broadcast_object(self, obj: T | None) -> T:
        """The leader passes `obj`, the others None; every rank returns the leader's object."""
        if self.size == 1:
            return obj  # type: ignore[return-value]
        import torch.distributed as dist

        box = [obj if self.is_leader else None]
        self._guard(
            "broadcast_object", lambda: dist.broadcast_object_list(box, 0, group=self._control)
        )
        return box[0]  # type: ignore[return-value]

    def gather_objects(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj` in rank order on the leader; None on the other ranks."""
        if self.size == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] | None = [None] * self.size if self.is_leader else None
        self._guard(
            "gather_object", lambda: dist.gather_object(obj, out, dst=0, group=self._control)
        )
        return out

    def agree_min(self, value: int) -> int:
        """The smallest `value` over the ranks (e.g. the KV pool size every rank can hold)."""
        if self.size == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64)
        self._guard(
            "agree_min",
            lambda: dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._control),
        )
        return int(t.item())

    def destroy(self) -> None:
        if self.size == 1:
            return
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def init_tp_group(spec: TPSpec) -> TPGroup:
    """Join the group described by `spec` (blocks until every rank joined, at most
    `spec.init_timeout_s`). A size-1 spec returns `TPGroup.single()`.

    On CPU, ranks sharing a machine split its cores: each rank takes
    `usable cores // local_size` torch threads, unless OMP_NUM_THREADS says otherwise."""
    if spec.size == 1:
        return TPGroup.single()
    import torch.distributed as dist

    host = spec.init_addr.rsplit(":", 1)[0].removeprefix("tcp://").strip("[]")
    if host in LOOPBACK_HOSTS:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if spec.backend == "nccl":
        torch.cuda.set_device(spec.local_rank)
    elif spec.local_size > 1 and not environ.OMP_NUM_THREADS.is_set():
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // spec.local_size))
    try:
        dist.init_process_group(
            "gloo",
            init_method=spec.init_method,
            rank=spec.rank,
            world_size=spec.size,
            timeout=timedelta(seconds=spec.init_timeout_s),
        )
    except (RuntimeError, dist.DistError) as e:
        raise TPInitError(
            f"tensor-parallel group did not form within {spec.init_timeout_s:g} s at "
            f"{spec.init_addr} (this is rank {spec.rank} of {spec.size}); start every "
            f"--node-rank with the same --dist-init-addr and --tp-size: {e}"
        ) from e
    op_timeout = timedelta(seconds=spec.op_timeout_s)
    model = dist.new_group(backend=spec.backend, timeout=op_timeout)
    control = dist.new_group(backend="gloo", timeout=op_timeout)
    logger.info(
        "TP rank %d of %d joined at %s (model group %s)",
        spec.rank,
        spec.size,
        spec.init_addr,
        spec.backend,
    )
    return TPGroup(spec.rank, spec.size, model, control)
