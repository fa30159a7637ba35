"""KV memory: `KVManager` (`kv_manager`, the one owner of KV slots) over request rows, the paged
allocator (`allocator`) and a prefix cache (`radix_cache`, `chunk_cache`, by name in
`registry`); the KV pools the model writes (`memory_pool`). Import the submodule you need: the
HTTP server reads the eviction-policy names without importing torch."""
