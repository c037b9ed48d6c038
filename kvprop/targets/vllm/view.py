"""vLLM's allocator state read in kvprop's terms (``VllmView``), so that kvprop's invariants apply to it unchanged.

vLLM keys a cached block by its own 32-byte chained hash plus the group id; the view reports
(kvprop's hash of the same block, group id), from the pairs the allocator records whenever a
request's block hashes grow (same tokens, same block size, same index). It only reads.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Protocol

from kvprop.allocator.specs import AllocatorConfig
from kvprop.allocator.view import records_holding


class ManagerAdapter(Protocol):
    """What the view reads of the allocator it wraps (``manager.VllmAllocator``)."""

    @property
    def v(self) -> SimpleNamespace: ...
    @property
    def config(self) -> AllocatorConfig: ...
    @property
    def manager(self) -> Any: ...
    @property
    def pool(self) -> Any: ...
    @property
    def block_size(self) -> int: ...
    @property
    def hash_names(self) -> dict: ...
    @property
    def num_evictions(self) -> int: ...


# From this pool size on, blocks are watched rather than compared with a snapshot at every
# check: a watched write costs a Python call in vLLM's every block update. The watch is set
# up at the first look for changes, so a run without checks never pays for it; with checks
# it costs less than the snapshot from the smallest pools on (`kvprop bench vllm`, its
# target rows), so every pool is watched unless a benchmark sets this higher.
WATCH_FROM_BLOCKS = 0


def _block_state(b) -> tuple:
    """What the checker tracks of a vLLM block: its count, its hash, whether it is queued."""
    return b.ref_cnt, b.block_hash, b.prev_free_block is not None or b.next_free_block is not None


def map_block_ids(cache_map, vllm_key) -> tuple:
    """The ids of the blocks vLLM's cache map holds under ``vllm_key``, in either layout.

    Up to 0.33.0 an entry is one block, or a dict of block id -> block when several blocks
    share a key. From 0.34.0 it is one block id (``_cache``, the block hits take), with every
    id of a key held by several in ``_dup_ids`` (kept apart so that the map holds no
    containers for the garbage collector to track). An id in ``_cache`` that is missing from
    ``_dup_ids`` is still listed: hits take it, so the checker must see it."""
    entry = cache_map._cache.get(vllm_key)
    if entry is None:
        return ()
    if isinstance(entry, int):
        several = getattr(cache_map, "_dup_ids", {}).get(vllm_key)
        if several is None:
            return (entry,)
        return tuple(several) if entry in several else (entry, *several)
    return tuple(entry) if isinstance(entry, dict) else (entry.block_id,)


def _watch_blocks(blocks: list) -> dict | None:
    """Makes vLLM's pool blocks note their state (``_block_state``) before vLLM's first write to
    one of their attributes since the last look, in a dict it returns; None if the release's
    block class cannot be watched.

    The blocks become instances of a subclass that adds no field and only notes the state
    before the write, so vLLM's code runs unchanged; the checker then compares the blocks
    that were written with their state before (exactly what a snapshot of the whole pool
    would find changed) instead of the whole pool at every check."""
    if not blocks:
        return None
    base = type(blocks[0])
    before: dict = {}

    def __setattr__(self, name, value):  # noqa: N807 - the hook Python calls
        if self.block_id not in before:
            before[self.block_id] = _block_state(self)
        base.__setattr__(self, name, value)

    watched = type(base.__name__, (base,), {"__slots__": (), "__setattr__": __setattr__})
    try:
        for block in blocks:
            block.__class__ = watched
    except TypeError:
        for block in blocks:
            block.__class__ = base
        return None
    return before


class VllmView:
    """vLLM's allocator state in kvprop's terms (``kvprop.allocator.view.AllocatorView``'s calls).

    Reads only; every dict is read with ``.get`` so that no defaultdict grows an entry.
    vLLM's per-group ``req_to_blocks`` is a defaultdict that gains an empty list when a
    waiting request's refused allocation drops window-skipped blocks (vLLM's scheduler
    later frees it; kvprop's engine frees only admitted requests): an empty list holds no
    block, so it is no table."""

    def __init__(self, allocator: ManagerAdapter):
        self.allocator = allocator
        self.pool = allocator.pool
        self.managers = allocator.manager.coordinator.single_type_managers
        self.queue = self.pool.free_block_queue
        self.kvu = allocator.v.kvu
        self.num_blocks = allocator.config.num_blocks
        self.block_size = allocator.block_size
        self.num_groups = len(self.managers)
        self.null_block_id = self.pool.null_block.block_id
        self._names: dict = {}  # vLLM key -> kvprop key, for keys whose hash is recorded
        self._vllm_keys: dict = {}  # kvprop key -> the vLLM key it was read from
        self._written: dict | None = None  # the watch's record, once take_changes set it up
        self._states: list | None = None  # the snapshot, where blocks are not watched

    def ref_cnt(self, block_id: int) -> int:
        return self.pool.blocks[block_id].ref_cnt

    def ref_cnts(self) -> list[int]:
        return [b.ref_cnt for b in self.pool.blocks]

    def _key(self, vllm_key):
        """(kvprop hash, group) for vLLM's (hash, group) key; an unrecorded hash stays visibly foreign."""
        if vllm_key is None:
            return None
        key = self._names.get(vllm_key)
        if key is None:
            block_hash = self.kvu.get_block_hash(vllm_key)
            name = self.allocator.hash_names.get(block_hash)
            if name is None:
                key = (f"vllm:{block_hash.hex()[:16]}", self.kvu.get_group_id(vllm_key))
            else:
                key = self._names[vllm_key] = (name, self.kvu.get_group_id(vllm_key))
            self._vllm_keys[key] = vllm_key
        return key

    def cache_key(self, block_id: int):
        return self._key(self.pool.blocks[block_id].block_hash)

    def cache_keys(self) -> list:
        return [self._key(b.block_hash) for b in self.pool.blocks]

    def extra_keys(self) -> dict:
        """Block id -> its further keys (vLLM's ``cached_block_hashes_by_block``, 0.24.0 on)."""
        extra = getattr(self.pool, "cached_block_hashes_by_block", {})
        return {b: sorted((self._key(k) for k in keys), key=repr) for b, keys in extra.items() if keys}

    def further_keys(self, block_id: int) -> list:
        extra = getattr(self.pool, "cached_block_hashes_by_block", {}).get(block_id, ())
        return sorted((self._key(k) for k in extra), key=repr)

    def map_holds(self, key, block_id: int) -> bool:
        vllm_key = self._vllm_keys.get(key)
        if vllm_key is None:
            return any(k == key and b == block_id for k, b in self.cache_map_items())
        return self._map_has(vllm_key, block_id)

    def pending_copies(self) -> list[tuple[int, int]]:
        """(source id, copy id) of vLLM's queued block copies (0.30.0 on)."""
        pairs = (pair for manager in self.managers for pair in getattr(manager, "_pending_cow_copies", ()))
        return [(s.block_id, c.block_id) for s, c in pairs]

    @property
    def num_free_blocks(self) -> int:
        return self.queue.num_free_blocks

    def _walk(self, start, step: str, stop, limit: int) -> list[int]:
        """Block ids along the free list's links; stops after ``limit`` so a cycle shows as repeats."""
        out: list[int] = []
        block = start
        while block is not None and block is not stop and len(out) < limit:
            out.append(block.block_id)
            block = getattr(block, step)
        return out

    def free_queue_ids(self) -> list[int]:
        q = self.queue
        return self._walk(
            q.fake_free_list_head.next_free_block, "next_free_block", q.fake_free_list_tail, self.num_blocks + 1
        )

    def free_queue_ids_backward(self) -> list[int]:
        q = self.queue
        return self._walk(
            q.fake_free_list_tail.prev_free_block, "prev_free_block", q.fake_free_list_head, self.num_blocks + 1
        )

    def free_queue_prefix(self, n: int) -> list[int]:
        q = self.queue
        return self._walk(q.fake_free_list_head.next_free_block, "next_free_block", q.fake_free_list_tail, n)

    def cache_map_items(self):
        # The pool replaced its map on reset_prefix_cache before 0.34.0: look it up every time.
        cache_map = self.pool.cached_block_hash_to_block
        for vllm_key in list(cache_map._cache):
            key = self._key(vllm_key)
            for block_id in map_block_ids(cache_map, vllm_key):
                yield key, block_id

    def request_ids(self, group: int):
        return [rid for rid, blocks in list(self.managers[group].req_to_blocks.items()) if blocks]

    def request_block_ids(self, group: int, request_id: str):
        blocks = self.managers[group].req_to_blocks.get(request_id)
        return [b.block_id for b in blocks] if blocks else None

    def records_of(self, request_id: str) -> list[str]:
        """The per-request records any group's manager still keeps for ``request_id``: vLLM's
        ``pop_blocks_for_free`` drops every one (0.34.0 single_type_kv_cache_manager.py)."""
        return records_holding(self.managers, request_id)

    def num_cached_blocks(self, group: int, request_id: str):
        """vLLM records a count only once a request had hits or external tokens, or cached a
        full block; before that a request with a table has cached nothing: 0."""
        manager = self.managers[group]
        count = manager.num_cached_block.get(request_id)
        if count is None and manager.req_to_blocks.get(request_id):
            return 0
        return count

    @property
    def num_evictions(self) -> int:
        return self.allocator.num_evictions

    # ---- what lets the checker verify only what changed ----------------------------------

    def _block_states(self) -> list:
        return [_block_state(b) for b in self.pool.blocks]

    def take_changes(self) -> set[int]:
        """Ids of blocks whose count, hash or free-queue membership changed since the last call.

        vLLM reports no changes, so in a large pool its blocks are watched (``_watch_blocks``);
        in a small one, or where a release's block class cannot be watched, every block is
        compared with the previous call's snapshot (one small tuple per block). As with
        kvprop's own pool, the periodic full sweep walks the whole queue. The first call sets
        the watch or the snapshot up and reports every block: there is nothing to compare with."""
        if self._written is None and self._states is None:
            if self.num_blocks >= WATCH_FROM_BLOCKS:
                self._written = _watch_blocks(self.pool.blocks)
            if self._written is None:
                self._states = self._block_states()
            return set(range(self.num_blocks))
        if self._written is not None:
            blocks = self.pool.blocks
            changed = {i for i, state in self._written.items() if _block_state(blocks[i]) != state}
            self._written.clear()
            return changed
        states = self._block_states()
        changed = {i for i, (old, new) in enumerate(zip(self._states or (), states, strict=True)) if old != new}
        self._states = states
        return changed

    def cache_count(self, key) -> int:
        """How many blocks vLLM's cache map holds under ``key``, a key this view named (the
        event check compares only keys that moved; a key never named counts by a scan)."""
        vllm_key = self._vllm_keys.get(key)
        if vllm_key is None:
            return sum(1 for k, _ in self.cache_map_items() if k == key)
        return len(map_block_ids(self.pool.cached_block_hash_to_block, vllm_key))

    def raw_table(self, group: int, request_id: str):
        """The live table (vLLM's block objects, compared by identity); never mutated."""
        blocks = self.managers[group].req_to_blocks.get(request_id)
        return blocks if blocks else None

    def _map_has(self, vllm_key, block_id: int) -> bool:
        return vllm_key is not None and block_id in map_block_ids(self.pool.cached_block_hash_to_block, vllm_key)

    def block_state(self, block_id: int, old_key):
        """(ref_cnt, key, in free queue, queue links consistent, in the map under key, still in
        the map under ``old_key`` though the key changed), as ``AllocatorView.block_state``."""
        block = self.pool.blocks[block_id]
        prev, nxt, vllm_key = block.prev_free_block, block.next_free_block, block.block_hash
        key = self._key(vllm_key)
        in_queue = prev is not None or nxt is not None
        links_ok = not in_queue or (
            prev is not None and nxt is not None and prev.next_free_block is block and nxt.prev_free_block is block
        )
        in_map = key is not None and self._map_has(vllm_key, block_id)
        stale = old_key is not None and old_key != key and self._map_has(self._vllm_keys.get(old_key), block_id)
        return block.ref_cnt, key, in_queue, links_ok, in_map, stale
