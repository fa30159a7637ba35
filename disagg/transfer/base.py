"""A transfer backend moves KV slots from this (prefill) server's pool into a peer's
(decode) pool. The pool memory is registered once at startup; a transfer moves only the
slots of one request. Each backend describes its pool to peers with its own `TransferPeer`
record (`disagg/base.py`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TypeVar

from disagg.base import KVArgs, TransferPeer

P = TypeVar("P", bound=TransferPeer)


class TransferError(RuntimeError):
    pass


class TransferBackend(ABC):
    def __init__(self, kv: KVArgs, host: str) -> None:
        self.kv = kv
        self.host = host

    @abstractmethod
    def peer_info(self) -> TransferPeer:
        """What a prefill server needs to write into this server's pool (sent in KVRegister)."""

    @abstractmethod
    def write(self, peer: TransferPeer, src_slots: list[int], dst_slots: list[int]) -> None:
        """Copy every layer's K and V at `src_slots` here to `dst_slots` at `peer`; raise
        `TransferError` on failure."""

    def progress(self) -> None:
        """Let the transfer library move inbound writes on. The decode side calls it once per
        scheduler step (about once a second when idle); a no-op for libraries that progress on
        their own threads."""

    def payload(self, src_slots: list[int]) -> list[bytes] | None:
        """Backends that ship KV inside the done message (loopback) return it here."""
        return None

    def receive_payload(self, dst_slots: list[int], payload: list[bytes]) -> None:
        raise TransferError(f"{type(self).__name__} does not take KV payloads")

    def expect_peer(self, peer: TransferPeer, kind: type[P]) -> P:
        """`peer` as this backend's record; a peer of another backend (the two servers were
        started with different transfer backends) is a `TransferError`."""
        if not isinstance(peer, kind):
            raise TransferError(
                f"{type(self).__name__} cannot write to a {type(peer).__name__}: both servers "
                "must use the same --disaggregation-transfer-backend"
            )
        return peer
