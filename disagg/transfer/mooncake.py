"""Mooncake's transfer engine over TCP with P2PHANDSHAKE metadata (no etcd). Each layer's K
and V buffer is registered once; a transfer is one batched write per request of runs of
slots that are contiguous on both sides.

Security: Mooncake's TCP data listener and its handshake RPC port bind every interface
(measured: `0.0.0.0` and `[::]`, whatever host is given); only the advertised address is
`--host`. Run disaggregated servers on a trusted network, or firewall those ports.
"""

from __future__ import annotations

from disagg.base import KVArgs, MooncakePeer, TransferPeer, slot_runs
from disagg.transfer.base import TransferBackend, TransferError

MAX_BATCH_ENTRIES = 1024


class MooncakeTransfer(TransferBackend):
    def __init__(self, kv: KVArgs, host: str) -> None:
        super().__init__(kv, host)
        from mooncake.engine import TransferEngine

        self.engine = TransferEngine()
        if self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
            raise TransferError(f"mooncake: cannot initialize a TCP engine on {host}")
        for buf in kv.buffers():
            if self.engine.register_memory(buf.data_ptr(), buf.nbytes) != 0:
                raise TransferError("mooncake: cannot register the KV pool memory")
        self.session_id = f"{host}:{self.engine.get_rpc_port()}"

    def peer_info(self) -> MooncakePeer:
        return MooncakePeer(self.session_id, tuple(buf.data_ptr() for buf in self.kv.buffers()))

    def write(self, peer: TransferPeer, src_slots: list[int], dst_slots: list[int]) -> None:
        dest = self.expect_peer(peer, MooncakePeer)
        item = self.kv.item_bytes
        runs = slot_runs(src_slots, dst_slots)
        srcs, dsts, lens = [], [], []
        for buf, dst_base in zip(self.kv.buffers(), dest.ptrs, strict=True):
            base = buf.data_ptr()
            for s, d, n in runs:
                srcs.append(base + s * item)
                dsts.append(dst_base + d * item)
                lens.append(n * item)
        # The engine caps the entries of one batch; a fragmented pool makes many runs.
        for i in range(0, len(srcs), MAX_BATCH_ENTRIES):
            part = slice(i, i + MAX_BATCH_ENTRIES)
            rc = self.engine.batch_transfer_sync_write(
                dest.session_id, srcs[part], dsts[part], lens[part]
            )
            if rc != 0:
                raise TransferError(f"mooncake: batch write to {dest.session_id} failed ({rc})")
