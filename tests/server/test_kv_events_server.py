"""KV events from a real server (`--kv-events-config`), read by a ZMQ SUB client as Dynamo or
llm-d would: pages stored for a prompt, chained hashes, removals on eviction, a clear on
`/flush_cache`, and a late subscriber that replays everything from sequence 0. Where sglang and
msgspec are installed, every batch is also decoded by SGLang's own `KVEventBatch` (issue 44).

One server: page size 16 and a 1024-token pool, so a few prompts force eviction.
"""

from __future__ import annotations

import itertools
import json
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests
import zmq

from mem_cache.kv_event_publisher import END_SEQ
from mem_cache.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    KVEventBatch,
    page_digests,
    public_hashes,
)
from tests.mem_cache.kv_event_helpers import per_page, sglang_decoder
from tests.ports import free_port
from tests.server.server_process import ServerProcess

pytestmark = pytest.mark.slow

PAGE = 16
POOL_TOKENS = 1024
TOPIC = "kv@radixrt"


@dataclass
class Events:
    """A SUB client's view of the stream."""

    sub: zmq.Socket
    sglang: Callable[[bytes], Any] | None  # SGLang's decoder, where installed
    payloads: dict[int, bytes] = field(default_factory=dict)  # seq -> payload

    def drain(self, quiet_s: float = 0.5) -> list[KVEventBatch]:
        """Every batch that arrives until none has for `quiet_s`."""
        out = []
        while self.sub.poll(int(quiet_s * 1000)):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == TOPIC.encode()
            self.payloads[int.from_bytes(seq, "big")] = payload
            out.append(KVEventBatch.decode(payload))
            if self.sglang is not None:
                theirs = self.sglang(payload)
                assert [type(e).__name__ for e in theirs.events] == [
                    type(e).__name__ for e in out[-1].events
                ]
                assert [getattr(e, "block_hashes", None) for e in theirs.events] == [
                    getattr(e, "block_hashes", None) for e in out[-1].events
                ]
        return out


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, tiny_served_model: str
) -> Iterator[tuple[str, int, int]]:
    """A tiny model's server: the events follow the tokens, whatever the model."""
    port, replay_port = free_port(), free_port()
    config = {
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
        "topic": TOPIC,
    }
    log = Path(tmp_path_factory.mktemp("kv_events")) / "server.log"
    srv = ServerProcess(
        "--model-path", tiny_served_model, "--dtype", "float32",
        "--max-total-tokens", str(POOL_TOKENS), "--page-size", str(PAGE),
        "--kv-events-config", json.dumps(config), log_path=log,
    )  # fmt: skip
    yield srv.url, port, replay_port
    code = srv.stop()
    assert code == 0, f"server exited with {code} on SIGTERM: {srv.tail()}"


@pytest.fixture(scope="module")
def events(server: tuple[str, int, int]) -> Iterator[Events]:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
    sub.connect(f"tcp://127.0.0.1:{server[1]}")
    time.sleep(1.0)  # let the subscription reach the publisher before anything is sent
    yield Events(sub, sglang_decoder())
    sub.close(linger=0)


def generate(url: str, ids: list[int], new_tokens: int) -> None:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True},
    }
    r = requests.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text


def stored(batches: list[KVEventBatch]) -> list[tuple[int, int | None, list[int]]]:
    """Every stored page as (hash, parent hash, token ids)."""
    return per_page([e for b in batches for e in b.events])


def test_kv_events_from_a_live_server(server: tuple[str, int, int], events: Events) -> None:
    url, _, replay_port = server
    rng = random.Random(15)
    prompt = [rng.randrange(100, 10_000) for _ in range(40)]

    # An n-token prompt whose KV fills its last page (n + k - 1 = 16 * ceil(n / 16)):
    # ceil(n / 16) BlockStored, chained, hashed as SGLang hashes them.
    pages = -(-len(prompt) // PAGE)
    generate(url, prompt, new_tokens=pages * PAGE - len(prompt) + 1)
    batches = events.drain()
    first = stored(batches)
    assert len(first) == pages
    assert [h for h, _, _ in first[:2]] == public_hashes(page_digests(prompt, PAGE, None))
    assert first[0][1] is None
    for prev, cur in itertools.pairwise(first):
        assert cur[1] == prev[0]
    assert first[2][2][:8] == prompt[32:]
    assert all(e.block_size == PAGE for b in batches for e in b.events)

    # A prompt sharing the first two pages: its new pages chain to the shared second page.
    branch = prompt[:32] + [rng.randrange(100, 10_000) for _ in range(32)]
    generate(url, branch, new_tokens=1)
    new = stored(events.drain())
    assert len(new) == 2 and new[0][1] == first[1][0]

    # Distinct prompts past the pool's size: the oldest pages are evicted and announced.
    for _ in range(6):
        generate(url, [rng.randrange(100, 10_000) for _ in range(200)], new_tokens=1)
    batches = events.drain()
    removed = [h for b in batches for e in b.events if isinstance(e, BlockRemoved)
               for h in e.block_hashes]  # fmt: skip
    all_stored = [h for h, _, _ in first + new + stored(batches)]
    assert removed, "no eviction in a pool smaller than the prompts sent"
    assert len(set(removed)) == len(removed) and set(removed) <= set(all_stored)

    r = requests.post(url + "/flush_cache", timeout=30)
    assert r.status_code == 200, r.text
    assert [e for b in events.drain() for e in b.events] == [AllBlocksCleared()]

    # Sequence numbers increase by one; a subscriber that joins now replays all of it.
    seqs = sorted(events.payloads)
    assert seqs == list(range(len(seqs)))
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    try:
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        replayed: dict[int, bytes] = {}
        while True:
            assert dealer.poll(5000), "no replay answer"
            _, topic, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                break
            assert topic == TOPIC.encode()
            replayed[int.from_bytes(seq, "big")] = payload
    finally:
        dealer.close(linger=0)
    assert replayed == events.payloads
