"""Transfer backends move exactly the requested slots, including from a fragmented pool
(many runs: more than one mooncake batch)."""

from __future__ import annotations

import pickle
import random

import pytest
import torch

from disagg.base import KVArgs, KVRegister, LoopbackPeer, MooncakePeer
from disagg.transfer import create_transfer_backend
from disagg.transfer.base import TransferError


def make_kv(slots: int = 8192, layers: int = 3) -> KVArgs:
    k = [torch.randn(slots, 2, 8) for _ in range(layers)]
    v = [torch.randn(slots, 2, 8) for _ in range(layers)]
    return KVArgs(k, v, 2 * 8 * 4)


def fragmented(n: int, total: int, seed: int) -> list[int]:
    return random.Random(seed).sample(range(1, total), n)  # no two slots adjacent, mostly


def check_copied(src: KVArgs, dst: KVArgs, s: list[int], d: list[int]) -> None:
    for a, b in zip(src.buffers(), dst.buffers(), strict=True):
        assert torch.equal(a[torch.tensor(s)], b[torch.tensor(d)])


def test_loopback_payload_roundtrip() -> None:
    src, dst = make_kv(), make_kv()
    s, d = fragmented(3000, 8192, 1), fragmented(3000, 8192, 2)
    sender = create_transfer_backend("loopback", src, "127.0.0.1")
    receiver = create_transfer_backend("loopback", dst, "127.0.0.1")
    receiver.receive_payload(d, sender.payload(s))
    check_copied(src, dst, s, d)


def test_mooncake_fragmented_write() -> None:
    pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine-non-cuda")
    src, dst = make_kv(), make_kv()
    sender = create_transfer_backend("mooncake", src, "127.0.0.1")
    receiver = create_transfer_backend("mooncake", dst, "127.0.0.1")
    s, d = fragmented(3000, 8192, 3), fragmented(3000, 8192, 4)  # ~18k runs in all
    sender.write(receiver.peer_info(), s, d)
    check_copied(src, dst, s, d)


def test_peer_records_pickle_and_a_backend_refuses_another_backends_peer() -> None:
    peer = MooncakePeer("127.0.0.1:1234", (1, 2, 3))
    reg = KVRegister(7, [1, 2], (3, 128), peer)
    assert pickle.loads(pickle.dumps(reg)) == reg  # crosses the bootstrap channel
    loopback = create_transfer_backend("loopback", make_kv(16), "127.0.0.1")
    assert pickle.loads(pickle.dumps(loopback.peer_info())) == LoopbackPeer()
    with pytest.raises(TransferError, match="same --disaggregation-transfer-backend"):
        loopback.write(peer, [1], [2])
