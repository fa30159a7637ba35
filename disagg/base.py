"""Shared pieces of prefill/decode disaggregation: the poll states, the KV description each
side publishes (pool layout, transfer peer records), and the messages of the bootstrap
channel.

Protocol (one request, "room" = the router's `bootstrap_room`):

    decode server                                   prefill server (bootstrap port)
    request arrives with bootstrap_host/port/room   the same request arrives
    pre-allocate a row + prompt_len KV slots         waits in the bootstrap queue
    ── KVRegister(room, dst slots, where to write) ──▶ (Bootstrapping -> WaitingForInput)
                                                    prefill forward (own radix cache)
                                                    write KV into the decode slots
                                                    (Transferring)
    ◀── KVTransferDone(room, ok, first token) ───── finish its own request, free its KV
    Success: the request joins the running batch    Success
    with its first token; decode continues

A request that fails on the prefill side (timeout, transfer error) finishes with an abort
there and answers `KVTransferDone(ok=False)`: the prefill side will not write, so decode frees
its slots at once.

A request aborted or timed out on the decode side must not free slots the prefill side may
still write (a late write would land in another request's KV):

    decode server                                   prefill server
    abort / timeout: slots quarantined              (room registered, prefilling or writing)
    ── KVCancel(room) ───────────────────────────────▶ drop the room: never start its write, or
                                                    let a running write finish; abort the
                                                    request here (its KV cached here as usual)
    ◀── KVCancelAck(room) ─────────────────────────── (or a KVTransferDone that crossed the cancel)
    quarantine released: the slots are free again

Decode releases a quarantine without an acknowledgement only after
`--disaggregation-quarantine-timeout` (a dead peer must not hold the pool forever), with a
warning.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch


class KVPoll(enum.IntEnum):
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


@dataclass
class KVArgs:
    """The KV pool of one server, as a transfer backend sees it: per layer a K and a V
    buffer, `item_bytes` per slot (one token of one layer)."""

    k_buffers: list[torch.Tensor]
    v_buffers: list[torch.Tensor]
    item_bytes: int

    @classmethod
    def from_pool(cls, pool: Any) -> KVArgs:
        k0 = pool.k_buffer[0]
        return cls(list(pool.k_buffer), list(pool.v_buffer), k0[0].numel() * k0.element_size())

    def buffers(self) -> list[torch.Tensor]:
        return self.k_buffers + self.v_buffers

    def layout(self) -> tuple[int, int]:
        return len(self.k_buffers), self.item_bytes


@dataclass(frozen=True, slots=True)
class TransferPeer:
    """A decode server's pool as its transfer backend addresses it (`peer_info()`), sent in
    `KVRegister`. One subclass per backend; a backend writes only to its own kind."""


@dataclass(frozen=True, slots=True)
class LoopbackPeer(TransferPeer):
    """Nothing to address: the KV travels back in `KVTransferDone.payload`."""


@dataclass(frozen=True, slots=True)
class MooncakePeer(TransferPeer):
    session_id: str  # "host:rpc_port" of the decode side's transfer engine
    ptrs: tuple[int, ...]  # base address per buffer (K layers, then V layers)


@dataclass(frozen=True, slots=True)
class NixlPeer(TransferPeer):
    agent: str  # the decode side's agent name
    metadata: bytes  # its agent metadata, added once as a remote agent
    ptrs: tuple[int, ...]  # base address per buffer (K layers, then V layers)
    device: int  # GPU index of the buffers (0 for DRAM)


@dataclass
class KVRegister:
    """Decode -> prefill: where to write one room's KV."""

    room: int
    dst_slots: list[int]
    layout: tuple[int, int]  # (num_layers, item_bytes): must match the prefill side's
    peer: TransferPeer  # the decode side's transfer backend address


@dataclass
class KVTransferDone:
    """Prefill -> decode: the room's KV is written (or failed)."""

    room: int
    ok: bool
    first_token: int = -1
    cached_tokens: int = 0
    error: str = ""
    # loopback backend only: the KV itself, per buffer (K layers, then V layers)
    payload: list[bytes] | None = None


@dataclass
class KVCancel:
    """Decode -> prefill: the room's request was aborted or timed out on the decode side; do
    not write its slots (answer `KVCancelAck` once no write can land any more)."""

    room: int
    reason: str = ""


@dataclass
class KVCancelAck:
    """Prefill -> decode: nothing will be written into the room's slots any more."""

    room: int


def slot_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """Merge (src, dst) slot pairs into runs contiguous on both sides: (src0, dst0, length)."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            s0, d0, n = runs[-1]
            runs[-1] = (s0, d0, n + 1)
        else:
            runs.append((s, d, 1))
    return runs
