"""Attention: backend base (plan / run), the backends, and the RadixAttention layer.

The names below are imported from their submodule on first use (`srt.utils.lazy`): the HTTP
server reads the backend names from `registry` without importing torch.
"""

from __future__ import annotations

from srt.utils.lazy import lazy_exports

_SUBMODULE = {
    "AttentionBackend": "attention.base",
    "RadixAttention": "attention.radix_attention",
    "available_attention_backends": "attention.registry",
    "create_attention_backend": "attention.registry",
}

__getattr__ = lazy_exports(__name__, _SUBMODULE)
