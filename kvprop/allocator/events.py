"""KV cache events: the stream that tells routers outside the engine what the cache holds.

vLLM publishes them when ``enable_kv_cache_events`` is on (``vllm/distributed/kv_events.py``;
the block pool queues them, ``KVCacheManager.take_events`` drains them): a stored event for
a hash a caching call adds, a removed event for a hash that leaves (eviction,
``evict_blocks``), and all-cleared after a successful ``reset_prefix_cache``; for requests
asking for the full report, a lookup's hit is announced again. A router that replays them
must end with the cache map's keys, so the events here name keys in kvprop's terms, (block
hash, group); a target's adapter translates its own.

Each stored or removed event names the medium that holds the key (vLLM's ``medium`` field:
``"GPU"`` for the block pool, ``"CPU"`` for the offloading connector's CPU tier, which the
scheduler publishes beside the pool's events). All-cleared names none, as in vLLM.
"""

from __future__ import annotations

import attrs

GPU = "GPU"  # vLLM's MEDIUM_GPU: the block pool
CPU = "CPU"  # vLLM's MEDIUM_CPU: an offloading connector's CPU tier


@attrs.frozen
class Stored:
    key: tuple  # (block hash, group)
    medium: str = GPU


@attrs.frozen
class Removed:
    key: tuple
    medium: str = GPU


@attrs.frozen
class Reannounced:
    """A stored event for a key a hit reuses, sent again, the cache unchanged, for a request
    that asked for the full report (vLLM's ``emit_cached_block_events``, 0.30.0 on): a
    gateway learns from it which prefixes each request found. vLLM's event does not tell it
    from a store; kvprop's adapters mark what the lookup sent."""

    key: tuple
    medium: str = GPU


@attrs.frozen
class Cleared:
    pass
