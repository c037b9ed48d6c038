"""Per-group managers: hit search, skipped tokens, capacity counting, decode, caching, reset."""

from __future__ import annotations

import pytest
from helpers import NULL, allocator, hit_ids, prefill, queue, refs, req

from kvprop.allocator.block_pool import BlockPool
from kvprop.allocator.group_managers import (
    ChunkedLocalManager,
    FullAttentionManager,
    SlidingWindowManager,
)
from kvprop.allocator.specs import ChunkedLocal, FullAttention, SlidingWindow

HASHES = [1000 + i for i in range(16)]  # stand-in block hashes; only equality matters here


def manager_with_cached(cls, spec, pattern, num_blocks=40):
    """A manager over a fresh pool where block i+1 is cached under HASHES[i] wherever pattern[i]."""
    pool = BlockPool(num_blocks)
    blocks = pool.get_new_blocks(len(pattern))
    for i, (block, cached) in enumerate(zip(blocks, pattern)):
        if cached:
            pool.cache_block(block, HASHES[i], 0)
    pool.free_blocks(reversed(blocks))
    return cls(spec, pool, 0, True), pool


def hit_block_ids(manager, n, max_length):
    return [b.block_id for b in manager.find_longest_cache_hit(HASHES[:n], max_length)]


# ---- hit search ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pattern, expected",
    [
        ([1, 1, 1, 1], [1, 2, 3, 4]),
        ([1, 1, 0, 1], [1, 2]),
        ([0, 1, 1, 1], []),
        ([1, 0, 0, 0], [1]),
    ],
)
def test_full_attention_hit_is_the_longest_leading_run(pattern, expected):
    """Full attention needs every earlier block: the hit stops at the first miss."""
    m, _ = manager_with_cached(FullAttentionManager, FullAttention(2), pattern)
    assert hit_block_ids(m, len(pattern), 2 * len(pattern)) == expected


def test_full_attention_hit_is_capped_by_max_length():
    """Only whole blocks inside max_length can be hits."""
    m, _ = manager_with_cached(FullAttentionManager, FullAttention(2), [1, 1, 1, 1])
    assert hit_block_ids(m, 4, 5) == [1, 2]
    assert hit_block_ids(m, 4, 1) == []


def test_full_attention_hit_is_per_group():
    """A block cached for group 0 is no hit for group 1."""
    _, pool = manager_with_cached(FullAttentionManager, FullAttention(2), [1, 1])
    other = FullAttentionManager(FullAttention(2), pool, 1, True)
    assert other.find_longest_cache_hit(HASHES[:2], 4) == []


@pytest.mark.parametrize(
    "pattern, num_hit_blocks",
    [
        ([1], 1),
        ([1, 0], 1),
        ([1, 1], 2),
        ([1, 1, 0], 2),
        ([1, 1, 1], 3),
        ([0, 1, 1], 3),
        ([1, 1, 0, 1, 0, 0, 1, 1, 0, 1, 1, 1], 12),
        # reference-scenarios.md says "8 tokens" here; it is 8 BLOCKS (16 tokens at block
        # size 2): the run at blocks 6 and 7 with six nulls before it. vLLM's own test
        # (test_sliding_window_possible_cached_prefix) asserts 8 blocks.
        ([1, 1, 0, 1, 0, 0, 1, 1, 0, 0, 0], 8),
        ([1, 1, 0, 1, 0, 0, 1, 1, 0, 0, 0, 1], 8),
    ],
)
def test_sliding_window_hit_scans_from_the_right(pattern, num_hit_blocks):
    """Window 4 at block size 2 needs the last 2 contiguous blocks; blocks before the run are
    null; a run starting at block 0 is a hit even when shorter than the window."""
    m, _ = manager_with_cached(SlidingWindowManager, SlidingWindow(2, 4), pattern)
    got = m.find_longest_cache_hit(HASHES[: len(pattern)], 2 * len(pattern))
    assert len(got) == num_hit_blocks
    # Nulls only before the run; every real block is the one cached for its index.
    first_real = next((i for i, b in enumerate(got) if not b.is_null), len(got))
    assert all(b.is_null for b in got[:first_real])
    assert all(not b.is_null and b.block_id == i + 1 and pattern[i] for i, b in enumerate(got) if i >= first_real)
    assert len(got) - first_real >= min(2, len(got))


def test_sliding_window_prompt_shorter_than_window_hits_from_block_zero():
    """With window 16 (8 blocks at size 2) a 3-block prompt prefix is still a valid hit."""
    m, _ = manager_with_cached(SlidingWindowManager, SlidingWindow(2, 16), [1, 1, 1])
    assert hit_block_ids(m, 3, 6) == [1, 2, 3]


def test_sliding_window_short_run_not_at_block_zero_is_no_hit():
    """A run shorter than the window that does not start at block 0 cannot serve the window."""
    m, _ = manager_with_cached(SlidingWindowManager, SlidingWindow(2, 16), [0, 1, 1])
    assert hit_block_ids(m, 3, 6) == []


def test_chunked_local_earlier_chunks_are_null():
    """Chunk 4 at block size 2: with max_length 10 the current chunk starts at block 4;
    blocks 0..3 are null whatever is cached, and the current chunk hits from its start."""
    m, _ = manager_with_cached(ChunkedLocalManager, ChunkedLocal(2, 4), [0, 0, 1, 1, 1, 1])
    assert hit_block_ids(m, 6, 10) == [NULL] * 4 + [5]


def test_chunked_local_current_chunk_must_hit_from_its_start():
    """A miss at the current chunk's first block leaves only the skipped chunks."""
    m, _ = manager_with_cached(ChunkedLocalManager, ChunkedLocal(2, 4), [1, 1, 1, 1, 0, 1])
    assert hit_block_ids(m, 6, 11) == [NULL] * 4


def test_chunked_local_hit_inside_the_first_chunk():
    """Inside the first chunk the hit is the leading run, as for full attention."""
    m, _ = manager_with_cached(ChunkedLocalManager, ChunkedLocal(2, 8), [1, 1, 0, 1])
    assert hit_block_ids(m, 4, 7) == [1, 2]


# ---- skipped tokens --------------------------------------------------------------------


def test_full_attention_skips_nothing():
    """Full attention never skips."""
    assert FullAttention(2).skipped_tokens(1000) == 0


def test_sliding_window_removes_skipped_blocks_as_tokens_are_computed():
    """At 4, 5, 7, 11 computed tokens the leading 0, 1, 2, 4 entries become the null block
    and their blocks are freed (hashless: to the queue head)."""
    mgr = allocator([SlidingWindow(2, 4)], 10)
    r = req("r", range(13), 2)
    mgr.allocate_slots(r, 12, delay_cache_blocks=True)
    assert mgr.get_block_ids("r") == ([1, 2, 3, 4, 5, 6],)
    sw = mgr.coordinator.managers[0]
    for computed, table in [
        (4, [1, 2, 3, 4, 5, 6]),
        (5, [NULL, 2, 3, 4, 5, 6]),
        (7, [NULL, NULL, 3, 4, 5, 6]),
        (11, [NULL, NULL, NULL, NULL, 5, 6]),
    ]:
        sw.remove_skipped_blocks("r", computed)
        assert mgr.get_block_ids("r") == (table,)
    assert refs(mgr, [1, 2, 3, 4]) == [0, 0, 0, 0]
    assert queue(mgr)[:4] == [4, 3, 2, 1]
    assert queue(mgr)[4:] == [7, 8, 9]


def test_chunked_local_removes_a_whole_chunk_at_a_time():
    """Chunk 4 at block size 2: nothing dropped at 3 tokens, blocks 0-1 at 4..7, blocks 0-3 at 8."""
    mgr = allocator([ChunkedLocal(2, 4)], 10)
    r = req("r", range(13), 2)
    mgr.allocate_slots(r, 12, delay_cache_blocks=True)
    cl = mgr.coordinator.managers[0]
    for computed, table in [
        (3, [1, 2, 3, 4, 5, 6]),
        (4, [NULL, NULL, 3, 4, 5, 6]),
        (7, [NULL, NULL, 3, 4, 5, 6]),
        (8, [NULL, NULL, NULL, NULL, 5, 6]),
    ]:
        cl.remove_skipped_blocks("r", computed)
        assert mgr.get_block_ids("r") == (table,)
    assert refs(mgr, [1, 2, 3, 4, 5, 6]) == [0, 0, 0, 0, 1, 1]


def test_skipped_cached_blocks_stay_cached_when_freed():
    """A window drops a cached block: it is freed to the tail and keeps its hash (still a hit)."""
    mgr = allocator([SlidingWindow(2, 4)], 10)
    r = req("r", range(9), 2)
    mgr.allocate_slots(r, 8)  # blocks 1..4, all full and cached
    r.num_computed_tokens = 8
    mgr.coordinator.remove_skipped_blocks("r", 8)  # skipped 5 tokens -> 2 blocks
    assert mgr.get_block_ids("r") == ([NULL, NULL, 3, 4],)
    assert queue(mgr) == [5, 6, 7, 8, 9, 2, 1]
    assert mgr.pool.blocks[1].key is not None and mgr.pool.blocks[2].key is not None


# ---- capacity counting (the reference cases are in test_reference_scenarios.py) ---------


def test_count_hits_in_use_cost_nothing():
    """A hit block already held by another request is not taken from the queue."""
    pool = BlockPool(20)
    used = pool.get_new_blocks(3)
    full = FullAttentionManager(FullAttention(2), pool, 0, True)
    assert full.count_blocks_to_allocate("r", 10, used, 0) == 2


def test_count_skipped_hits_are_not_counted():
    """Hits a window will skip are never touched, so they do not count."""
    pool = BlockPool(20)
    sw = SlidingWindowManager(SlidingWindow(2, 4), pool, 0, True)
    hits = list(pool.blocks[1:5])  # 4 free hits, 8 tokens
    # 8 computed tokens skip 5 -> 2 blocks; 2 free hits kept; 12 tokens = 6 blocks, 2 new.
    assert sw.count_blocks_to_allocate("r", 12, hits, 8) == 4


def test_lookahead_slots_are_never_cached():
    """Caching stops at the request's own tokens, never the lookahead slots."""
    mgr = allocator([FullAttention(2)], 6)
    r = req("r", [1, 2, 3, 4], 2)
    mgr.allocate_slots(r, 4, num_lookahead_tokens=2)
    assert mgr.get_block_ids("r") == ([1, 2, 3],)
    assert [mgr.pool.blocks[b].key is not None for b in (1, 2, 3)] == [True, True, False]


# ---- decode ----------------------------------------------------------------------------


def test_decode_fills_the_partial_block_then_crosses_a_boundary():
    """Decoding into a partial block allocates nothing and does not cache it; crossing a
    boundary allocates one block and caches the one that became full."""
    mgr = allocator([FullAttention(4)], 8)
    r = req("r", range(6), 4)
    prefill(mgr, r)
    assert mgr.get_block_ids("r") == ([1, 2],)
    assert mgr.pool.blocks[1].key is not None and mgr.pool.blocks[2].key is None

    r.append_token(6)  # 7 tokens, still inside block 2
    new = mgr.allocate_slots(r, 1)
    assert [len(g) for g in new] == [0]
    r.num_computed_tokens += 1
    assert mgr.pool.blocks[2].key is None

    for t in (7, 8):  # 9 tokens: block 2 fills, block 3 begins
        r.append_token(t)
    new = mgr.allocate_slots(r, 2)
    assert [[b.block_id for b in g] for g in new] == [[3]]
    r.num_computed_tokens += 2
    assert mgr.get_block_ids("r") == ([1, 2, 3],)
    assert mgr.pool.blocks[2].key == (r.block_hashes[1], 0)
    assert mgr.pool.blocks[3].key is None


def test_decode_in_a_window_drops_blocks_behind_it():
    """A sliding-window decode step frees the block the window has left."""
    mgr = allocator([SlidingWindow(2, 4)], 8)
    r = req("r", range(4), 2)
    prefill(mgr, r)
    assert mgr.get_block_ids("r") == ([1, 2],)
    r.append_token(9)
    mgr.allocate_slots(r, 1)  # 4 computed: skipped 1 token, no whole block yet
    r.num_computed_tokens += 1
    assert mgr.get_block_ids("r") == ([1, 2, 3],)
    r.append_token(9)
    mgr.allocate_slots(r, 1)  # 5 computed: skipped 2 tokens = block 0
    assert mgr.get_block_ids("r") == ([NULL, 2, 3],)
    assert mgr.pool.blocks[1].ref_cnt == 0


# ---- caching, hits and reset through the facade ----------------------------------------


def test_hit_never_covers_the_last_prompt_token():
    """A prompt of exactly 2 full blocks re-hits only 1: the last token must be computed."""
    mgr = allocator([FullAttention(2)], 8)
    prefill(mgr, req("a", [1, 2, 3, 4], 2))
    hits, num_hit, _ = mgr.get_computed_blocks(req("b", [1, 2, 3, 4], 2))
    assert hit_ids(hits) == ([1],) and num_hit == 2


def test_caching_disabled_gives_no_hits_and_caches_nothing():
    """enable_caching=False: no block is ever cached or hit."""
    mgr = allocator([FullAttention(2)], 8, enable_caching=False)
    prefill(mgr, req("a", [1, 2, 3, 4, 5], 2))
    assert mgr.pool.cached == {}
    hits, num_hit, _ = mgr.get_computed_blocks(req("b", [1, 2, 3, 4, 5], 2))
    assert hit_ids(hits) == ([],) and num_hit == 0


def test_reset_prefix_cache_refused_while_in_use_then_clears():
    """reset refuses while a request holds blocks; after the free it clears every hit."""
    mgr = allocator([FullAttention(2), SlidingWindow(2, 4)], 12)
    a = req("a", [1, 2, 3, 4, 5], 2)
    prefill(mgr, a)
    assert mgr.reset_prefix_cache() is False
    assert mgr.get_computed_blocks(req("x", [1, 2, 3, 4, 5], 2))[1] == 4
    mgr.free(a)
    assert mgr.reset_prefix_cache() is True
    assert mgr.pool.cached == {}
    assert all(b.key is None for b in mgr.pool.blocks)
    assert mgr.get_computed_blocks(req("y", [1, 2, 3, 4, 5], 2))[1] == 0
    assert mgr.num_free_blocks == 11


def test_free_releases_every_group_and_forgets_the_request():
    """After free no group has a table or cached count for the request; ref_cnts drop to 0."""
    mgr = allocator([FullAttention(2), SlidingWindow(2, 4), ChunkedLocal(2, 4)], 16)
    a = req("a", range(7), 2)
    prefill(mgr, a)
    mgr.free(a)
    for m in mgr.coordinator.managers:
        assert "a" not in m.req_to_blocks and "a" not in m.num_cached_block
    assert mgr.get_block_ids("a") == ([], [], [])
    assert all(b.ref_cnt == 0 for b in mgr.pool.blocks)
    assert mgr.num_free_blocks == 15
