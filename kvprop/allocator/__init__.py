"""The reference allocator, and nothing else.

Specs and configuration, chained block hashes, the block pool with its free queue and
prefix-cache map, the per-attention-type managers, the coordinators, the manager facade
(``kv_cache_manager.KVCacheManager``, shaped like vLLM's) and the read-only view of this allocator
that the checks read. It may import only ``kvprop.errors`` and itself: no engine, no
check, no driver, no torch.
"""
