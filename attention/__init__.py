"""Attention: backend base (plan / run), the backends, and the RadixAttention layer."""

from __future__ import annotations

from attention.base import AttentionBackend
from attention.radix_attention import RadixAttention
from attention.registry import available_attention_backends, create_attention_backend

__all__ = [
    "AttentionBackend",
    "RadixAttention",
    "available_attention_backends",
    "create_attention_backend",
]
