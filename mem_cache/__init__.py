"""KV memory: request rows, KV pools, the paged allocator, and prefix caches."""

from mem_cache.allocator import TokenToKVPoolAllocator
from mem_cache.base_prefix_cache import BasePrefixCache, MatchResult
from mem_cache.chunk_cache import ChunkCache
from mem_cache.integrity import MemoryLeakError, check_memory_integrity, token_usage
from mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from mem_cache.radix_cache import RadixCache, TreeNode

__all__ = [
    "BasePrefixCache",
    "ChunkCache",
    "MHATokenToKVPool",
    "MatchResult",
    "MemoryLeakError",
    "RadixCache",
    "ReqToTokenPool",
    "TokenToKVPoolAllocator",
    "TreeNode",
    "check_memory_integrity",
    "token_usage",
]
