"""What a tensor-parallel rank needs to join its group (`TPSpec`) and the specs of one node's
ranks. No torch here: the main process builds the specs and hands them to the ranks it spawns,
which form the groups (`group.py`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TPSpec:
    """What a rank process needs in order to join its group (picklable)."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    init_addr: str  # "host:port" of the TCP store rank 0 hosts, or a "file://" / "tcp://" URL
    backend: str = "gloo"  # of the model group: "gloo" (cpu) or "nccl" (cuda)
    init_timeout_s: float = 60.0  # --dist-timeout
    op_timeout_s: float = 300.0  # --watchdog-timeout: no collective outwaits a step

    @property
    def init_method(self) -> str:
        return self.init_addr if "://" in self.init_addr else f"tcp://{self.init_addr}"


def node_specs(
    tp_size: int,
    nnodes: int,
    node_rank: int,
    init_addr: str,
    device: str,
    init_timeout_s: float,
    op_timeout_s: float,
) -> list[TPSpec]:
    """The specs of the ranks this node runs: global ranks node_rank * local .. + local - 1."""
    local = tp_size // nnodes
    backend = "nccl" if device == "cuda" else "gloo"
    return [
        TPSpec(
            node_rank * local + i,
            tp_size,
            i,
            local,
            init_addr,
            backend,
            init_timeout_s,
            op_timeout_s,
        )
        for i in range(local)
    ]
