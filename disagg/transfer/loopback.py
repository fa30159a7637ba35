"""Loopback: the KV travels inside the bootstrap channel's done message (a copy through
ZMQ). No extra package; for tests and single-host runs."""

from __future__ import annotations

import torch

from disagg.base import LoopbackPeer, TransferPeer
from disagg.transfer.base import TransferBackend


class LoopbackTransfer(TransferBackend):
    def peer_info(self) -> LoopbackPeer:
        return LoopbackPeer()

    def write(self, peer: TransferPeer, src_slots: list[int], dst_slots: list[int]) -> None:
        """Nothing to do here: `payload` carries the KV."""
        self.expect_peer(peer, LoopbackPeer)

    def payload(self, src_slots: list[int]) -> list[bytes]:
        idx = torch.tensor(src_slots, dtype=torch.int64)
        return [
            buf[idx].contiguous().view(torch.uint8).numpy().tobytes() for buf in self.kv.buffers()
        ]

    def receive_payload(self, dst_slots: list[int], payload: list[bytes]) -> None:
        idx = torch.tensor(dst_slots, dtype=torch.int64)
        for buf, data in zip(self.kv.buffers(), payload, strict=True):
            raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            buf[idx] = raw.view(buf.dtype).view(len(dst_slots), *buf.shape[1:])
