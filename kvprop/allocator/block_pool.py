"""Blocks, the intrusive free queue and the prefix-cache map.

The free queue is a doubly linked list threaded through the blocks themselves, so a
cached block touched by a hit leaves the queue in O(1) wherever it sits. Eviction order
is the queue order: pops take the head.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import attrs

from kvprop.allocator import guards
from kvprop.allocator.events import Cleared, Removed, Stored
from kvprop.errors import AllocatorError

CacheKey = tuple  # (block hash, group id)


@attrs.define(slots=True, eq=False)
class Block:
    """A physical block. ``key`` is its (hash, group) while it is cached, else None;
    ``key_tokens`` the length of the prefix the key names (a block's own length, or less for
    a key at a hash-unit boundary inside it)."""

    block_id: int
    ref_cnt: int = 0
    key: CacheKey | None = None
    key_tokens: int | None = None
    prev: Block | None = attrs.field(default=None, repr=False)
    next: Block | None = attrs.field(default=None, repr=False)
    is_null: bool = False


class FreeBlockQueue:
    """Doubly linked list of free blocks between two sentinels, head = next to be evicted.

    The links of a queued block and the sentinels' inner links are never None; the asserts
    below state that for the type checker. Unguarded (``guards.ENABLED = False``), a block
    that is not in the queue fails at them, a target crash as it would be on the None.
    """

    def __init__(self, blocks: Iterable[Block], changed: set | None = None):
        self.changed = changed if changed is not None else set()
        self.head = Block(-1)
        self.tail = Block(-2)
        self.head.next, self.tail.prev = self.tail, self.head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free

    def popleft(self) -> Block:
        block = self.head.next
        assert block is not None  # the head links to the first free block or to the tail
        if guards.ENABLED and block is self.tail:
            raise AllocatorError("popleft from an empty free queue")
        self.remove(block)
        return block

    def remove(self, block: Block) -> None:
        if guards.ENABLED and (block.prev is None or block.next is None):
            raise AllocatorError(f"block {block.block_id} is not in the free queue")
        prev, nxt = block.prev, block.next
        assert prev is not None and nxt is not None  # a queued block sits between two links
        prev.next = nxt
        nxt.prev = prev
        block.prev = block.next = None
        self.num_free -= 1
        self.changed.add(block.block_id)

    def insert_after(self, anchor: Block, block: Block) -> None:
        if guards.ENABLED and (block.prev is not None or block.next is not None):
            raise AllocatorError(f"block {block.block_id} is already in the free queue")
        after = anchor.next
        assert after is not None  # the anchor is the head or a queued block: a block follows it
        block.prev, block.next = anchor, after
        after.prev = block
        anchor.next = block
        self.num_free += 1
        self.changed.add(block.block_id)

    def append(self, block: Block) -> None:
        last = self.tail.prev
        assert last is not None  # the tail follows the last free block or the head
        self.insert_after(last, block)

    def appendleft(self, block: Block) -> None:
        self.insert_after(self.head, block)

    def forward(self) -> Iterator[Block]:
        block = self.head.next
        while block is not self.tail and block is not None:
            yield block
            block = block.next

    def backward(self) -> Iterator[Block]:
        block = self.tail.prev
        while block is not self.head and block is not None:
            yield block
            block = block.prev


class BlockPool:
    """All physical blocks of all groups, the free queue and the cache map.

    The cache map holds several blocks under one key: two requests can compute the same
    prefix before either is cached, and both results stay valid hits.

    A block may be cached under several keys (``extra_keys``, vLLM's
    ``cached_block_hashes_by_block``): a key at a hash-unit boundary inside it, added while it
    already had one. ``key`` is the first; eviction, promotion and reset drop them all.

    ``changed`` collects the ids of blocks whose count, hash or queue links changed; the
    checker takes it to verify only what moved (the pool never reads it). ``events`` queues
    the KV cache events (``kvprop.allocator.events``) when they are enabled, else is None:
    a key is announced stored when it enters the map and removed when its last block leaves
    it, so that a router keeping a set of keys holds the map's keys (docs/design.md §4,
    invariant 17); vLLM announces every block (variant ``announces-every-copy``).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True, enable_events: bool = False):
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        self.changed: set[int] = set()
        self.free_queue = FreeBlockQueue(self.blocks[1:], self.changed)
        self.cached: dict[CacheKey, dict[int, Block]] = {}
        self.extra_keys: dict[int, set[CacheKey]] = {}
        self.num_evictions = 0
        self.events: list | None = [] if enable_events else None

    def take_events(self) -> list:
        events, self.events = self.events, ([] if self.events is not None else None)
        return events or []

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def get_cached_block(self, block_hash: int, group_id: int) -> Block | None:
        entry = self.cached.get((block_hash, group_id))
        if not entry:
            return None
        return next(iter(entry.values()))

    def get_new_blocks(self, n: int) -> list[Block]:
        if guards.ENABLED and n > self.free_queue.num_free:
            raise AllocatorError(f"get_new_blocks({n}) with only {self.free_queue.num_free} free blocks")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if guards.ENABLED and block.ref_cnt != 0:
                raise AllocatorError(f"block {block.block_id} was in the free queue with ref_cnt {block.ref_cnt}")
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        self.changed.update(b.block_id for b in out)
        return out

    def _evict(self, block: Block) -> None:
        if self.drop_keys(block):
            self.num_evictions += 1

    def drop_keys(self, block: Block) -> bool:
        """Uncache ``block``, announcing each key it loses; False if it had none (vLLM's
        ``_maybe_evict_cached_block``)."""
        if block.key is None:
            return False
        self._announce_removed(self._remove_keys(block))
        return True

    def keys_of(self, block: Block) -> list[CacheKey]:
        """Every key ``block`` is cached under, its first key first."""
        extra = self.extra_keys.get(block.block_id)
        if block.key is None:
            return []
        return [block.key, *sorted(extra, key=repr)] if extra else [block.key]

    def _remove_keys(self, block: Block) -> list[CacheKey]:
        """Drop every key of ``block`` from the map; the keys that were there."""
        removed = []
        for key in [block.key, *self.extra_keys.pop(block.block_id, ())] if block.key is not None else ():
            entry = self.cached.get(key)
            if entry is not None and entry.pop(block.block_id, None) is not None:
                removed.append(key)
                if not entry:
                    del self.cached[key]
        block.key = block.key_tokens = None
        self.changed.add(block.block_id)
        return removed

    def _announce_removed(self, keys) -> None:
        """Announce each of ``keys``, just dropped from a block, that no block holds any more."""
        if self.events is not None:
            self.events.extend(Removed(key) for key in keys if key not in self.cached)

    def _announce_stored(self, key: CacheKey, fresh: bool) -> None:
        """Announce ``key``, just given to a block, if it is ``fresh``: no block held it before."""
        if self.events is not None and fresh:
            self.events.append(Stored(key))

    def _insert(self, key: CacheKey, block: Block, num_tokens: int | None) -> bool:
        """Cache ``block`` under ``key``; False if it already was. ``num_tokens`` becomes its
        ``key_tokens`` when this is its first key (None where the caller does not say)."""
        entry = self.cached.setdefault(key, {})
        if block.key == key or block.block_id in entry:
            return False
        if block.key is None:
            block.key, block.key_tokens = key, num_tokens
        else:
            self.extra_keys.setdefault(block.block_id, set()).add(key)
        entry[block.block_id] = block
        self.changed.add(block.block_id)
        return True

    def touch(self, blocks: Iterable[Block]) -> None:
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1
            self.changed.add(block.block_id)

    def free_blocks(self, ordered: Iterable[Block]) -> None:
        """Release one reference each; blocks reaching 0 join the queue.

        Hashless blocks go to the head (nothing can hit them, reuse them first); cached
        ones go to the tail so hits survive as long as possible. Callers pass a request's
        blocks in reverse so its chain tail is evicted before its prefix.
        """
        anchor = self.free_queue.head
        for block in ordered:
            if block.is_null:
                continue
            if guards.ENABLED and block.ref_cnt <= 0:
                raise AllocatorError(f"free of block {block.block_id} with ref_cnt {block.ref_cnt}")
            block.ref_cnt -= 1
            self.changed.add(block.block_id)
            if block.ref_cnt == 0:
                if block.key is None:
                    self.free_queue.insert_after(anchor, block)
                    anchor = block
                else:
                    self.free_queue.append(block)

    def cache_block(self, block: Block, block_hash: int, group_id: int, num_tokens: int | None = None) -> None:
        """Cache a full block under the key of its ``num_tokens``-token prefix. A block cached
        only at a boundary inside it is promoted: its shorter keys are dropped first."""
        if guards.ENABLED and block.is_null:
            raise AllocatorError("the null block is never cached")
        if block.key is not None:
            if guards.ENABLED and (block.key_tokens is None or num_tokens is None or block.key_tokens >= num_tokens):
                raise AllocatorError(
                    f"block {block.block_id} is already cached as {block.key}; caching it again as "
                    f"{(block_hash, group_id)} would give it two identities"
                )
            self._announce_removed(self._remove_keys(block))
        key = (block_hash, group_id)
        fresh = not self.cached.get(key)
        self._insert(key, block, num_tokens)
        self._announce_stored(key, fresh)

    def cache_partial(self, block: Block, unit_hash: int, group_id: int, num_tokens: int, replace: bool = False):
        """Key ``block`` at a hash-unit boundary inside it, ``num_tokens`` into the prefix (vLLM's
        ``BlockPool.cache_partial_block``, 0.30.0 on). A block without a key takes it as its
        key; one with a shorter key loses that first; one with a key as long or longer keeps
        it and gains this one. ``replace``: the block's contents were replaced, drop every key.
        Returns the key, or None for the null block."""
        if block.is_null:
            return None
        key = (unit_hash, group_id)
        cached = block.key == key or block.block_id in self.cached.get(key, ())
        if replace:
            self._announce_removed(self._remove_keys(block))
            cached = False
        elif not cached and block.key is not None and block.key_tokens is not None and block.key_tokens < num_tokens:
            self._announce_removed(self._remove_keys(block))
        fresh = not self.cached.get(key)
        self._insert(key, block, num_tokens)
        if not cached:
            self._announce_stored(key, fresh)
        return key

    def move_keys(self, source: Block, dest: Block) -> None:
        """Re-point every key of ``source`` to ``dest``, announcing nothing: a request keeps
        writing ``source`` while ``dest`` receives a copy of what the keys promise (vLLM's
        ``move_block_hashes``)."""
        if guards.ENABLED and (dest.key is not None or dest.block_id in self.extra_keys):
            raise AllocatorError(f"move_keys onto block {dest.block_id}, which is cached already")
        num_tokens = source.key_tokens
        for key in self._remove_keys(source):
            self._insert(key, dest, num_tokens)

    def reset_prefix_cache(self) -> bool:
        """Forget every hash; only allowed while no block but the null block is in use."""
        if self.free_queue.num_free != self.num_blocks - 1:
            return False
        for block in self.blocks:
            block.key = block.key_tokens = None
        self.cached.clear()
        self.extra_keys.clear()
        self.changed.update(range(self.num_blocks))
        if self.events is not None:
            self.events.append(Cleared())
        return True
