"""KV-cache events: which pages the prefix tree stores and drops, in the wire format of vLLM's
and SGLang's `--kv-events-config`, so KV-aware routers (NVIDIA Dynamo, llm-d) can route on
what each server actually has cached.

    RadixCache ─────▶ KVEventRecorder ──take(), once a step──▶ ZmqEventPublisher
      insert: a new node's pages stored                         one KVEventBatch a step,
      evict:  an evicted node's pages removed                   encoded and sent on its own
      reset:  all cleared                                       thread (kv_event_publisher.py)

The tree records only when a recorder is attached (`BasePrefixCache.record_events`); the
records are compact (a node's page digests and key) and become events when the publisher
thread encodes them.

Page hashes (SGLang's scheme, so equal token prefixes give equal hashes on both): each full
page's digest is SHA-256 over the previous page's 32-byte digest (none for a page at the root)
and the page's token ids as 4-byte little-endian unsigned ints; a page's published hash is the
first 8 bytes of its digest read as a big-endian signed 64-bit int. `parent_block_hash` is the
published hash of the page before the event's first page (None at the root). As in SGLang's
"default" format, a request's `extra_key` does not change the hashes; with `"format":
"dynamo"` each published hash h becomes the first 8 bytes (signed) of SHA-256(seed, h as 8
big-endian bytes), the seed a digest of the extra_key (`namespace_seed`), SGLang's
`namespaced_block_hash`. Only full pages are cached, hence announced.

Wire format (msgpack): a batch is an array, each event a map tagged by its class name under
"type" — msgspec's `array_like` batch of `tag=True` structs, what vLLM's
`vllm/distributed/kv_events.py` and SGLang's `srt/disaggregation/kv_events.py` decode:
    KVEventBatch      [ts, [event, ...], data_parallel_rank (0)]
    BlockStored       {"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids",
                       "block_size", "lora_id": None, "medium": "GPU", "lora_name": None}
    BlockRemoved      {"type": "BlockRemoved", "block_hashes", "medium": "GPU"}
    AllBlocksCleared  {"type": "AllBlocksCleared"}
`lora_name` is required by vLLM's struct, optional in SGLang's; the optional fields neither
requires (SGLang's cache_salt, session_id; vLLM's extra_keys, group_idx, ...) are left out, as
their encoders leave out a field at its default. As SGLang does, consecutive stores that chain
(a node's pages, a node and its child) are one BlockStored with several block_hashes and
their token_ids concatenated (`block_size` stays the page size), and consecutive removals are
one BlockRemoved.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any

from mem_cache.kv_events_config import KVEventsConfig  # noqa: F401 (server_args's import path)

MEDIUM_GPU = "GPU"  # the primary KV pool (the name consumers map to the device tier)
DIGEST_BYTES = 32
TAG = "type"  # msgspec's tag field for `tag=True` structs
# SGLang's namespace seed tag: the same extra_key gives the same seed, hence the same hashes.
_NAMESPACE_TAG = b"sglang-kv-event-namespace-v1"


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


def public_hashes(digests: bytes) -> list[int]:
    """The published 64-bit hash of each 32-byte digest (its first 8 bytes, signed)."""
    return [h for (h,) in struct.iter_unpack(">q24x", digests)]


def namespace_seed(extra_key: str | None) -> bytes | None:
    """The "dynamo" format's seed for a namespace: SHA-256 of SGLang's tag, then per part
    (extra_key, then cache_salt, which we do not have) a presence byte and, when present, its
    UTF-8 length (8 bytes, little-endian) and bytes. None in the default namespace."""
    if extra_key is None:
        return None
    encoded = extra_key.encode()
    part = b"\x01" + len(encoded).to_bytes(8, "little") + encoded
    return hashlib.sha256(_NAMESPACE_TAG + part + b"\x00").digest()


def namespaced(hashes: list[int], seed: bytes | None) -> list[int]:
    if seed is None:
        return hashes
    out = []
    for h in hashes:
        digest = hashlib.sha256(seed + h.to_bytes(8, "big", signed=True)).digest()
        out.append(int.from_bytes(digest[:8], "big", signed=True))
    return out


# ---- events, as consumers decode them ----------------------------------------------------
@dataclass(slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None

    def to_wire(self) -> dict[str, Any]:
        return _stored(
            list(self.block_hashes), self.parent_block_hash, list(self.token_ids), self.block_size
        ) | {"lora_id": self.lora_id, "medium": self.medium, "lora_name": self.lora_name}


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU

    def to_wire(self) -> dict[str, Any]:
        return {TAG: "BlockRemoved", "block_hashes": list(self.block_hashes), "medium": self.medium}


@dataclass(slots=True)
class AllBlocksCleared:
    def to_wire(self) -> dict[str, Any]:
        return {TAG: "AllBlocksCleared"}


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
_EVENT_TYPES: dict[str, type] = {
    t.__name__: t for t in (BlockStored, BlockRemoved, AllBlocksCleared)
}


def _stored(hashes: list[int], parent: int | None, tokens: list[int], size: int) -> dict[str, Any]:
    # Key order: SGLang's and vLLM's field order (lora_name is last of the fields we send).
    return {
        TAG: "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": size,
        "lora_id": None,
        "medium": MEDIUM_GPU,
        "lora_name": None,
    }


@dataclass(slots=True)
class KVEventBatch:
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = 0

    def encode(self) -> bytes:
        return _pack(self.ts, _coalesce(e.to_wire() for e in self.events), self.data_parallel_rank)

    @staticmethod
    def decode(payload: bytes) -> KVEventBatch:
        """Read a batch (with or without the rank); keys an event's class does not know are
        ignored and a missing required one is an error, as msgspec does."""
        import msgpack

        ts, raw_events, *rest = msgpack.unpackb(payload, raw=False)
        return KVEventBatch(ts, [_from_wire(w) for w in raw_events], rest[0] if rest else None)


def _from_wire(wire: dict[str, Any]) -> KVEvent:
    if not isinstance(wire, dict):
        raise TypeError(f"a KV event is a tagged map, got {type(wire).__name__}")
    cls = _EVENT_TYPES.get(wire.get(TAG))
    if cls is None:
        raise ValueError(f"unknown KV event tag {wire.get(TAG)!r}")
    return cls(**{f.name: wire[f.name] for f in fields(cls) if f.name in wire})


def _pack(ts: float, events: list[dict[str, Any]], data_parallel_rank: int | None) -> bytes:
    import msgpack

    return msgpack.packb([ts, events, data_parallel_rank], use_bin_type=True)


def _coalesce(wires: Iterator[dict[str, Any]]) -> list[dict[str, Any]]:
    """Merge each event into the one before when it continues it (SGLang's batching): a store
    whose parent is the previous store's last page, or a removal after a removal."""
    out: list[dict[str, Any]] = []
    for w in wires:
        last = out[-1] if out else None
        if last is not None and _continues(last, w):
            last["block_hashes"] += w["block_hashes"]
            if w[TAG] == "BlockStored":
                last["token_ids"] += w["token_ids"]
        else:
            out.append(w)
    return out


def _continues(last: dict[str, Any], w: dict[str, Any]) -> bool:
    if last[TAG] != w[TAG] or w[TAG] == "AllBlocksCleared" or last["medium"] != w["medium"]:
        return False
    if w[TAG] == "BlockRemoved":
        return True
    same = ("block_size", "lora_id", "lora_name")
    return (
        bool(last["block_hashes"])
        and w["parent_block_hash"] == last["block_hashes"][-1]
        and all(last[k] == w[k] for k in same)
    )


# ---- what the tree records ---------------------------------------------------------------
# A record becomes its event's wire map directly, without building the event objects: the
# publisher thread encodes many of them while holding the GIL.
@dataclass(slots=True)
class PagesStored:
    """A new tree node: its pages' digests, the digest of the page before them (None at the
    root), its key (page-aligned; never changed in place by the tree) and the namespace seed
    of its hashes ("dynamo" format; None otherwise)."""

    digests: bytes
    parent: bytes | None
    token_ids: list[int]
    page_size: int
    seed: bytes | None = None

    def wire(self) -> dict[str, Any]:
        parent = None
        if self.parent is not None:
            parent = namespaced(public_hashes(self.parent), self.seed)[0]
        hashes = namespaced(public_hashes(self.digests), self.seed)
        return _stored(
            hashes, parent, self.token_ids[: len(hashes) * self.page_size], self.page_size
        )


@dataclass(slots=True)
class PagesRemoved:
    digests: bytes
    seed: bytes | None = None

    def wire(self) -> dict[str, Any]:
        hashes = namespaced(public_hashes(self.digests), self.seed)
        return {TAG: "BlockRemoved", "block_hashes": hashes, "medium": MEDIUM_GPU}


@dataclass(slots=True)
class Cleared:
    def wire(self) -> dict[str, Any]:
        return {TAG: "AllBlocksCleared"}


Record = PagesStored | PagesRemoved | Cleared


def encode_records(records: list[Record], ts: float, data_parallel_rank: int = 0) -> bytes:
    """One KVEventBatch payload: the same bytes as `KVEventBatch(ts, expand(records)).encode()`."""
    return _pack(ts, _coalesce(r.wire() for r in records), data_parallel_rank)


def expand(records: list[Record]) -> list[KVEvent]:
    """Records -> the events a consumer decodes from them."""
    return [_from_wire(w) for w in _coalesce(r.wire() for r in records)]


@dataclass(slots=True)
class KVEventRecorder:
    """Where a prefix cache appends what it stores and drops; taken once per scheduler step.
    `namespaced`: the "dynamo" format (hashes seeded by the request's extra_key)."""

    namespaced: bool = False
    records: list[Record] = field(default_factory=list)
    _seeds: dict[str, bytes | None] = field(default_factory=dict)

    def _seed(self, extra_key: str | None) -> bytes | None:
        if not self.namespaced or extra_key is None:
            return None
        seed = self._seeds.get(extra_key)
        if seed is None:
            seed = self._seeds[extra_key] = namespace_seed(extra_key)
        return seed

    def stored(
        self,
        digests: bytes,
        parent: bytes | None,
        token_ids: list[int],
        page_size: int,
        extra_key: str | None = None,
    ) -> None:
        self.records.append(
            PagesStored(digests, parent, token_ids, page_size, self._seed(extra_key))
        )

    def removed(self, digests: bytes, extra_key: str | None = None) -> None:
        self.records.append(PagesRemoved(digests, self._seed(extra_key)))

    def cleared(self) -> None:
        self.records.append(Cleared())

    def take(self) -> list[Record]:
        records, self.records = self.records, []
        return records
