"""Transfer backends by name, imported lazily (mooncake and nixl are optional packages)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from srt.utils.registry import Registry

if TYPE_CHECKING:
    from disagg.base import KVArgs
    from disagg.transfer.base import TransferBackend

_DISAGG_EXTRA = "pip install 'radixrt[disagg]'"

TRANSFER_BACKENDS: Registry[TransferBackend] = Registry("transfer backend")
TRANSFER_BACKENDS.register(
    "mooncake", "disagg.transfer.mooncake:MooncakeTransfer", requires="mooncake", hint=_DISAGG_EXTRA
)
TRANSFER_BACKENDS.register(
    "nixl", "disagg.transfer.nixl:NixlTransfer", requires="nixl", hint=_DISAGG_EXTRA
)
TRANSFER_BACKENDS.register("loopback", "disagg.transfer.loopback:LoopbackTransfer")


def create_transfer_backend(name: str, kv: KVArgs, host: str) -> TransferBackend:
    return TRANSFER_BACKENDS.create(name, kv, host)
