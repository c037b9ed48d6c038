"""KV cache events: the stream that tells routers outside the engine what the cache holds.

vLLM publishes them when ``enable_kv_cache_events`` is on (``vllm/distributed/kv_events.py``;
the block pool queues them, ``KVCacheManager.take_events`` drains them): a stored event for
every hash a caching call adds, a removed event for every hash that leaves (eviction,
``evict_blocks``), and all-cleared after a successful ``reset_prefix_cache``. A router that
replays them must end with the cache map's keys, so the events here name keys in kvprop's
terms, (block hash, group); a target's adapter translates its own.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class Stored:
    key: tuple  # (block hash, group)


@attrs.frozen
class Removed:
    key: tuple


@attrs.frozen
class Cleared:
    pass
