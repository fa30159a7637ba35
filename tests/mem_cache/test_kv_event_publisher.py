"""The ZMQ KV-event publisher: sequence numbers, replay, a busy port, and one batch per
scheduler step."""

from __future__ import annotations

import json
import time
import uuid

import pytest
import zmq

from mem_cache.kv_event_publisher import END_SEQ, ZmqEventPublisher
from mem_cache.kv_events import AllBlocksCleared, KVEventBatch, KVEventsConfig
from tests.mem_cache.kv_event_helpers import LiveSet, tree_hashes
from tests.server.server_process import free_port


def recv_batch(sock: zmq.Socket, timeout_ms: int = 5000) -> tuple[bytes, int, KVEventBatch]:
    assert sock.poll(timeout_ms), "no KV-event batch arrived"
    topic, seq, payload = sock.recv_multipart()
    return topic, int.from_bytes(seq, "big"), KVEventBatch.decode(payload)


def replay(ctx: zmq.Context, endpoint: str, start: int) -> list[tuple[int, KVEventBatch]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        while True:
            assert dealer.poll(5000), "replay did not answer"
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert payload == b""
                return out
            out.append((int.from_bytes(seq, "big"), KVEventBatch.decode(payload)))
    finally:
        dealer.close(linger=0)


def test_publisher_sequence_numbers_and_replay() -> None:
    port, replay_port = free_port(), free_port()
    config = KVEventsConfig(
        endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay_port}", topic="kv"
    )
    pub = ZmqEventPublisher(config)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"tcp://127.0.0.1:{port}")
    try:
        # PUB drops what it sends before the subscription arrives: publish until one lands.
        sent = []
        deadline = time.monotonic() + 10
        while not sub.poll(50):
            assert time.monotonic() < deadline, "subscriber never connected"
            sent.append(pub.publish([], ts=float(len(sent))))
        topic, first, _ = recv_batch(sub)
        assert topic == b"kv"
        for _ in range(5):
            sent.append(pub.publish([], ts=float(len(sent))))
        seqs = [first] + [recv_batch(sub)[1] for _ in range(len(sent) - 1 - first)]
        assert seqs == list(range(first, len(sent))) and sent == list(range(len(sent)))

        got = replay(ctx, f"tcp://127.0.0.1:{replay_port}", 0)
        assert [s for s, _ in got] == list(range(len(sent)))
        assert [b.ts for _, b in got] == [float(s) for s in range(len(sent))]
        k = len(sent) - 3
        assert [s for s, _ in replay(ctx, f"tcp://127.0.0.1:{replay_port}", k)] == [k, k + 1, k + 2]
        assert replay(ctx, f"tcp://127.0.0.1:{replay_port}", len(sent) + 10) == []
    finally:
        sub.close(linger=0)
        pub.close()


def test_busy_port_is_a_startup_error() -> None:
    port = free_port()
    first = ZmqEventPublisher(KVEventsConfig(endpoint=f"tcp://*:{port}"))
    try:
        with pytest.raises(RuntimeError, match="cannot open its endpoints"):
            ZmqEventPublisher(KVEventsConfig(endpoint=f"tcp://*:{port}"))
    finally:
        first.close()


@pytest.mark.parametrize("overlap", [True, False])
def test_scheduler_publishes_one_batch_per_step(overlap: bool) -> None:
    from managers.inprocess import InProcessDriver
    from srt.sampling.sampling_params import SamplingParams
    from srt.server_args import ServerArgs
    from tests.managers.scripted_worker import ScriptedWorker

    endpoint = f"inproc://kv-events-{uuid.uuid4().hex}"  # bound by the publisher
    args = ServerArgs(
        page_size=4,
        disable_overlap_schedule=not overlap,
        kv_events_config=json.dumps({"endpoint": endpoint}),
    )
    driver = InProcessDriver(args, worker=ScriptedWorker(512, 8, 4), tokenizer=None)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    time.sleep(0.1)  # inproc subscriptions are near-immediate, but not synchronous
    try:
        prompt = list(range(1, 31))  # 30 tokens; with 9 outputs the KV covers 38 = 9 pages + 2
        driver.generate([prompt], SamplingParams(max_new_tokens=9, temperature=0, ignore_eos=True))
        live = LiveSet()
        seqs = []
        while sub.poll(500):
            _, seq, batch = recv_batch(sub)
            seqs.append(seq)
            live.apply(batch.events)
        assert seqs == list(range(len(seqs))) and seqs
        assert len(live.live) == (30 + 9 - 1) // 4
        assert live.live == tree_hashes(driver.scheduler.kv.tree)
        assert driver.scheduler.flush_cache()
        driver.scheduler.step()
        _, _, batch = recv_batch(sub)
        assert batch.events == [AllBlocksCleared()]
    finally:
        sub.close(linger=0)
        driver.scheduler.kv_events.close()
