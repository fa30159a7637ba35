"""KV memory: `KVManager` (the one owner of KV slots) over request rows, the paged
allocator and a prefix cache; the KV pools the model writes."""

from mem_cache.allocator import TokenToKVPoolAllocator
from mem_cache.base_prefix_cache import BasePrefixCache, MatchResult
from mem_cache.chunk_cache import ChunkCache
from mem_cache.integrity import MemoryLeakError, check_memory_integrity, token_usage
from mem_cache.kv_manager import KVManager, KVSpan, OutOfKVError
from mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from mem_cache.radix_cache import RadixCache, TreeNode

__all__ = [
    "BasePrefixCache",
    "ChunkCache",
    "KVManager",
    "KVSpan",
    "MHATokenToKVPool",
    "MatchResult",
    "MemoryLeakError",
    "OutOfKVError",
    "RadixCache",
    "ReqToTokenPool",
    "TokenToKVPoolAllocator",
    "TreeNode",
    "check_memory_integrity",
    "token_usage",
]
