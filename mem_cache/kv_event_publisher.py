"""The ZMQ side of KV-cache events (kv_events.py holds the events, hashes and wire format).

    scheduler thread                         publisher thread ("kv-events")
    KVEventStream.publish_step()             encode ─▶ PUB   [topic, seq, payload]
      recorder.take() ─▶ queue (bounded) ──▶         ─▶ replay buffer (last buffer_steps)
                                             ROUTER: [id, "", start_seq] ─▶
                                                     [id, "", topic, seq, payload] for each
                                                     buffered seq >= start, then
                                                     [id, "", "", -1 (8 bytes, signed), ""]

One batch per scheduler step that changed the tree. The scheduler never waits on ZMQ: it only
appends to a bounded queue, and a batch that finds the queue full is dropped with a warning.
Sequence numbers are given when a batch is queued, so a dropped batch leaves a gap a consumer
can see (as does a PUB send past the high-water mark); replay fills gaps still in its buffer.
Sequence numbers are 8-byte big-endian and start at 0, and a replayed batch carries the same
[topic, seq, payload] as a live one (vLLM's and SGLang's publishers).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

import zmq

from mem_cache.kv_events import KVEventRecorder, KVEventsConfig, Record, encode_records

if TYPE_CHECKING:
    from mem_cache.base_prefix_cache import BasePrefixCache

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_POLL_S = 0.02  # how often the thread looks at the replay socket while no batch arrives


def _binds(endpoint: str, bind: bool | None = None) -> bool:
    if bind is not None:
        return bind
    return any(s in endpoint for s in ("*", "::", "0.0.0.0")) or endpoint.startswith(
        ("ipc://", "inproc://")
    )


class ZmqEventPublisher:
    """PUB socket + replay ROUTER, served from one background thread."""

    def __init__(self, config: KVEventsConfig, context: zmq.Context | None = None) -> None:
        self.config = config
        self._ctx = context or zmq.Context.instance()
        self._topic = config.topic.encode()
        self._queue: queue.Queue[tuple[int, float, list[Record]] | None] = queue.Queue(
            config.max_queue_size
        )
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self.dropped = 0
        # Bound here so a busy port fails at startup; from now on only the thread uses them.
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket | None = None
        try:
            if _binds(config.endpoint, config.bind):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                # A full replay and its end marker must fit, or ROUTER drops the rest silently.
                self._replay.setsockopt(zmq.SNDHWM, 2 * (config.buffer_steps + 1))
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise RuntimeError(f"--kv-events-config: cannot open its endpoints: {e}") from e
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, records: list[Record], ts: float | None = None) -> int | None:
        """Queue one batch; return its sequence number (None if the queue was full)."""
        seq = self._next_seq
        self._next_seq += 1
        try:
            self._queue.put_nowait((seq, time.time() if ts is None else ts, records))
        except queue.Full:
            self.dropped += 1
            logger.warning(
                "KV events: publisher queue full, batch %d dropped (%d so far)", seq, self.dropped
            )
            return None
        return seq

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (within `timeout`), then close the sockets."""
        if not self._thread.is_alive():
            return
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass  # the thread is stuck; it is a daemon and dies with the process
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("KV events: publisher thread did not stop within %.1f s", timeout)

    # ---- the publisher thread ----------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                if self._replay is not None:
                    while self._replay.poll(0):
                        self._serve_replay()
                try:
                    item = self._queue.get(timeout=_POLL_S)
                except queue.Empty:
                    continue
                if item is None:
                    return
                seq, ts, records = item
                payload = encode_records(records, ts)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
        except Exception:
            logger.exception("KV events: publisher thread failed; no more events are sent")
        finally:
            self._close_sockets()

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV events: malformed replay request (%d frames)", len(frames))
            return
        client, empty, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= start_seq:
                frames = (client, empty, self._topic, seq.to_bytes(8, "big"), payload)
                self._replay.send_multipart(frames)
        self._replay.send_multipart((client, empty, b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)


class KVEventStream:
    """What the scheduler holds: once per step, the tree's records become one batch."""

    def __init__(self, recorder: KVEventRecorder | None, publisher: ZmqEventPublisher | None):
        self.recorder = recorder
        self.publisher = publisher

    @classmethod
    def create(cls, config_json: str | None, tree: BasePrefixCache) -> KVEventStream:
        """From `--kv-events-config`; with none (or a "null" publisher) the tree records
        nothing and `publish_step` does nothing."""
        config = KVEventsConfig.from_json(config_json) if config_json else None
        if config is None or not config.enabled:
            return cls(None, None)
        recorder = KVEventRecorder(namespaced=config.format == "dynamo")
        publisher = ZmqEventPublisher(config)
        tree.record_events(recorder)
        logger.info(
            "KV events: publishing on %s (replay %s, topic %r, format %s)",
            config.endpoint,
            config.replay_endpoint or "off",
            config.topic,
            config.format,
        )
        return cls(recorder, publisher)

    def publish_step(self) -> None:
        if self.recorder is None or not self.recorder.records:
            return
        assert self.publisher is not None
        self.publisher.publish(self.recorder.take())

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
