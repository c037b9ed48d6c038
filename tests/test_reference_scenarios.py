"""Every exact case of docs/reference-scenarios.md, with its block ids and queue orders.

Block ids start at 1; NULL (0) is the doc's "-". The broader unit cases around each rule
live in test_managers.py and test_coordinator.py.
"""

from __future__ import annotations

import pytest
from helpers import BUGGY, NULL, allocator, hit_ids, prefill, queue, refs, req

from kvprop.allocator.block_pool import BlockPool
from kvprop.allocator.group_managers import FullAttentionManager, SlidingWindowManager
from kvprop.allocator.specs import ChunkedLocal, FullAttention, SlidingWindow

# ---- full attention, 11 blocks, block size 16 (10 usable) --------------------------------

BS16 = 16
COMMON48 = [i for i in range(3) for _ in range(BS16)]  # three full blocks


@pytest.fixture
def full11():
    """Steps 1-2: A = 3 full blocks + 7 tokens, B = the same 3 blocks + a different tail."""
    mgr = allocator([FullAttention(BS16)], 11)
    a = req("A", COMMON48 + [3] * 7, BS16)
    prefill(mgr, a)
    b = req("B", COMMON48 + [4] * 5, BS16)
    hits, num_hit, new = prefill(mgr, b)
    return mgr, a, b, hits, num_hit, new


def test_full_step1_first_request_takes_four_blocks_caches_three(full11):
    """A (3 full + a partial block) gets [1,2,3,4]; the 3 full ones are cached, the partial one not."""
    mgr, a, *_ = full11
    assert mgr.get_block_ids("A") == ([1, 2, 3, 4],)
    assert [mgr.pool.blocks[i].key for i in (1, 2, 3)] == [(h, 0) for h in a.block_hashes]
    assert mgr.pool.blocks[4].key is None


def test_full_step2_shared_prefix_hits_and_takes_one_new_block(full11):
    """B hits [1,2,3] (ref_cnt 2 each) and takes new block [5]."""
    mgr, _, _, hits, num_hit, new = full11
    assert hit_ids(hits) == ([1, 2, 3],) and num_hit == 3 * BS16
    assert [[x.block_id for x in g] for g in new] == [[5]]
    assert refs(mgr, [1, 2, 3]) == [2, 2, 2]
    assert mgr.get_block_ids("B") == ([1, 2, 3, 5],)


def test_full_step3_free_order(full11):
    """Free A then B: hashless blocks to the head, hashed to the tail, each request in
    reverse -> [5,4,6,7,8,9,10,3,2,1]."""
    mgr, a, b, *_ = full11
    mgr.free(a)
    mgr.free(b)
    assert queue(mgr) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    assert mgr.num_free_blocks == 10


def test_full_step4_and_5_rehit_then_evict_in_queue_order(full11):
    """A third request re-hits [1,2,3] and takes one new block (5, the head); after it is
    freed a 10-block request with no hit takes the whole queue in order, the cached blocks
    last, evicting (un-hashing) them."""
    mgr, a, b, *_ = full11
    mgr.free(a)
    mgr.free(b)
    c = req("C", COMMON48 + [3] * 6, BS16)
    hits, num_hit, new = prefill(mgr, c)
    assert hit_ids(hits) == ([1, 2, 3],) and num_hit == 3 * BS16
    assert [[x.block_id for x in g] for g in new] == [[5]]
    assert mgr.get_block_ids("C") == ([1, 2, 3, 5],)

    mgr.free(c)
    assert queue(mgr) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    d = req("D", [99] * (10 * BS16), BS16)
    hits, num_hit, _ = prefill(mgr, d, delay_cache_blocks=True)
    assert hit_ids(hits) == ([],) and num_hit == 0
    assert mgr.get_block_ids("D") == ([5, 4, 6, 7, 8, 9, 10, 3, 2, 1],)
    assert mgr.pool.num_evictions == 3
    assert all(mgr.pool.blocks[i].key is None for i in (1, 2, 3))
    assert mgr.get_computed_blocks(req("E", COMMON48 + [3], BS16))[1] == 0


# ---- decode -------------------------------------------------------------------------------


def test_decode_partial_block_then_boundary():
    """Appending into the partial last block allocates nothing and caches nothing; crossing
    the boundary allocates one block and caches the one that just became full."""
    mgr = allocator([FullAttention(BS16)], 11)
    r = req("A", COMMON48 + [3] * 7, BS16)  # 55 tokens -> [1,2,3,4]
    prefill(mgr, r)
    for _ in range(4):
        r.append_token(8)
    new = mgr.allocate_slots(r, 4)
    r.num_computed_tokens += 4
    assert [len(g) for g in new] == [0]
    assert mgr.pool.blocks[4].key is None

    for _ in range(9 + 10):  # 9 fill block 4, 10 go into a new block
        r.append_token(7)
    new = mgr.allocate_slots(r, 19)
    assert [[x.block_id for x in g] for g in new] == [[5]]
    assert mgr.get_block_ids("A") == ([1, 2, 3, 4, 5],)
    assert mgr.pool.blocks[4].key == (r.block_hashes[3], 0)
    assert mgr.pool.blocks[5].key is None


# ---- capacity counting --------------------------------------------------------------------


def test_capacity_free_hits_count_as_taken_nulls_never():
    """10 real hits in the free queue + 10 new = 20 counted; 5 nulls + 5 real free hits + 10
    new = 15 counted (sliding window, block size 2, window 4)."""
    pool = BlockPool(100)
    sw = SlidingWindowManager(SlidingWindow(2, 4), pool, 0, True)
    real = list(pool.blocks[1:11])
    assert all(b.ref_cnt == 0 for b in real)
    assert sw.count_blocks_to_allocate("1", 20 * 2, real, 0) == 20
    assert sw.count_blocks_to_allocate("2", 20 * 2, [pool.null_block] * 5 + real[:5], 0) == 15
    full = FullAttentionManager(FullAttention(2), pool, 1, True)
    assert full.count_blocks_to_allocate("3", 20 * 2, real, 0) == 20


def test_capacity_one_evictable_hit_counts_two_takes_one_new():
    """One evictable hit for a request needing one new block: counted 2, but the allocation
    takes only 1 new block from the queue (the hit leaves the queue by touch)."""
    mgr = allocator([FullAttention(2)], 5)
    a = req("a", [1, 2, 3], 2)
    prefill(mgr, a)
    mgr.free(a)
    assert queue(mgr) == [2, 3, 4, 1]
    b = req("b", [1, 2, 9], 2)
    hits, num_hit, _ = mgr.get_computed_blocks(b)
    assert hit_ids(hits) == ([1],) and num_hit == 2
    assert mgr.coordinator.count_blocks_to_allocate("b", 3, hits, num_hit) == 2
    new = mgr.allocate_slots(b, 1, num_hit, hits)
    assert [[x.block_id for x in g] for g in new] == [[2]]
    assert mgr.get_block_ids("b") == ([1, 2],)
    assert queue(mgr) == [3, 4]


def test_capacity_lookahead():
    """Block size 4, 3 new tokens + 2 lookahead tokens -> 2 blocks."""
    mgr = allocator([FullAttention(4)], 6)
    r = req("r", [1, 2, 3], 4)
    assert mgr.coordinator.count_blocks_to_allocate("r", 3 + 2, mgr.empty_hits(), 0) == 2
    new = mgr.allocate_slots(r, 3, num_lookahead_tokens=2)
    assert [[x.block_id for x in g] for g in new] == [[1, 2]]


def test_capacity_refusal_leaves_hits_and_queue_unchanged():
    """A refused allocation leaves every hit block's ref_cnt and the queue unchanged."""
    mgr = allocator([FullAttention(2)], 4)
    a = req("a", [1, 2, 3], 2)
    prefill(mgr, a)  # [1, 2], block 1 cached
    prefill(mgr, req("f", [7], 2))  # block 3
    mgr.free(a)
    assert queue(mgr) == [2, 1]
    b = req("b", [1, 2, 9, 9, 9], 2)
    hits, num_hit, _ = mgr.get_computed_blocks(b)
    assert hit_ids(hits) == ([1],)
    # 2 new blocks + the free hit = 3 counted with 2 free.
    assert mgr.coordinator.count_blocks_to_allocate("b", 5, hits, num_hit) == 3
    assert mgr.allocate_slots(b, 3, num_hit, hits) is None
    assert refs(mgr, [1, 2]) == [0, 0]
    assert queue(mgr) == [2, 1]
    assert mgr.pool.blocks[1].key is not None
    assert mgr.get_block_ids("b") == ([],)
    assert not mgr.coordinator.is_admitted("b")


# ---- sliding window, block size 2, window 4 -----------------------------------------------


@pytest.mark.parametrize("computed, dropped", [(4, 0), (5, 1), (7, 2), (11, 4)])
def test_sliding_window_skipped_tokens(computed, dropped):
    """skipped = max(0, n - 4 + 1); leading blocks dropped = skipped // 2: 0, 1, 2, 4."""
    mgr = allocator([SlidingWindow(2, 4)], 10)
    r = req("r", range(13), 2)
    mgr.allocate_slots(r, 12, delay_cache_blocks=True)
    assert SlidingWindow(2, 4).skipped_tokens(computed) == max(0, computed - 3)
    mgr.coordinator.remove_skipped_blocks("r", computed)
    (table,) = mgr.get_block_ids("r")
    assert table == [NULL] * dropped + list(range(1 + dropped, 7))
    assert refs(mgr, range(1, 1 + dropped)) == [0] * dropped


def test_sliding_window_eleven_block_pattern():
    """hit,hit,miss,hit,miss,miss,hit,hit,miss,miss,miss: scanning from the right finds the
    run at blocks 6 and 7. The doc says "8 tokens"; it is 8 BLOCKS (16 tokens at block size
    2) - six nulls then the run - as vLLM's own test asserts."""
    pattern = [1, 1, 0, 1, 0, 0, 1, 1, 0, 0, 0]
    pool = BlockPool(20)
    hashes = [500 + i for i in range(len(pattern))]
    blocks = pool.get_new_blocks(len(pattern))
    for i, cached in enumerate(pattern):
        if cached:
            pool.cache_block(blocks[i], hashes[i], 0)
    sw = SlidingWindowManager(SlidingWindow(2, 4), pool, 0, True)
    got = sw.find_longest_cache_hit(hashes, 2 * len(pattern))
    assert len(got) == 8
    assert [b.block_id for b in got] == [NULL] * 6 + [7, 8]


def test_sliding_window_prompt_shorter_than_window():
    """A prompt shorter than the window: the run starting at block 0 is a valid hit even
    though it is shorter than the window needs (window 16 = 8 blocks at size 2)."""
    mgr = allocator([SlidingWindow(2, 16)], 10)
    prefill(mgr, req("a", [1, 2, 3, 4, 5], 2))
    hits, num_hit, _ = mgr.get_computed_blocks(req("b", [1, 2, 3, 4, 5], 2))
    assert hit_ids(hits) == ([1, 2],) and num_hit == 4


# ---- chunked local attention, chunk 4 ----------------------------------------------------


@pytest.mark.parametrize("computed, skipped", [(3, 0), (4, 4), (7, 4), (8, 8), (11, 8)])
def test_chunked_local_skipped_tokens(computed, skipped):
    """skipped = (n // 4) * 4: blocks are dropped a whole chunk at a time."""
    spec = ChunkedLocal(2, 4)
    assert spec.skipped_tokens(computed) == skipped
    mgr = allocator([spec], 10)
    mgr.allocate_slots(req("r", range(13), 2), 12, delay_cache_blocks=True)
    mgr.coordinator.remove_skipped_blocks("r", computed)
    (table,) = mgr.get_block_ids("r")
    assert table.count(NULL) == skipped // 2
    assert table.count(NULL) % 2 == 0  # a chunk is 2 blocks


# ---- hybrid: full + two sliding windows (window 2 blocks), 21 blocks -----------------------

BS4 = 4
HYBRID = [FullAttention(BS4), SlidingWindow(BS4, 2 * BS4), SlidingWindow(BS4, 2 * BS4)]
COMMON12 = list(range(3 * BS4))


@pytest.fixture
def hybrid21():
    mgr = allocator(HYBRID, 21)
    a = req("A", COMMON12 + [90, 91, 92], BS4)
    prefill(mgr, a)
    return mgr, a


def test_hybrid_step1_request_a(hybrid21):
    """A (4 blocks per group) -> [1,2,3,4], [5,6,7,8], [9,10,11,12]."""
    mgr, _ = hybrid21
    assert mgr.get_block_ids("A") == ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12])


def test_hybrid_step2_request_b(hybrid21):
    """B with A's 3 full blocks as prefix hits [1,2,3], [-,6,7], [-,10,11] and takes [13], [14], [15]."""
    mgr, _ = hybrid21
    b = req("B", COMMON12 + [80, 81], BS4)
    hits, num_hit, new = prefill(mgr, b)
    assert hit_ids(hits) == ([1, 2, 3], [NULL, 6, 7], [NULL, 10, 11])
    assert num_hit == 3 * BS4
    assert [[x.block_id for x in g] for g in new] == [[13], [14], [15]]
    assert mgr.get_block_ids("B") == ([1, 2, 3, 13], [NULL, 6, 7, 14], [NULL, 10, 11, 15])


def test_hybrid_step3_eviction_shrinks_hit_to_the_common_fixed_point(hybrid21):
    """Evicting the full group's last block shrinks every group's hit to 2 blocks; evicting
    instead also the windows' first blocks leaves no length all groups can serve: 0."""
    mgr, a = hybrid21
    probe = req("P", COMMON12 + [70, 71, 72], BS4)
    pool = mgr.pool

    saved = pool.cached.pop((a.block_hashes[2], 0))
    hits, num_hit, _ = mgr.get_computed_blocks(probe)
    assert num_hit == 2 * BS4
    assert hit_ids(hits) == ([1, 2], [5, 6], [9, 10])

    saved_w = {g: pool.cached.pop((a.block_hashes[0], g)) for g in (1, 2)}
    hits, num_hit, _ = mgr.get_computed_blocks(probe)
    assert num_hit == 0
    assert hit_ids(hits) == ([], [], [])

    pool.cached[(a.block_hashes[2], 0)] = saved
    pool.cached.update({(a.block_hashes[0], g): e for g, e in saved_w.items()})
    assert mgr.get_computed_blocks(probe)[1] == 3 * BS4


# ---- the motivating bug: full + sliding window 16, block size 4, 13 blocks ----------------


def motivating(variant=None):
    mgr = allocator([FullAttention(4), SlidingWindow(4, 16)], 13, variant)
    a = req("A", range(16), 4)
    c = req("C", range(100, 108), 4)
    prefill(mgr, a)
    prefill(mgr, c)
    assert mgr.get_block_ids("A") == ([1, 2, 3, 4], [5, 6, 7, 8])
    assert mgr.get_block_ids("C") == ([9, 10], [11, 12])
    mgr.free(a)
    mgr.free(c)
    b = req("B", list(range(16)) + list(range(200, 212)), 4)
    return mgr, b


def test_motivating_queue_after_freeing_a_then_c():
    """Groups freed in group order, each in reverse, all cached: [4,3,2,1,8,7,6,5,10,9,12,11]."""
    mgr, _ = motivating()
    assert queue(mgr) == [4, 3, 2, 1, 8, 7, 6, 5, 10, 9, 12, 11]


def test_motivating_correct_two_phase_tables():
    """B hits 16 tokens ([1,2,3,4], [5,6,7,8]); 4 new + 8 external tokens give
    [1,2,3,4,6,5,12] and [-,-,7,8,10,9,11], every ref_cnt 1."""
    mgr, b = motivating()
    hits, num_hit, _ = prefill(mgr, b, num_external=8, num_new=4)
    assert hit_ids(hits) == ([1, 2, 3, 4], [5, 6, 7, 8]) and num_hit == 16
    assert mgr.get_block_ids("B") == ([1, 2, 3, 4, 6, 5, 12], [NULL, NULL, 7, 8, 10, 9, 11])
    held = [x for t in mgr.get_block_ids("B") for x in t if x != NULL]
    assert refs(mgr, held) == [1] * len(held)
    assert queue(mgr) == []


def test_motivating_buggy_per_group_loop_tables():
    """The interleaved variant gives [1,2,3,4,8,7,10] and [-,-,7,8,6,5,9]: blocks 7 and 8
    in both groups (pins that the variant still reproduces the bug)."""
    mgr, b = motivating(BUGGY)
    prefill(mgr, b, num_external=8, num_new=4)
    assert mgr.get_block_ids("B") == ([1, 2, 3, 4, 8, 7, 10], [NULL, NULL, 7, 8, 6, 5, 9])
    assert refs(mgr, [7, 8]) == [2, 2]
