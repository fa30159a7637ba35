"""`--kv-events-config`: the JSON that turns KV-cache events on (kv_events.py and
kv_event_publisher.py).

The keys are vLLM's and SGLang's, so a router's existing config works here unchanged. Unknown
keys and bad values are refused when the command line is parsed, before the model loads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

FORMATS = ("default", "dynamo")


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """Giving a config turns publishing on unless it says `"publisher": "null"` or
    `"enable_kv_cache_events": false` (SGLang's own default publisher is "null": we take a
    config as the wish to publish). With `bind` unset, an endpoint with `*`, `::`, `0.0.0.0`,
    `ipc://` or `inproc://` is bound, any other is connected to (the consumer binds); the
    replay endpoint is always bound."""

    publisher: str = "zmq"  # "zmq" | "null"
    endpoint: str = "tcp://*:5557"  # PUB: [topic, seq (8 bytes, big-endian), payload]
    replay_endpoint: str | None = None  # ROUTER: send a start seq, get every batch since
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # PUB high-water mark (ZMQ drops for a subscriber past it)
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""
    bind: bool | None = None  # SGLang's: force bind (true) or connect (false) of the PUB socket
    # SGLang's: "dynamo" namespaces the published hashes by the request's extra_key
    # (kv_events.namespace_seed); "default" publishes the plain token chain, as SGLang does.
    format: str = "default"
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
        if config.format not in FORMATS:
            raise ValueError(
                f"--kv-events-config: format must be one of {', '.join(map(repr, FORMATS))}, "
                f"got {config.format!r}"
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
    elif key == "bind":
        ok, expected = value is None or isinstance(value, bool), "true, false or null"
    elif key == "replay_endpoint":
        ok, expected = value is None or isinstance(value, str), "a string or null"
    else:
        ok, expected = isinstance(value, str), "a string"
    if not ok:
        raise ValueError(f"--kv-events-config: {key} must be {expected}, got {value!r}")
