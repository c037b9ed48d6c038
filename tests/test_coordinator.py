"""Coordinators: the hybrid hit fixed point, two-phase admission, the admitted fast path."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
from helpers import BUGGY, NULL, allocator, hit_ids, prefill, queue, req

from kvprop.allocator.coordinator import HybridCoordinator, UnitaryCoordinator
from kvprop.allocator.specs import FullAttention, SlidingWindow

BS = 4
HYBRID = [FullAttention(BS), SlidingWindow(BS, 2 * BS), SlidingWindow(BS, 2 * BS)]  # window = 2 blocks
COMMON = list(range(3 * BS))  # three full blocks every request below shares


def test_one_group_gets_the_unitary_coordinator_several_the_hybrid():
    """A single group's own hit is final; several groups need the fixed point."""
    assert type(allocator([FullAttention(2)], 4).coordinator) is UnitaryCoordinator
    assert type(allocator(HYBRID, 8).coordinator) is HybridCoordinator


@pytest.fixture
def hybrid():
    """Reference hybrid: A (3 full blocks + 3 tokens) then B (A's 3 blocks + 2 tokens), 21 blocks."""
    mgr = allocator(HYBRID, 21)
    a = req("A", COMMON + [90, 91, 92], BS)
    prefill(mgr, a)
    b = req("B", COMMON + [80, 81], BS)
    hits, num_hit, _ = prefill(mgr, b)
    return mgr, a, b, hits, num_hit


@contextmanager
def evicted(pool, keys):
    """Drop cache entries for the duration of a hit search (the blocks stay in use)."""
    saved = {k: pool.cached.pop(k) for k in keys}
    try:
        yield
    finally:
        pool.cached.update(saved)


@pytest.mark.parametrize(
    "evict, hit_blocks",
    [
        pytest.param([(0, 0)], 0, id="full-block0-gone-total-miss"),
        pytest.param([(2, 0), (2, 1), (2, 2)], 2, id="last-block-gone-everywhere"),
        pytest.param([(2, 0)], 2, id="full-last-block-gone"),
        pytest.param([(2, 1)], 2, id="window1-last-block-gone"),
        pytest.param([(2, 2)], 2, id="window2-last-block-gone"),
        # full can serve 2 blocks, the windows only [-, 6, 7] (3 blocks); at 2 blocks the
        # windows need blocks 0 and 1 and block 0 is gone: the groups do not line up -> 0.
        pytest.param([(2, 0), (0, 1), (0, 2)], 0, id="misaligned-groups-total-miss"),
    ],
)
def test_hybrid_hit_is_a_fixed_point_over_groups(hybrid, evict, hit_blocks):
    """The hit length is what every group can serve at once; each group returns exactly
    that many blocks (nulls included)."""
    mgr, a, *_ = hybrid
    probe = req("P", COMMON + [70, 71, 72], BS)
    assert len(probe.block_hashes) == 3
    keys = [(a.block_hashes[i], g) for i, g in evict]
    with evicted(mgr.pool, keys):
        hits, num_hit, _ = mgr.get_computed_blocks(probe)
    assert num_hit == hit_blocks * BS
    assert [len(g) for g in hits] == [hit_blocks] * 3
    if hit_blocks:
        assert hit_ids(hits)[0] == [1, 2, 3][:hit_blocks]


def test_hybrid_hit_without_eviction_is_three_blocks(hybrid):
    """Control for the eviction cases: with everything cached the probe hits 3 blocks."""
    mgr, *_ = hybrid
    hits, num_hit, _ = mgr.get_computed_blocks(req("P", COMMON + [70, 71, 72], BS))
    assert num_hit == 3 * BS
    assert hit_ids(hits) == ([1, 2, 3], [NULL, 6, 7], [NULL, 10, 11])


def test_fixed_point_shrinks_an_earlier_group_after_a_later_one():
    """Window group first, full second: full's shorter hit must shrink the window's again."""
    mgr = allocator([SlidingWindow(BS, 2 * BS), FullAttention(BS)], 21)
    a = req("A", COMMON + [1], BS)
    prefill(mgr, a)
    with evicted(mgr.pool, [(a.block_hashes[1], 1)]):
        hits, num_hit, _ = mgr.get_computed_blocks(req("P", COMMON + [2], BS))
    assert num_hit == BS
    assert hit_ids(hits) == ([1], [5])


def record_pool_calls(mgr, monkeypatch) -> list[str]:
    """Log 'touch' / 'pop' as the pool is asked to touch hits or hand out new blocks."""
    calls = []
    pool = mgr.pool
    touch, get_new = pool.touch, pool.get_new_blocks

    def logged_touch(blocks):
        blocks = list(blocks)
        if any(not b.is_null for b in blocks):
            calls.append("touch")
        return touch(blocks)

    def logged_get_new(n):
        calls.append("pop")
        return get_new(n)

    monkeypatch.setattr(pool, "touch", logged_touch)
    monkeypatch.setattr(pool, "get_new_blocks", logged_get_new)
    return calls


def motivating_state(variant=None):
    """docs/reference-scenarios.md's motivating bug: full + window 16, block size 4, 13 blocks,
    A and C freed so A's hits sit at the queue head; B hits 16 tokens in both groups."""
    mgr = allocator([FullAttention(4), SlidingWindow(4, 16)], 13, variant)
    a = req("A", range(16), 4)
    c = req("C", range(100, 108), 4)
    prefill(mgr, a)
    prefill(mgr, c)
    mgr.free(a)
    mgr.free(c)
    b = req("B", list(range(16)) + list(range(200, 212)), 4)
    return mgr, b


@pytest.mark.parametrize("variant, two_phase", [(None, True), (BUGGY, False)])
def test_admission_touches_every_groups_hits_before_any_external_pop(monkeypatch, variant, two_phase):
    """Two phases: all groups' hits are touched before any group takes external blocks
    (the interleaved variant pops for group 0 before touching group 1's hits)."""
    mgr, b = motivating_state(variant)
    hits, num_hit, _ = mgr.get_computed_blocks(b)
    calls = record_pool_calls(mgr, monkeypatch)
    mgr.allocate_slots(b, 4, num_hit, hits, num_external_computed_tokens=8)
    first_pop = calls.index("pop")
    assert ("touch" not in calls[first_pop:]) is two_phase, calls


def test_admitted_request_takes_the_fast_path():
    """A running request's later allocations touch nothing and take no new hits (two full
    groups, so no window frees anything either)."""
    mgr = allocator([FullAttention(2), FullAttention(2)], 12)
    r = req("r", range(5), 2)
    prefill(mgr, r)
    r.append_token(7)
    before = queue(mgr)
    assert [len(g) for g in mgr.allocate_slots(r, 1)] == [0, 0]
    assert queue(mgr) == before


def test_admitted_request_cannot_take_new_hits():
    """Handing cache hits to an admitted request is a contract violation, not a silent touch."""
    mgr = allocator([FullAttention(2), SlidingWindow(2, 4)], 12)
    r = req("r", range(5), 2)
    prefill(mgr, r)
    other = req("o", range(5), 2)
    hits, num_hit, _ = mgr.get_computed_blocks(other)
    assert num_hit == 4
    r.append_token(1)  # a decode step: the call is well-formed but for the hits
    with pytest.raises(AssertionError, match="admitted request r cannot take new cache hits"):
        mgr.allocate_slots(r, 1, 0, hits)


def test_get_block_ids_of_an_unknown_request_is_empty_per_group():
    """Unknown requests have no blocks in any group."""
    mgr = allocator(HYBRID, 8)
    assert mgr.get_block_ids("nope") == ([], [], [])
