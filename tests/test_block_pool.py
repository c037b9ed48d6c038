"""Free queue and block pool: eviction order, touch, free order, caching, reset."""

from __future__ import annotations

import pytest

from kvprop.allocator.block_pool import Block, BlockPool, FreeBlockQueue
from kvprop.errors import AllocatorError


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def fq(pool: BlockPool) -> list[int]:
    return ids(pool.free_queue.forward())


# ---- free queue -------------------------------------------------------------------------


def make_queue(n=4):
    blocks = [Block(i) for i in range(1, n + 1)]
    return FreeBlockQueue(blocks), blocks


def assert_links(q: FreeBlockQueue) -> None:
    assert ids(q.forward()) == ids(q.backward())[::-1]
    assert len(q) == q.num_free == len(list(q.forward()))


def test_queue_starts_in_given_order():
    """The initial order is the eviction order: head first."""
    q, _ = make_queue(4)
    assert ids(q.forward()) == [1, 2, 3, 4]
    assert_links(q)


def test_append_goes_to_tail_appendleft_to_head():
    """append joins at the tail (evicted last), appendleft at the head (evicted first)."""
    q, _ = make_queue(0)
    a, b, c = Block(1), Block(2), Block(3)
    q.append(a)
    q.append(b)
    q.appendleft(c)
    assert ids(q.forward()) == [3, 1, 2]
    assert len(q) == 3
    assert_links(q)


def test_popleft_takes_the_head():
    """Pops take the head, one at a time, and unlink the block."""
    q, blocks = make_queue(3)
    popped = q.popleft()
    assert popped is blocks[0]
    assert popped.prev is None and popped.next is None
    assert ids(q.forward()) == [2, 3]
    assert len(q) == 2
    assert_links(q)


def test_remove_from_the_middle_is_o1_and_keeps_links():
    """Removing a block anywhere (a hit on a free cached block) leaves a consistent list."""
    q, blocks = make_queue(5)
    q.remove(blocks[2])
    q.remove(blocks[0])
    q.remove(blocks[4])
    assert ids(q.forward()) == [2, 4]
    assert len(q) == 2
    assert_links(q)


def test_popleft_on_empty_queue_raises():
    """An empty queue refuses a pop rather than returning a sentinel."""
    q, _ = make_queue(1)
    q.popleft()
    with pytest.raises(AllocatorError, match="empty free queue"):
        q.popleft()
    assert len(q) == 0


def test_double_insert_is_refused():
    """A block already linked cannot be inserted again (no repeats in the queue)."""
    q, blocks = make_queue(2)
    with pytest.raises(AllocatorError, match="block 1 is already in the free queue"):
        q.append(blocks[0])
    with pytest.raises(AllocatorError, match="block 2 is already in the free queue"):
        q.appendleft(blocks[1])
    assert ids(q.forward()) == [1, 2]
    assert len(q) == 2


def test_double_remove_is_refused():
    """Removing a block that is not linked is an error, and the count does not drift."""
    q, blocks = make_queue(2)
    q.remove(blocks[0])
    with pytest.raises(AllocatorError, match="block 1 is not in the free queue"):
        q.remove(blocks[0])
    assert len(q) == 1
    assert_links(q)


def test_mixed_operations_keep_forward_equal_to_reversed_backward():
    """After any mix of operations the two walks agree and the count is the length."""
    q, blocks = make_queue(6)
    q.remove(blocks[3])
    q.appendleft(blocks[3])
    q.popleft()
    q.remove(blocks[5])
    q.append(blocks[5])
    q.remove(blocks[1])
    assert ids(q.forward()) == [1, 3, 5, 6]
    assert_links(q)


# ---- block pool -------------------------------------------------------------------------


def test_new_pool_excludes_the_null_block():
    """Block 0 is the null block: never in the free queue; usable capacity is n - 1."""
    pool = BlockPool(5)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert fq(pool) == [1, 2, 3, 4]
    assert pool.num_free_blocks == 4


def test_get_new_blocks_pops_from_head_with_ref_cnt_one():
    """get_new_blocks takes the head of the queue and sets ref_cnt = 1."""
    pool = BlockPool(5)
    got = pool.get_new_blocks(2)
    assert ids(got) == [1, 2]
    assert [b.ref_cnt for b in got] == [1, 1]
    assert fq(pool) == [3, 4]


def test_get_new_blocks_never_partial():
    """Asking for more than is free is an error and takes nothing."""
    pool = BlockPool(4)
    with pytest.raises(AllocatorError, match=r"get_new_blocks\(4\) with only 3 free blocks"):
        pool.get_new_blocks(4)
    assert fq(pool) == [1, 2, 3]
    assert all(b.ref_cnt == 0 for b in pool.blocks)


def test_get_new_blocks_evicts_a_cached_block_and_clears_its_hash():
    """Popping a free cached block evicts it: out of the map, hash cleared, counted."""
    pool = BlockPool(3)
    b1, _ = pool.get_new_blocks(2)
    pool.cache_block(b1, 111, 0)
    pool.free_blocks([b1])
    assert fq(pool) == [1] and pool.get_cached_block(111, 0) is b1
    (again,) = pool.get_new_blocks(1)
    assert again is b1
    assert b1.key is None
    assert pool.get_cached_block(111, 0) is None
    assert (111, 0) not in pool.cached
    assert pool.num_evictions == 1


def test_touch_removes_a_free_cached_block_from_the_queue():
    """A hit on a free block takes it out of the queue and gives it ref_cnt 1; a hit on a
    used block only adds a reference."""
    pool = BlockPool(4)
    b1, b2 = pool.get_new_blocks(2)
    pool.cache_block(b1, 7, 0)
    pool.free_blocks([b1])
    assert fq(pool) == [3, 1]
    pool.touch([b1, b2])
    assert fq(pool) == [3]
    assert (b1.ref_cnt, b2.ref_cnt) == (1, 2)
    assert b1.key == (7, 0)


def test_touch_skips_the_null_block():
    """The null block's ref_cnt is never touched."""
    pool = BlockPool(3)
    pool.touch([pool.null_block, pool.null_block])
    assert pool.null_block.ref_cnt == 0
    assert fq(pool) == [1, 2]


def test_free_order_hashless_to_head_hashed_to_tail():
    """Freed hashless blocks go to the head in the order freed; hashed ones to the tail."""
    pool = BlockPool(8)
    blocks = pool.get_new_blocks(4)  # 1..4; queue [5, 6, 7]
    pool.cache_block(blocks[0], 10, 0)
    pool.cache_block(blocks[1], 11, 0)
    pool.free_blocks(reversed(blocks))  # 4, 3 (hashless), 2, 1 (hashed)
    assert fq(pool) == [4, 3, 5, 6, 7, 2, 1]


def test_a_later_free_puts_its_hashless_blocks_before_earlier_ones():
    """Each free call inserts at the head anew: the most recently freed hashless block is reused first."""
    pool = BlockPool(5)
    a, b, c = pool.get_new_blocks(3)
    pool.free_blocks([a])
    pool.free_blocks([c, b])
    assert fq(pool) == [3, 2, 1, 4]


def test_free_of_a_shared_block_only_drops_a_reference():
    """A block reaches the queue only when its last reference is freed."""
    pool = BlockPool(3)
    (b,) = pool.get_new_blocks(1)
    pool.touch([b])
    pool.free_blocks([b])
    assert b.ref_cnt == 1 and fq(pool) == [2]
    pool.free_blocks([b])
    assert b.ref_cnt == 0 and fq(pool) == [1, 2]


def test_free_of_a_free_block_is_refused():
    """ref_cnt never goes below zero."""
    pool = BlockPool(3)
    with pytest.raises(AllocatorError, match="free of block 1 with ref_cnt 0"):
        pool.free_blocks([pool.blocks[1]])
    assert pool.blocks[1].ref_cnt == 0


def test_free_skips_the_null_block():
    """The null block is never freed into the queue."""
    pool = BlockPool(3)
    pool.free_blocks([pool.null_block])
    assert fq(pool) == [1, 2]
    assert pool.null_block.ref_cnt == 0


def test_null_block_is_never_cached():
    """Caching the null block is refused."""
    pool = BlockPool(3)
    with pytest.raises(AllocatorError, match="null block is never cached"):
        pool.cache_block(pool.null_block, 5, 0)
    assert pool.cached == {}
    assert pool.null_block.key is None


def test_a_block_has_one_identity():
    """A cached block cannot be cached again under another key."""
    pool = BlockPool(3)
    (b,) = pool.get_new_blocks(1)
    pool.cache_block(b, 5, 0)
    with pytest.raises(AllocatorError, match="already cached"):
        pool.cache_block(b, 6, 1)
    assert b.key == (5, 0)
    assert list(pool.cached) == [(5, 0)]


def test_cache_key_includes_the_group():
    """The same hash in two groups is two cache entries."""
    pool = BlockPool(4)
    b1, b2 = pool.get_new_blocks(2)
    pool.cache_block(b1, 9, 0)
    pool.cache_block(b2, 9, 1)
    assert pool.get_cached_block(9, 0) is b1
    assert pool.get_cached_block(9, 1) is b2
    assert pool.get_cached_block(9, 2) is None


def test_several_blocks_under_one_key():
    """Two blocks may carry one key; evicting one leaves the other a valid hit."""
    pool = BlockPool(4)
    b1, b2 = pool.get_new_blocks(2)
    pool.cache_block(b1, 42, 0)
    pool.cache_block(b2, 42, 0)
    assert set(pool.cached[(42, 0)]) == {1, 2}
    pool.free_blocks([b1])
    pool.get_new_blocks(2)  # pops 3, then evicts 1
    assert b1.key is None
    assert pool.get_cached_block(42, 0) is b2
    assert list(pool.cached[(42, 0)]) == [2]


def test_reset_prefix_cache_refused_while_a_block_is_in_use():
    """reset_prefix_cache fails while anything but the null block is in use, and changes nothing."""
    pool = BlockPool(4)
    b1, _ = pool.get_new_blocks(2)
    pool.cache_block(b1, 1, 0)
    pool.free_blocks([b1])
    assert pool.reset_prefix_cache() is False
    assert b1.key == (1, 0)
    assert pool.get_cached_block(1, 0) is b1


def test_reset_prefix_cache_clears_every_hash_when_idle():
    """With nothing in use, reset clears every hash and the map; the queue is untouched."""
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    for i, b in enumerate(blocks):
        pool.cache_block(b, 100 + i, i % 2)
    pool.free_blocks(reversed(blocks))
    before = fq(pool)
    assert pool.reset_prefix_cache() is True
    assert pool.cached == {}
    assert all(b.key is None for b in pool.blocks)
    assert fq(pool) == before
