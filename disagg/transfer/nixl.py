"""NIXL with the UCX backend: DRAM on CPU (VRAM on GPU). The decode side registers its pool
and ships its agent metadata in KVRegister; the prefill side adds that agent once and issues
one WRITE of the request's runs of slots, then waits for it to complete.

UCX listens on every interface address unless `UCX_NET_DEVICES` restricts it (e.g. `lo`).

The agent runs without NIXL's progress thread: its Python wrapper starts that thread with no
delay between polls, so it spins a core in every server, busy or idle, taking cores from
the model. UCX progresses instead where we call
into it: the writer while it waits for its write (`check_xfer_state`), the decode side once
per scheduler step (`progress`), which transports that need the target's help (TCP) rely on.
"""

from __future__ import annotations

import time
import uuid

from disagg.base import KVArgs, NixlPeer, TransferPeer, slot_runs
from disagg.transfer.base import TransferBackend, TransferError

TRANSFER_TIMEOUT_S = 60.0


class NixlTransfer(TransferBackend):
    def __init__(self, kv: KVArgs, host: str) -> None:
        super().__init__(kv, host)
        from nixl._api import nixl_agent, nixl_agent_config

        self.name = f"radixrt-{uuid.uuid4().hex[:12]}"
        config = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        self.agent = nixl_agent(self.name, config)
        self.mem_type = "VRAM" if kv.k_buffers[0].is_cuda else "DRAM"
        self.agent.register_memory(kv.buffers())
        self.peers: dict[str, str] = {}

    def peer_info(self) -> NixlPeer:
        return NixlPeer(
            agent=self.name,
            metadata=self.agent.get_agent_metadata(),
            ptrs=tuple(buf.data_ptr() for buf in self.kv.buffers()),
            device=self.kv.k_buffers[0].get_device() if self.mem_type == "VRAM" else 0,
        )

    def progress(self) -> None:
        self.agent.get_new_notifs()  # progresses the UCX worker (we send no notifications)

    def _peer_name(self, peer: NixlPeer) -> str:
        name = self.peers.get(peer.agent)
        if name is None:
            name = self.peers[peer.agent] = self.agent.add_remote_agent(peer.metadata)
        return name

    def write(self, peer: TransferPeer, src_slots: list[int], dst_slots: list[int]) -> None:
        dest = self.expect_peer(peer, NixlPeer)
        item = self.kv.item_bytes
        runs = slot_runs(src_slots, dst_slots)
        src, dst = [], []
        dev = max(self.kv.k_buffers[0].get_device(), 0)
        for buf, dst_base in zip(self.kv.buffers(), dest.ptrs, strict=True):
            base = buf.data_ptr()
            for s, d, n in runs:
                src.append((base + s * item, n * item, dev))
                dst.append((dst_base + d * item, n * item, dest.device))
        name = self._peer_name(dest)
        handle = self.agent.initialize_xfer(
            "WRITE",
            self.agent.get_xfer_descs(src, self.mem_type),
            self.agent.get_xfer_descs(dst, self.mem_type),
            name,
        )
        try:
            state = self.agent.transfer(handle)
            deadline = time.monotonic() + TRANSFER_TIMEOUT_S
            while state == "PROC" and time.monotonic() < deadline:
                time.sleep(0.0002)
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferError(f"nixl: write to {name} ended in state {state}")
        finally:
            self.agent.release_xfer_handle(handle)
