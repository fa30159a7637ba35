"""KV-cache events: the radix tree's records (stored / removed / cleared, page granularity,
chained hashes, namespaces) and the config. The wire format and SGLang's and vLLM's decoders
are `test_kv_event_wire.py`; the ZMQ publisher is `test_kv_event_publisher.py`."""

from __future__ import annotations

import hashlib
import random

import pytest
import torch

from mem_cache.kv_event_publisher import KVEventStream
from mem_cache.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventRecorder,
    KVEventsConfig,
    expand,
    namespace_seed,
    namespaced,
)
from mem_cache.radix_cache import RadixCache
from tests.mem_cache.kv_event_helpers import LiveSet, per_page, tree_hashes


def recording_tree(page_size: int, dynamo: bool = False) -> tuple[RadixCache, KVEventRecorder]:
    tree = RadixCache(page_size)
    recorder = KVEventRecorder(namespaced=dynamo)
    tree.record_events(recorder)
    return tree, recorder


def insert(tree: RadixCache, tokens: list[int], extra_key: str | None = None) -> int:
    return tree.insert(tokens, torch.arange(len(tokens)), extra_key)


def take(recorder: KVEventRecorder) -> list[KVEvent]:
    return expand(recorder.take())


def hashes_of(events: list[KVEvent]) -> list[int]:
    return [h for e in events for h in getattr(e, "block_hashes", [])]


def sglang_hashes(tokens: list[int], page_size: int) -> list[int]:
    """SGLang's page hashes, written from its hash_binding.cpp: sha256 over the previous
    page's digest and the page's ids as 4-byte little-endian, then the first 16 hex digits of
    the digest as a signed int64."""
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
def test_a_new_node_is_one_block_stored_of_its_full_pages_with_sglang_hashes(
    page_size: int,
) -> None:
    tree, rec = recording_tree(page_size)
    tokens = list(range(100, 150))  # 50 tokens: 50 pages of 1, or 3 full pages of 16
    insert(tree, tokens)
    [event] = take(rec)
    assert isinstance(event, BlockStored)
    assert event.block_hashes == sglang_hashes(tokens, page_size)
    assert event.parent_block_hash is None
    assert event.token_ids == tokens[: len(tokens) // page_size * page_size]
    assert event.block_size == page_size and event.medium == "GPU"
    assert event.lora_id is None and event.lora_name is None


@pytest.mark.parametrize("page_size", [1, 16])
def test_continuation_chains_to_the_prefix_and_splits_record_nothing(page_size: int) -> None:
    tree, rec = recording_tree(page_size)
    prefix = list(range(1, 1 + 2 * page_size))
    insert(tree, prefix + [7] * page_size)
    first = per_page(take(rec))
    # Matching the prefix splits the node there; a split stores and removes nothing.
    assert tree.match_prefix(prefix).prefix_len == len(prefix)
    assert rec.take() == []
    insert(tree, prefix + [9] * page_size)
    [cont] = take(rec)
    assert isinstance(cont, BlockStored)
    assert cont.parent_block_hash == first[len(prefix) // page_size - 1][0]
    assert cont.block_hashes == sglang_hashes(prefix + [9] * page_size, page_size)[-1:]
    # Already present: nothing recorded.
    assert insert(tree, prefix + [9] * page_size) == len(prefix) + page_size
    assert rec.take() == []


def test_stores_that_chain_in_one_step_are_one_event_others_are_not() -> None:
    """SGLang's batching: a node and its child stored in one step are one BlockStored; a
    sibling (parent not the last page before it) starts a new one; removals merge."""
    tree, rec = recording_tree(2)
    insert(tree, [1, 2, 3, 4])
    insert(tree, [1, 2, 3, 4, 5, 6])  # the child of the first node: continues its chain
    insert(tree, [1, 2, 7, 8])  # splits [1 2|3 4], then a sibling: a new event
    events = take(rec)
    assert [len(e.block_hashes) for e in events] == [3, 1]
    (h12, _, _), (h34, _, _), (h56, p56, t56), (h78, p78, t78) = per_page(events)
    assert (p56, t56, p78, t78) == (h34, [5, 6], h12, [7, 8])
    tree.evict(10**6)
    [removed] = take(rec)
    assert isinstance(removed, BlockRemoved) and sorted(removed.block_hashes) == sorted(
        [h12, h34, h56, h78]
    )


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
    [removed] = take(rec)
    assert isinstance(removed, BlockRemoved) and len(removed.block_hashes) == 2
    live.apply([removed])
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


@pytest.mark.parametrize("dynamo", [False, True])
def test_namespaces_and_late_recorders(dynamo: bool) -> None:
    """SGLang's "default" format publishes the plain token chain whatever the extra_key;
    "dynamo" seeds each published hash (and parent) with the namespace."""
    tokens = list(range(1, 17))
    tree, rec = recording_tree(4, dynamo)
    insert(tree, tokens)
    plain = hashes_of(take(rec))
    insert(tree, tokens, extra_key="tenant-a")
    insert(tree, tokens + [5] * 4, extra_key="tenant-a")
    salted_events = take(rec)
    salted = hashes_of(salted_events)
    seed = namespace_seed("tenant-a") if dynamo else None
    assert plain == sglang_hashes(tokens, 4)
    assert salted == namespaced(sglang_hashes(tokens + [5] * 4, 4), seed)
    assert per_page(salted_events)[-1][1] == salted[3]  # the parent, namespaced alike
    assert bool(set(plain) & set(salted)) is not dynamo
    # A recorder attached after the inserts: digests are computed on demand, to the same values.
    late = RadixCache(4)
    insert(late, tokens)
    insert(late, tokens + [5] * 4, extra_key="tenant-a")
    rec2 = KVEventRecorder(namespaced=dynamo)
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
    tree, rec = recording_tree(page_size, dynamo=True)  # namespaces never share a hash
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
    assert live.live == tree_hashes(tree, namespaced=True)


def test_cache_finished_stores_full_pages_only(make_env) -> None:
    env = make_env(page_size=16, size=256)
    rec = KVEventRecorder()
    env.cache.record_events(rec)
    req = env.admit(list(range(1, 41)))  # 40 tokens: 2 full pages, 8 tokens not cached
    env.finish(req)
    pages = per_page(take(rec))
    assert len(pages) == 2 == 40 // 16
    assert [t for _, _, t in pages] == [list(range(1, 17)), list(range(17, 33))]
    env.kv.flush()
    assert isinstance(take(rec)[-1], AllBlocksCleared)


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
    # SGLang's keys: bind and format.
    sglang = KVEventsConfig.from_json('{"publisher": "zmq", "bind": true, "format": "dynamo"}')
    assert (sglang.bind, sglang.format) == (True, "dynamo")
    assert KVEventsConfig().format == "default" and KVEventsConfig().bind is None
    with pytest.raises(ValueError, match="format must be one of 'default', 'dynamo'"):
        KVEventsConfig.from_json('{"format": "vllm"}')
    with pytest.raises(ValueError, match="bind must be true, false or null"):
        KVEventsConfig.from_json('{"bind": "yes"}')
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
    from srt.server_args_cli import prepare_server_args

    with pytest.raises(SystemExit) as exc:
        prepare_server_args(["--kv-events-config", '{"endpoint": "tcp://*:1", "bogus": 1}'])
    assert exc.value.code == 2
    assert "unknown key(s) 'bogus'" in capsys.readouterr().err
    ok = prepare_server_args(["--kv-events-config", '{"publisher": "null"}'])
    assert ok.kv_events_config == '{"publisher": "null"}'
