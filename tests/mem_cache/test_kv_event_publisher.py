"""The ZMQ KV-event publisher: sequence numbers, replay, bind, a busy port, one batch per
scheduler step, and a scheduler's batches decoded by SGLang's own structs."""

from __future__ import annotations

import json
import time
import uuid

import pytest
import zmq

from mem_cache.kv_event_publisher import END_SEQ, ZmqEventPublisher
from mem_cache.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    KVEventsConfig,
)
from tests.mem_cache.kv_event_helpers import LiveSet, per_page, sglang_kv_events, tree_hashes
from tests.ports import free_port


def recv_batch(sock: zmq.Socket, timeout_ms: int = 5000) -> tuple[bytes, int, KVEventBatch]:
    assert sock.poll(timeout_ms), "no KV-event batch arrived"
    topic, seq, payload = sock.recv_multipart()
    return topic, int.from_bytes(seq, "big"), KVEventBatch.decode(payload)


def replay(ctx: zmq.Context, endpoint: str, start: int) -> list[tuple[int, bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        while True:
            assert dealer.poll(5000), "replay did not answer"
            # vLLM's and SGLang's replay frames: a live message's [topic, seq, payload].
            empty, topic, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert topic == payload == b""
                return out
            assert topic == b"kv"
            out.append((int.from_bytes(seq, "big"), payload))
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
        assert [KVEventBatch.decode(p).ts for _, p in got] == [float(s) for s in range(len(sent))]
        k = len(sent) - 3
        assert [s for s, _ in replay(ctx, f"tcp://127.0.0.1:{replay_port}", k)] == [k, k + 1, k + 2]
        assert replay(ctx, f"tcp://127.0.0.1:{replay_port}", len(sent) + 10) == []
    finally:
        sub.close(linger=0)
        pub.close()


def test_bind_overrides_the_endpoint_rule() -> None:
    """SGLang's `bind`: a concrete address is connected to unless bind is true."""
    port = free_port()
    pub = ZmqEventPublisher(KVEventsConfig(endpoint=f"tcp://127.0.0.1:{port}", bind=True))
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 10
        while not sub.poll(50):
            assert time.monotonic() < deadline, "a bound PUB socket never reached its subscriber"
            pub.publish([])
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


@pytest.mark.parametrize("kv_format", ["default", "dynamo"])
def test_sglang_decodes_what_a_scheduler_publishes(kv_format: str) -> None:
    """A router's view (issue 44): subscribe over TCP and replay, decoding every batch with
    SGLang's own KVEventBatch; its pages are the tree's pages, chained as SGLang chains them."""
    sgl = sglang_kv_events()  # skips without sglang or msgspec
    import msgspec

    decoder = msgspec.msgpack.Decoder(sgl.KVEventBatch)
    from managers.inprocess import InProcessDriver
    from srt.sampling.sampling_params import SamplingParams
    from srt.server_args import ServerArgs
    from tests.managers.scripted_worker import ScriptedWorker

    port, replay_port = free_port(), free_port()
    config = {"endpoint": f"tcp://*:{port}", "replay_endpoint": f"tcp://*:{replay_port}",
              "topic": "kv", "format": kv_format}  # fmt: skip
    args = ServerArgs(page_size=4, kv_events_config=json.dumps(config))
    driver = InProcessDriver(args, worker=ScriptedWorker(512, 8, 4), tokenizer=None)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"tcp://127.0.0.1:{port}")
    time.sleep(0.5)  # let the subscription reach the publisher before anything is sent
    try:
        prefix = list(range(1, 17))
        params = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
        driver.generate([prefix + [50] * 8], params)
        driver.generate([prefix + [60] * 8], params)
        live, stored = LiveSet(), []
        payloads = []
        while sub.poll(500):
            _, _, payload = sub.recv_multipart()
            payloads.append(payload)
            batch = decoder.decode(payload)
            assert batch.attn_dp_rank == 0
            live.apply([_ours(e) for e in batch.events])
            stored += [e for e in batch.events if type(e).__name__ == "BlockStored"]
        assert payloads and live.live == tree_hashes(
            driver.scheduler.kv.tree, kv_format == "dynamo"
        )
        pages = per_page([_ours(e) for e in stored])
        assert [t for _, _, t in pages] == [prefix[:4], prefix[4:8], prefix[8:12], prefix[12:],
                                            [50] * 4, [50] * 4, [60] * 4, [60] * 4]  # fmt: skip
        assert pages[6][1] == pages[3][0]  # the branch chains to the shared prefix's last page
        assert all(e.medium == "GPU" and e.block_size == 4 for e in stored)
        got = replay(ctx, f"tcp://127.0.0.1:{replay_port}", 0)
        assert [p for _, p in got] == payloads  # a late router replays the same bytes
    finally:
        sub.close(linger=0)
        driver.scheduler.kv_events.close()


def _ours(event: object) -> KVEvent:
    """An SGLang event struct as the same event of ours (for LiveSet and per_page)."""
    import msgspec

    fields = msgspec.structs.asdict(event)
    cls = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved}.get(type(event).__name__)
    if cls is None:
        return AllBlocksCleared()
    return cls(**{k: v for k, v in fields.items() if k in cls.__dataclass_fields__})
