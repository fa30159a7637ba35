"""KV-cache events: which pages the prefix tree stores and drops, in the wire format of vLLM's
and SGLang's `--kv-events-config`, so KV-aware routers (NVIDIA Dynamo, llm-d) can route on
what each server actually has cached.

    RadixCache ─────▶ KVEventRecorder ──take(), once a step──▶ ZmqEventPublisher
      insert: a new node's pages stored                         one KVEventBatch a step,
      evict:  an evicted node's pages removed                   encoded and sent on its own
      reset:  all cleared                                       thread (kv_event_publisher.py)

The tree records only when a recorder is attached (`BasePrefixCache.record_events`); the
records are compact (a node's page digests and key) and become one event per page when the
publisher thread encodes them.

Page hashes (SGLang's scheme, so equal token prefixes give equal hashes on both): each full
page's digest is SHA-256 over the previous page's 32-byte digest (none for a page at the root)
and the page's token ids as 4-byte little-endian unsigned ints; a page's published hash is the
first 8 bytes of its digest read as a big-endian signed 64-bit int. `parent_block_hash` is the
published hash of the page before the first page of an event (None at the root). Requests with
an `extra_key` (a cache namespace) seed their chain with a digest of it, so equal tokens in
different namespaces never share a hash. Only full pages are cached, hence announced.

Wire format: msgspec `array_like=True` tagged structs (a struct is an array of its fields in
order, a tagged one starts with its class name), written here with plain msgpack; the same
bytes SGLang's `srt/disaggregation/kv_events.py` sends, and what vLLM's
`vllm/distributed/kv_events.py` and Dynamo's ZMQ listener read:
    KVEventBatch      [ts: float, events: list, data_parallel_rank: int]
    BlockStored       ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
                       lora_id, medium]
    BlockRemoved      ["BlockRemoved", block_hashes, medium]
    AllBlocksCleared  ["AllBlocksCleared"]
Decoders of the older, shorter structs ignore the trailing fields (msgspec's array_like rule).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any

MEDIUM_GPU = "GPU"  # the primary KV pool (the name consumers map to the device tier)
DIGEST_BYTES = 32


# ---- page hashes -------------------------------------------------------------------------
def page_digests(tokens: list[int], page_size: int, prior: bytes | None) -> bytes:
    """The chained SHA-256 digests of `tokens`' full pages, concatenated (32 bytes a page)."""
    packed = struct.pack(f"<{len(tokens)}I", *tokens)
    step = 4 * page_size
    out = bytearray()
    for start in range(0, len(packed) - step + 1, step):
        h = hashlib.sha256()
        if prior is not None:
            h.update(prior)
        h.update(packed[start : start + step])
        prior = h.digest()
        out += prior
    return bytes(out)


def namespace_digest(extra_key: str | None) -> bytes | None:
    """The digest a chain at the root starts from: none in the default namespace."""
    if extra_key is None:
        return None
    return hashlib.sha256(b"radixrt-extra-key\x00" + extra_key.encode()).digest()


def public_hashes(digests: bytes) -> list[int]:
    """The published 64-bit hash of each 32-byte digest (its first 8 bytes, signed)."""
    return [h for (h,) in struct.iter_unpack(">q24x", digests)]


# ---- events, as consumers decode them ----------------------------------------------------
@dataclass(slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU

    def to_wire(self) -> list[Any]:
        return [
            "BlockStored",
            self.block_hashes,
            self.parent_block_hash,
            self.token_ids,
            self.block_size,
            self.lora_id,
            self.medium,
        ]


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU

    def to_wire(self) -> list[Any]:
        return ["BlockRemoved", self.block_hashes, self.medium]


@dataclass(slots=True)
class AllBlocksCleared:
    def to_wire(self) -> list[Any]:
        return ["AllBlocksCleared"]


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
_EVENT_TYPES: dict[str, type] = {
    t.__name__: t for t in (BlockStored, BlockRemoved, AllBlocksCleared)
}


@dataclass(slots=True)
class KVEventBatch:
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = 0

    def encode(self) -> bytes:
        import msgpack

        wire = [self.ts, [e.to_wire() for e in self.events], self.data_parallel_rank]
        return msgpack.packb(wire, use_bin_type=True)

    @staticmethod
    def decode(payload: bytes) -> KVEventBatch:
        """Read a batch in either array shape (with or without the rank); extra trailing
        fields of an event are ignored, as msgspec does."""
        import msgpack

        ts, raw_events, *rest = msgpack.unpackb(payload, raw=False)
        return KVEventBatch(ts, [_from_wire(w) for w in raw_events], rest[0] if rest else None)


def _from_wire(wire: list[Any]) -> KVEvent:
    tag, *values = wire
    cls = _EVENT_TYPES.get(tag)
    if cls is None:
        raise ValueError(f"unknown KV event tag {tag!r}")
    return cls(*values[: len(fields(cls))])


# ---- what the tree records ---------------------------------------------------------------
# A record becomes its events' wire arrays directly (one per page, SGLang's shape), without
# building the event objects: the publisher thread encodes many of them while holding the GIL.
@dataclass(slots=True)
class PagesStored:
    """A new tree node: its pages' digests, the digest of the page before them (None at the
    root) and its key (page-aligned; never changed in place by the tree)."""

    digests: bytes
    parent: bytes | None
    token_ids: list[int]
    page_size: int

    def wire(self) -> Iterator[list[Any]]:
        parent = public_hashes(self.parent)[0] if self.parent is not None else None
        p, tokens = self.page_size, self.token_ids
        for i, h in enumerate(public_hashes(self.digests)):
            yield ["BlockStored", [h], parent, tokens[i * p : i * p + p], p, None, MEDIUM_GPU]
            parent = h


@dataclass(slots=True)
class PagesRemoved:
    digests: bytes

    def wire(self) -> Iterator[list[Any]]:
        for h in public_hashes(self.digests):
            yield ["BlockRemoved", [h], MEDIUM_GPU]


@dataclass(slots=True)
class Cleared:
    def wire(self) -> Iterator[list[Any]]:
        yield ["AllBlocksCleared"]


Record = PagesStored | PagesRemoved | Cleared


def encode_records(records: list[Record], ts: float, data_parallel_rank: int = 0) -> bytes:
    """One KVEventBatch payload: the same bytes as `KVEventBatch(ts, expand(records)).encode()`."""
    import msgpack

    wire = [w for record in records for w in record.wire()]
    return msgpack.packb([ts, wire, data_parallel_rank], use_bin_type=True)


def expand(records: list[Record]) -> list[KVEvent]:
    """Records -> the events a consumer decodes from them."""
    return [_from_wire(w) for record in records for w in record.wire()]


@dataclass(slots=True)
class KVEventRecorder:
    """Where a prefix cache appends what it stores and drops; taken once per scheduler step."""

    records: list[Record] = field(default_factory=list)

    def stored(
        self, digests: bytes, parent: bytes | None, token_ids: list[int], page_size: int
    ) -> None:
        self.records.append(PagesStored(digests, parent, token_ids, page_size))

    def removed(self, digests: bytes) -> None:
        self.records.append(PagesRemoved(digests))

    def cleared(self) -> None:
        self.records.append(Cleared())

    def take(self) -> list[Record]:
        records, self.records = self.records, []
        return records


# ---- --kv-events-config ------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """The JSON of `--kv-events-config` (vLLM's and SGLang's keys). Giving a config turns
    publishing on unless it says `"publisher": "null"` or `"enable_kv_cache_events": false`.
    An endpoint with `*`, `::`, `0.0.0.0`, `ipc://` or `inproc://` is bound, any other is
    connected to (the consumer binds); the replay endpoint is always bound."""

    publisher: str = "zmq"  # "zmq" | "null"
    endpoint: str = "tcp://*:5557"  # PUB: [topic, seq (8 bytes, big-endian), payload]
    replay_endpoint: str | None = None  # ROUTER: send a start seq, get every batch since
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # PUB high-water mark (ZMQ drops for a subscriber past it)
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""
    enable_kv_cache_events: bool = True  # vLLM's switch, accepted for its configs

    @property
    def enabled(self) -> bool:
        return self.publisher != "null" and self.enable_kv_cache_events

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        raw = _json_object(text)
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ValueError(
                f"--kv-events-config: unknown key(s) {', '.join(map(repr, unknown))}; "
                f"known keys: {', '.join(known)}"
            )
        for key, value in raw.items():
            _check_value(key, value)
        config = cls(**raw)
        if config.publisher not in ("zmq", "null"):
            raise ValueError(
                f"--kv-events-config: publisher must be 'zmq' or 'null', got {config.publisher!r}"
            )
        return config


_INT_KEYS = ("buffer_steps", "hwm", "max_queue_size")


def _json_object(text: str) -> dict[str, Any]:
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--kv-events-config is not valid JSON: {e}") from None
    if isinstance(raw, dict):
        return raw
    raise ValueError(f"--kv-events-config must be a JSON object, got {text!r}")


def _check_value(key: str, value: Any) -> None:
    if key in _INT_KEYS:
        ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
        expected = "a positive integer"
    elif key == "enable_kv_cache_events":
        ok, expected = isinstance(value, bool), "true or false"
    elif key == "replay_endpoint":
        ok, expected = value is None or isinstance(value, str), "a string or null"
    else:
        ok, expected = isinstance(value, str), "a string"
    if not ok:
        raise ValueError(f"--kv-events-config: {key} must be {expected}, got {value!r}")
