"""Transfer backends by name, imported lazily (mooncake and nixl are optional packages)."""

from __future__ import annotations

import importlib

from disagg.transfer.base import TransferBackend

TRANSFER_BACKENDS = {
    "loopback": ("disagg.transfer.loopback", "LoopbackTransfer"),
    "mooncake": ("disagg.transfer.mooncake", "MooncakeTransfer"),
    "nixl": ("disagg.transfer.nixl", "NixlTransfer"),
}


def create_transfer_backend(name: str, kv: object, host: str) -> TransferBackend:
    module_name, class_name = TRANSFER_BACKENDS[name]
    return getattr(importlib.import_module(module_name), class_name)(kv, host)
