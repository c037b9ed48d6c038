"""A read-only view of an allocator's state, the only way invariants look at a target.

Keeping the checks behind this small surface is what lets the same invariants judge
kvprop's own allocator, its bug variants and an external allocator such as vLLM's.
"""

from __future__ import annotations

from collections.abc import Iterator, KeysView

from kvprop.allocator.block_pool import CacheKey
from kvprop.allocator.kv_cache_manager import KVCacheManager


def records_holding(owners, request_id: str) -> list[str]:
    """``Owner.attribute`` of every dict or set among ``owners``' attributes that still records
    ``request_id``: what a free must drop. Read generically, so that a record a manager adds
    later (a state group's retired count, its checkpoints) is judged without naming it. An
    entry that is an empty list records nothing (vLLM's ``req_to_blocks`` is a defaultdict that
    gains one when a waiting request's refused allocation skips blocks)."""
    found = []
    for owner in owners:
        for name, value in vars(owner).items():
            if isinstance(value, (set, frozenset)) and request_id in value:
                found.append(f"{type(owner).__name__}.{name}")
            elif isinstance(value, dict) and value.get(request_id, []) != []:
                found.append(f"{type(owner).__name__}.{name}")
    return found


class AllocatorView:
    """The view of kvprop's own ``KVCacheManager``."""

    def __init__(self, manager: KVCacheManager):
        self.manager = manager
        self.pool = manager.pool
        self.managers = manager.coordinator.managers
        self.num_blocks = manager.config.num_blocks
        self.block_size = manager.block_size
        self.num_groups = len(self.managers)
        self.null_block_id = manager.pool.null_block.block_id

    def ref_cnt(self, block_id: int) -> int:
        return self.pool.blocks[block_id].ref_cnt

    def ref_cnts(self) -> list[int]:
        return [b.ref_cnt for b in self.pool.blocks]

    def cache_key(self, block_id: int) -> CacheKey | None:
        return self.pool.blocks[block_id].key

    def cache_keys(self) -> list[CacheKey | None]:
        return [b.key for b in self.pool.blocks]

    def extra_keys(self) -> dict[int, list[CacheKey]]:
        """Block id -> its further keys beyond ``cache_key``, for blocks that have any."""
        return {b: sorted(keys, key=repr) for b, keys in self.pool.extra_keys.items() if keys}

    def further_keys(self, block_id: int) -> list[CacheKey]:
        """The keys of ``block_id`` beyond ``cache_key`` (at hash-unit boundaries inside it)."""
        keys = self.pool.extra_keys.get(block_id)
        return sorted(keys, key=repr) if keys else []

    def map_holds(self, key, block_id: int) -> bool:
        return block_id in self.pool.cached.get(key, ())

    def pending_copies(self) -> list[tuple[int, int]]:
        """(source id, copy id) of every block copy queued and not yet taken by the scheduler."""
        return [(s.block_id, c.block_id) for manager in self.managers for s, c in manager.pending_copies]

    @property
    def num_free_blocks(self) -> int:
        return self.pool.free_queue.num_free

    def free_queue_ids(self) -> list[int]:
        return [b.block_id for b in self.pool.free_queue.forward()]

    def free_queue_ids_backward(self) -> list[int]:
        return [b.block_id for b in self.pool.free_queue.backward()]

    def free_queue_prefix(self, n: int) -> list[int]:
        out: list[int] = []
        for block in self.pool.free_queue.forward():
            if len(out) >= n:
                break
            out.append(block.block_id)
        return out

    def has_cache_key(self, key) -> bool:
        """Whether some block is cached under ``key`` (the hit oracle asks this per block)."""
        return bool(self.pool.cached.get(key))

    def cache_map_items(self) -> Iterator[tuple[CacheKey, int]]:
        for key, entry in self.pool.cached.items():
            for block_id in entry:
                yield key, block_id

    def cache_count(self, key) -> int:
        """How many blocks the cache map holds under ``key`` (the event check compares keys that moved)."""
        return len(self.pool.cached.get(key, ()))

    def request_ids(self, group: int) -> KeysView[str]:
        return self.managers[group].req_to_blocks.keys()

    def request_block_ids(self, group: int, request_id: str) -> list[int] | None:
        table = self.managers[group].req_to_blocks.get(request_id)
        return None if table is None else [b.block_id for b in table]

    def num_cached_blocks(self, group: int, request_id: str) -> int | None:
        return self.managers[group].num_cached_block.get(request_id)

    def records_of(self, request_id: str) -> list[str]:
        """The per-request records any group's manager still keeps for ``request_id``."""
        return records_holding(self.managers, request_id)

    @property
    def num_evictions(self) -> int:
        return self.pool.num_evictions

    # ---- what lets a checker verify only what changed ------------------------------------

    def take_changes(self) -> set[int]:
        """Ids of blocks whose count, hash or queue links changed since the last call."""
        changed = set(self.pool.changed)
        self.pool.changed.clear()
        return changed

    def raw_table(self, group: int, request_id: str):
        """The live table (block objects, compared by identity); never mutate it."""
        return self.managers[group].req_to_blocks.get(request_id)

    def raw_tables(self, group: int):
        """(request id, live table) of every request of ``group``; never mutate them."""
        return list(self.managers[group].req_to_blocks.items())

    def block_state(self, block_id: int, old_key):
        """(ref_cnt, key, in free queue, queue links consistent, in the map under key, still in
        the map under ``old_key`` though the key changed) in one call, for the incremental checker."""
        block = self.pool.blocks[block_id]
        prev, nxt, key = block.prev, block.next, block.key
        in_queue = prev is not None or nxt is not None
        links_ok = not in_queue or (prev is not None and nxt is not None and prev.next is block and nxt.prev is block)
        cached = self.pool.cached
        in_map = key is not None and block_id in cached.get(key, ())
        stale = old_key is not None and old_key != key and block_id in cached.get(old_key, ())
        return block.ref_cnt, key, in_queue, links_ok, in_map, stale
