"""KV-cache events: the radix tree's records (stored / removed / cleared, page granularity,
chained hashes), the wire format and the config. The ZMQ publisher is
`test_kv_event_publisher.py`."""

from __future__ import annotations

import hashlib
import random

import msgpack
import pytest
import torch

from mem_cache.kv_event_publisher import KVEventStream
from mem_cache.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    KVEventRecorder,
    KVEventsConfig,
    encode_records,
    expand,
)
from mem_cache.radix_cache import RadixCache
from tests.mem_cache.kv_event_helpers import LiveSet, tree_hashes


def recording_tree(page_size: int) -> tuple[RadixCache, KVEventRecorder]:
    tree = RadixCache(page_size)
    recorder = KVEventRecorder()
    tree.record_events(recorder)
    return tree, recorder


def insert(tree: RadixCache, tokens: list[int], extra_key: str | None = None) -> int:
    return tree.insert(tokens, torch.arange(len(tokens)), extra_key)


def take(recorder: KVEventRecorder) -> list[KVEvent]:
    return expand(recorder.take())


def hashes_of(events: list[KVEvent]) -> list[int]:
    return [h for e in events for h in getattr(e, "block_hashes", [])]


def sglang_hashes(tokens: list[int], page_size: int) -> list[int]:
    """SGLang's page hashes, written from its description: sha256 over the previous page's hex
    digest (as bytes) and the page's ids as 4-byte little-endian, then the first 16 hex digits
    as a signed int64."""
    out, prior = [], None
    for start in range(0, len(tokens) - page_size + 1, page_size):
        h = hashlib.sha256()
        if prior:
            h.update(bytes.fromhex(prior))
        for t in tokens[start : start + page_size]:
            h.update(t.to_bytes(4, byteorder="little", signed=False))
        prior = h.hexdigest()
        value = int(prior[:16], 16)
        out.append(value - 2**64 if value >= 2**63 else value)
    return out


# ---- the tree's records ---------------------------------------------------------------------
@pytest.mark.parametrize("page_size", [1, 16])
def test_one_block_stored_per_full_page_with_sglang_hashes(page_size: int) -> None:
    tree, rec = recording_tree(page_size)
    tokens = list(range(100, 150))  # 50 tokens: 50 pages of 1, or 3 full pages of 16
    insert(tree, tokens)
    events = take(rec)
    assert all(isinstance(e, BlockStored) for e in events)
    assert len(events) == len(tokens) // page_size
    assert [e.block_hashes[0] for e in events] == sglang_hashes(tokens, page_size)
    for i, e in enumerate(events):
        assert e.token_ids == tokens[i * page_size : (i + 1) * page_size]
        assert e.block_size == page_size and e.medium == "GPU" and e.lora_id is None
        assert e.parent_block_hash == (events[i - 1].block_hashes[0] if i else None)


@pytest.mark.parametrize("page_size", [1, 16])
def test_continuation_chains_to_the_prefix_and_splits_record_nothing(page_size: int) -> None:
    tree, rec = recording_tree(page_size)
    prefix = list(range(1, 1 + 2 * page_size))
    insert(tree, prefix + [7] * page_size)
    first = take(rec)
    # Matching the prefix splits the node there; a split stores and removes nothing.
    assert tree.match_prefix(prefix).prefix_len == len(prefix)
    assert rec.take() == []
    insert(tree, prefix + [9] * page_size)
    [cont] = take(rec)
    assert isinstance(cont, BlockStored)
    assert cont.parent_block_hash == first[len(prefix) // page_size - 1].block_hashes[0]
    assert cont.block_hashes == sglang_hashes(prefix + [9] * page_size, page_size)[-1:]
    # Already present: nothing recorded.
    assert insert(tree, prefix + [9] * page_size) == len(prefix) + page_size
    assert rec.take() == []


@pytest.mark.parametrize("page_size", [1, 16])
def test_eviction_removes_exactly_what_was_stored_and_reset_clears(page_size: int) -> None:
    tree, rec = recording_tree(page_size)
    live = LiveSet()
    base = list(range(1, 1 + 3 * page_size))
    for tail in range(4):
        insert(tree, base + [50 + tail] * (2 * page_size))
    tree.match_prefix(base[:page_size])  # a split in the shared part
    live.apply(take(rec))
    assert len(live.live) == 3 + 4 * 2

    tree.evict(2 * page_size)  # one leaf
    removed = take(rec)
    assert len(removed) == 2 and all(isinstance(e, BlockRemoved) for e in removed)
    live.apply(removed)
    assert live.live == tree_hashes(tree)

    tree.evict(10**6)
    live.apply(take(rec))
    assert live.live == set() == tree_hashes(tree)

    insert(tree, base)
    tree.reset()
    events = take(rec)
    assert isinstance(events[-1], AllBlocksCleared)
    live.apply(events)
    assert live.live == set()


def test_namespaces_hash_apart_and_late_recorders_hash_the_same() -> None:
    tokens = list(range(1, 17))
    tree, rec = recording_tree(4)
    insert(tree, tokens)
    plain = hashes_of(take(rec))
    insert(tree, tokens, extra_key="tenant-a")
    salted = hashes_of(take(rec))
    assert len(plain) == len(salted) == 4 and not set(plain) & set(salted)
    # A recorder attached after the inserts: digests are computed on demand, to the same values.
    late = RadixCache(4)
    insert(late, tokens)
    insert(late, tokens, extra_key="tenant-a")
    rec2 = KVEventRecorder()
    late.record_events(rec2)
    late.evict(10**6)
    assert sorted(hashes_of(take(rec2))) == sorted(plain + salted)


def test_no_recorder_no_digests() -> None:
    tree = RadixCache(1)
    insert(tree, [1, 2, 3])
    tree.match_prefix([1, 2])
    assert all(n.digests is None for n in tree._iter_nodes())


@pytest.mark.parametrize("page_size", [1, 4])
def test_random_operations_keep_the_consumer_view_exact(page_size: int) -> None:
    rng = random.Random(page_size)
    tree, rec = recording_tree(page_size)
    live = LiveSet()
    locked = []
    for _ in range(400):
        op = rng.random()
        tokens = [rng.randrange(1, 4) for _ in range(rng.randrange(1, 12 * page_size))]
        key = rng.choice([None, None, "ns"])
        if op < 0.45:
            insert(tree, tokens, key)
        elif op < 0.65:
            m = tree.match_prefix(tokens, key)
            if rng.random() < 0.5:
                tree.inc_lock_ref(m.last_node)
                locked.append(m.last_node)
        elif op < 0.8 and locked:
            tree.dec_lock_ref(locked.pop(rng.randrange(len(locked))))
        elif op < 0.98:
            tree.evict(rng.randrange(1, 6 * page_size))
        else:
            tree.reset()
            locked.clear()
        live.apply(take(rec))
        assert len(live.live) * page_size == tree.total_size()
    assert live.live == tree_hashes(tree)


def test_cache_finished_stores_full_pages_only(make_env) -> None:
    env = make_env(page_size=16, size=256)
    rec = KVEventRecorder()
    env.cache.record_events(rec)
    req = env.admit(list(range(1, 41)))  # 40 tokens: 2 full pages, 8 tokens not cached
    env.finish(req)
    events = take(rec)
    assert len(events) == 2 == 40 // 16
    env.kv.flush()
    assert isinstance(take(rec)[-1], AllBlocksCleared)


# ---- wire format ------------------------------------------------------------------------------
def test_wire_format_is_vllm_and_sglang_array_like() -> None:
    batch = KVEventBatch(
        12.5,
        [
            BlockStored([-5], None, [1, 2], 2),
            BlockStored([7], -5, [3, 4], 2),
            BlockRemoved([-5]),
            AllBlocksCleared(),
        ],
    )
    payload = batch.encode()
    assert msgpack.unpackb(payload) == [
        12.5,
        [
            ["BlockStored", [-5], None, [1, 2], 2, None, "GPU"],
            ["BlockStored", [7], -5, [3, 4], 2, None, "GPU"],
            ["BlockRemoved", [-5], "GPU"],
            ["AllBlocksCleared"],
        ],
        0,
    ]
    assert KVEventBatch.decode(payload) == batch
    # The publisher's path (records straight to bytes) gives the same bytes.
    tree, rec = recording_tree(2)
    insert(tree, [1, 2, 3, 4])
    tree.evict(2)
    tree.reset()
    records = rec.take()
    assert encode_records(records, 3.0) == KVEventBatch(3.0, expand(records)).encode()
    # An older producer's shape (no rank, no medium) still reads.
    old = msgpack.packb([1.0, [["BlockStored", [1], None, [5], 1, None]]])
    assert KVEventBatch.decode(old) == KVEventBatch(1.0, [BlockStored([1], None, [5], 1)], None)


def test_msgspec_consumers_decode_our_batches() -> None:
    """Byte for byte what SGLang's msgspec structs encode; readable by the older, shorter
    structs of vLLM's subscriber example."""
    msgspec = pytest.importorskip("msgspec")

    def structs(omit_defaults: bool, with_medium: bool, rank: str | None):
        # (defstruct: locally defined classes cannot resolve postponed annotations)
        opts = {"array_like": True, "omit_defaults": omit_defaults, "gc": False}
        medium = [("medium", str | None, None)] if with_medium else []
        stored = msgspec.defstruct(
            "Stored",
            [
                ("block_hashes", list[int]),
                ("parent_block_hash", int | None),
                ("token_ids", list[int]),
                ("block_size", int),
                ("lora_id", int | None),
                *medium,
            ],
            tag="BlockStored",
            **opts,
        )
        removed = msgspec.defstruct(
            "Removed", [("block_hashes", list[int]), *medium], tag="BlockRemoved", **opts
        )
        cleared = msgspec.defstruct("Cleared", [], tag="AllBlocksCleared", **opts)
        batch_fields = [("ts", float), ("events", list[stored | removed | cleared])]
        if rank is not None:
            batch_fields.append((rank, int | None, None))
        return msgspec.defstruct("Batch", batch_fields, **opts), stored, removed, cleared

    events = [
        BlockStored([-3], None, [1, 2], 2),
        BlockStored([2**62], -3, [3, 4], 2),
        BlockRemoved([-3]),
        AllBlocksCleared(),
    ]
    ours = KVEventBatch(1.25, events).encode()

    batch, stored, removed, cleared = structs(False, True, "attn_dp_rank")  # SGLang today
    theirs = batch(
        1.25,
        [
            stored([-3], None, [1, 2], 2, None, "GPU"),
            stored([2**62], -3, [3, 4], 2, None, "GPU"),
            removed([-3], "GPU"),
            cleared(),
        ],
        0,
    )
    assert msgspec.msgpack.encode(theirs) == ours

    batch, *_ = structs(True, False, None)  # vLLM's first subscriber example, SGLang before
    got = msgspec.msgpack.Decoder(batch).decode(ours)
    assert [type(e).__name__ for e in got.events] == ["Stored", "Stored", "Removed", "Cleared"]
    assert got.events[1].parent_block_hash == -3 and got.events[2].block_hashes == [-3]


# ---- config -----------------------------------------------------------------------------------
def test_config_keys_and_errors() -> None:
    cfg = KVEventsConfig.from_json(
        '{"publisher": "zmq", "endpoint": "tcp://*:6000", "replay_endpoint": "tcp://*:6001",'
        ' "buffer_steps": 5, "hwm": 10, "max_queue_size": 7, "topic": "kv"}'
    )
    assert (cfg.endpoint, cfg.replay_endpoint, cfg.buffer_steps, cfg.topic) == (
        "tcp://*:6000",
        "tcp://*:6001",
        5,
        "kv",
    )
    assert cfg.enabled
    assert not KVEventsConfig.from_json('{"publisher": "null"}').enabled
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": false}').enabled
    with pytest.raises(ValueError, match="unknown key.*'endpont'.*known keys"):
        KVEventsConfig.from_json('{"endpont": "tcp://*:1"}')
    with pytest.raises(ValueError, match="publisher must be"):
        KVEventsConfig.from_json('{"publisher": "kafka"}')
    with pytest.raises(ValueError, match="buffer_steps must be a positive integer"):
        KVEventsConfig.from_json('{"buffer_steps": "10"}')
    with pytest.raises(ValueError, match="not valid JSON"):
        KVEventsConfig.from_json("{endpoint: 1}")
    with pytest.raises(ValueError, match="JSON object"):
        KVEventsConfig.from_json("[]")


def test_null_publisher_records_nothing() -> None:
    tree = RadixCache(1)
    stream = KVEventStream.create('{"publisher": "null"}', tree)
    insert(tree, [1, 2])
    stream.publish_step()
    assert tree.events is None and stream.publisher is None


def test_bad_config_stops_the_command_line_before_the_model_loads(capsys) -> None:
    from srt.server_args import prepare_server_args

    with pytest.raises(SystemExit) as exc:
        prepare_server_args(["--kv-events-config", '{"endpoint": "tcp://*:1", "bogus": 1}'])
    assert exc.value.code == 2
    assert "unknown key(s) 'bogus'" in capsys.readouterr().err
    ok = prepare_server_args(["--kv-events-config", '{"publisher": "null"}'])
    assert ok.kv_events_config == '{"publisher": "null"}'
