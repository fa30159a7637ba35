"""Prefix caches by name, imported lazily.

"radix" shares prompt prefixes between requests through the radix tree (the default);
"chunk" shares nothing (`--disable-radix-cache`). Both are `BasePrefixCache`s: the caller
builds the one it names with the arguments that cache's constructor takes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from srt.utils.registry import Registry

if TYPE_CHECKING:
    from mem_cache.base_prefix_cache import BasePrefixCache

PREFIX_CACHES: Registry[BasePrefixCache] = Registry("prefix cache")
PREFIX_CACHES.register("radix", "mem_cache.radix_cache:RadixCache")
PREFIX_CACHES.register("chunk", "mem_cache.chunk_cache:ChunkCache")
