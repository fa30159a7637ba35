"""Transfer backends move exactly the requested slots, including from a fragmented pool
(many runs: more than one mooncake batch)."""

from __future__ import annotations

import pickle
import random
import threading
import time

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


def test_nixl_write_progressed_by_the_receivers_steps_and_no_cpu_while_idle() -> None:
    """NIXL runs without its progress thread (which spins a core per agent): a write lands
    while the receiving side calls `progress()` as its scheduler steps do, and two idle
    agents use (almost) no CPU."""
    pytest.importorskip("nixl._api", reason="nixl is not installed")
    src, dst = make_kv(), make_kv()
    sender = create_transfer_backend("nixl", src, "127.0.0.1")
    receiver = create_transfer_backend("nixl", dst, "127.0.0.1")
    stop = threading.Event()

    def steps() -> None:  # the decode scheduler's loop, reduced to its progress calls
        while not stop.is_set():
            receiver.progress()
            time.sleep(0.001)

    stepper = threading.Thread(target=steps)
    stepper.start()
    try:
        s, d = fragmented(3000, 8192, 5), fragmented(3000, 8192, 6)
        sender.write(receiver.peer_info(), s, d)
    finally:
        stop.set()
        stepper.join()
    check_copied(src, dst, s, d)
    cpu, wall = time.process_time(), time.monotonic()
    time.sleep(1.0)
    used = (time.process_time() - cpu) / (time.monotonic() - wall)
    assert used < 0.3, f"two idle nixl agents used {used:.2f} CPU-seconds per second"
