"""Upstream regression: duplicate physical blocks on a cross-group cache hit with external tokens.

Each scenario runs on the fixed allocator (variant None), where every assertion holds, and
on the pre-fix ``interleaved-external-alloc`` variant, where the same assertions must fail:
proof that the assertions can catch the bug. The assertions are

* no block id appears twice across all groups of the request, every non-null block it
  holds has ref_cnt >= 1 and is out of the free queue;
* data read-back: every computed position, written through the block tables into paged
  memory, reads back its own fingerprint (a block shared by two groups is clobbered);
* through the engine with a ``sync`` connector loading the external tokens, every
  invariant holds after every step (``Checker``), and the run drains cleanly.
"""

from __future__ import annotations

import contextlib

import pytest
from helpers import (
    BUGGY,
    NULL,
    allocator,
    assert_request_sound,
    duplicate_blocks,
    engine,
    prefill,
    queue,
    readback_mismatches,
    req,
)

from kvprop.allocator.specs import FullAttention, SlidingWindow
from kvprop.check.checker import Checker, drain
from kvprop.errors import Violation
from kvprop.sim.events import EV_CROSS_GROUP
from kvprop.sim.request import Status

VARIANTS = [pytest.param(None, id="fixed"), pytest.param(BUGGY, id=BUGGY)]


def holds(variant, error=AssertionError, match=None):
    """The wrapped assertions must pass on the fixed allocator and fail on the buggy one."""
    return contextlib.nullcontext() if variant is None else pytest.raises(error, match=match)


def admit_b(mgr, b, num_external, num_new):
    """Admit B: local hit, then external tokens, then new tokens, in one allocate_slots."""
    _, num_hit, result = prefill(mgr, b, num_external=num_external, num_new=num_new)
    assert result is not None
    return num_hit


def check_regression(variant, mgr, b, expected_tables, expected_dups):
    """The three regression assertions, and on the buggy variant the exact duplicate."""
    if variant is None:
        assert mgr.get_block_ids("B") == expected_tables
    else:
        assert duplicate_blocks(mgr, "B") == expected_dups
    with holds(variant, match="appear twice across groups"):
        assert_request_sound(mgr, "B")
    with holds(variant, match="readback"):
        assert readback_mismatches(mgr, [b]) == [], "readback"


# ---- (a) full + sliding window, hit blocks at the queue head, external tokens ----------


def scenario_a(variant):
    """docs/reference-scenarios.md's motivating case: A (16 tokens) and C (8 other tokens) freed,
    so A's cached blocks head the queue; B = A + 12 tokens hits 16 and brings 8 external."""
    mgr = allocator([FullAttention(4), SlidingWindow(4, 16)], 13, variant)
    a, c = req("A", range(16), 4), req("C", range(100, 108), 4)
    prefill(mgr, a)
    prefill(mgr, c)
    mgr.free(a)
    mgr.free(c)
    assert queue(mgr) == [4, 3, 2, 1, 8, 7, 6, 5, 10, 9, 12, 11]
    b = req("B", list(range(16)) + list(range(200, 212)), 4)
    assert admit_b(mgr, b, num_external=8, num_new=4) == 16
    return mgr, b


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_full_and_window_hits_at_queue_head(variant):
    """Two phases keep group 0's external pops off group 1's hits: [1,2,3,4,6,5,12] and
    [-,-,7,8,10,9,11]; the per-group loop puts blocks 7 and 8 in both groups."""
    mgr, b = scenario_a(variant)
    check_regression(
        variant,
        mgr,
        b,
        expected_tables=([1, 2, 3, 4, 6, 5, 12], [NULL, NULL, 7, 8, 10, 9, 11]),
        expected_dups=[7, 8],
    )


# ---- (b) full + two sliding windows ------------------------------------------------------


def scenario_b(variant):
    """Full + two windows of 16 tokens, block size 4, 19 blocks: A (16 tokens) and C (8
    tokens) freed; B = A + 16 tokens hits 16, brings 12 external tokens and 4 new."""
    groups = [FullAttention(4), SlidingWindow(4, 16), SlidingWindow(4, 16)]
    mgr = allocator(groups, 19, variant)
    a, c = req("A", range(16), 4), req("C", range(100, 108), 4)
    prefill(mgr, a)
    prefill(mgr, c)
    mgr.free(a)
    mgr.free(c)
    assert queue(mgr) == [4, 3, 2, 1, 8, 7, 6, 5, 12, 11, 10, 9, 14, 13, 16, 15, 18, 17]
    b = req("B", list(range(16)) + list(range(200, 216)), 4)
    assert admit_b(mgr, b, num_external=12, num_new=4) == 16
    return mgr, b


@pytest.mark.parametrize("variant", VARIANTS)
def test_b_full_and_two_windows(variant):
    """With three groups the per-group loop duplicates across both window groups: block 8
    (groups 0 and 1) and block 12 (groups 1 and 2)."""
    mgr, b = scenario_b(variant)
    check_regression(
        variant,
        mgr,
        b,
        expected_tables=(
            [1, 2, 3, 4, 7, 6, 5, 15],
            [NULL, NULL, NULL, 8, 11, 10, 9, 18],
            [NULL, NULL, NULL, 12, 14, 13, 16, 17],
        ),
        expected_dups=[8, 12],
    )


# ---- (c) allocate, free, allocate again with head-of-queue hits ---------------------------


def assert_every_group_empty(mgr):
    """After the only request is freed no group remembers it and every block is free."""
    for m in mgr.coordinator.managers:
        assert m.req_to_blocks == {} and m.num_cached_block == {}
    assert all(blk.ref_cnt == 0 for blk in mgr.pool.blocks)
    assert mgr.num_free_blocks == mgr.config.num_blocks - 1


def scenario_c(variant, groups, a_len):
    """A fills the whole pool and is freed, so its cached blocks are the entire queue; B
    re-hits all of A and brings 4 external tokens + 1 new."""
    num_blocks = 1 + len(groups) * a_len // 4
    mgr = allocator(groups, num_blocks, variant)
    a = req("A", range(a_len), 4)
    prefill(mgr, a)
    assert mgr.num_free_blocks == 0
    mgr.free(a)
    assert_every_group_empty(mgr)
    b = req("B", list(range(a_len)) + list(range(200, 205)), 4)
    assert admit_b(mgr, b, num_external=4, num_new=1) == a_len
    return mgr, b


@pytest.mark.parametrize("variant", VARIANTS)
def test_c_realloc_two_groups(variant):
    """Full + window 8, A = 20 tokens in 11 blocks; B hits [1..5] and [-,-,-,9,10]; the
    per-group loop lets group 0 pop block 10, group 1's hit."""
    mgr, b = scenario_c(variant, [FullAttention(4), SlidingWindow(4, 8)], 20)
    check_regression(
        variant,
        mgr,
        b,
        expected_tables=([1, 2, 3, 4, 5, 9, 7], [NULL, NULL, NULL, NULL, 10, 8, 6]),
        expected_dups=[10],
    )


@pytest.mark.parametrize("variant", VARIANTS)
def test_c_realloc_three_groups(variant):
    """Full + two windows of 8, A = 16 tokens in 13 blocks; the per-group loop lets group 0
    pop block 8, group 1's hit."""
    mgr, b = scenario_c(variant, [FullAttention(4), SlidingWindow(4, 8), SlidingWindow(4, 8)], 16)
    check_regression(
        variant,
        mgr,
        b,
        expected_tables=([1, 2, 3, 4, 7, 11], [NULL, NULL, NULL, 8, 6, 10], [NULL, NULL, NULL, 12, 5, 9]),
        expected_dups=[8],
    )


# ---- the same scenarios through the engine, external tokens loaded by the connector -------


def engine_scenario(variant, groups, num_blocks, first_prompts, b_prompt, publish_tokens):
    """Step 1 prefills and finishes ``first_prompts`` (every usable block is taken, then
    freed in order, so their cached blocks head the queue). A remote node then publishes
    B's first ``publish_tokens``; step 2 admits B with a local hit plus external tokens that
    the sync connector loads. Every invariant, data read-back included, is checked inside
    and after every step; then the engine drains."""
    checker = Checker()
    eng = engine(groups, num_blocks, variant, hooks=checker, connector="sync", token_budget=64)
    for prompt in first_prompts:
        eng.add_request(prompt, 1)
    eng.step()
    checker.check_all(eng)
    assert not eng.requests and eng.allocator.num_free_blocks == num_blocks - 1
    eng.connector.publish_prefix(b_prompt[:publish_tokens])
    b = eng.add_request(b_prompt, 2)
    seen = {}
    with holds(variant, Violation, match="block-in-two-groups"):
        eng.step()
        seen["tables"] = eng.allocator.get_block_ids(b.request_id)
        assert b.status is Status.RUNNING and b.num_computed_tokens == len(b_prompt)
        checker.check_all(eng)
        drain(eng, checker)
    # The targeted situation happened on both variants: cross-group hit at the queue head + external tokens.
    assert eng.events[EV_CROSS_GROUP] == 1
    return seen.get("tables")


A16 = list(range(16))
ENGINE_CASES = {
    "a": {
        "groups": [FullAttention(4), SlidingWindow(4, 16)],
        "num_blocks": 17,
        "first_prompts": [A16, list(range(100, 108)), list(range(300, 308))],
        "b_prompt": A16 + list(range(200, 212)),
        "publish_tokens": 24,
        "tables": ([1, 2, 3, 4, 6, 5, 12], [NULL, NULL, 7, 8, 10, 9, 11]),
    },
    "b": {
        "groups": [FullAttention(4), SlidingWindow(4, 16), SlidingWindow(4, 16)],
        "num_blocks": 28,
        "first_prompts": [A16, list(range(100, 108)), list(range(300, 312))],
        "b_prompt": A16 + list(range(200, 216)),
        "publish_tokens": 28,
        "tables": (
            [1, 2, 3, 4, 7, 6, 5, 15],
            [NULL, NULL, NULL, 8, 11, 10, 9, 18],
            [NULL, NULL, NULL, 12, 14, 13, 16, 17],
        ),
    },
    "c2": {
        "groups": [FullAttention(4), SlidingWindow(4, 8)],
        "num_blocks": 15,
        "first_prompts": [list(range(20)), list(range(100, 108))],
        "b_prompt": list(range(20)) + list(range(200, 205)),
        "publish_tokens": 24,
        "tables": ([1, 2, 3, 4, 5, 9, 7], [NULL, NULL, NULL, NULL, 10, 8, 6]),
    },
    "c3": {
        "groups": [FullAttention(4), SlidingWindow(4, 8), SlidingWindow(4, 8)],
        "num_blocks": 19,
        "first_prompts": [A16, list(range(100, 108))],
        "b_prompt": A16 + list(range(200, 205)),
        "publish_tokens": 20,
        "tables": ([1, 2, 3, 4, 7, 11], [NULL, NULL, NULL, 8, 6, 10], [NULL, NULL, NULL, 12, 5, 9]),
    },
}


@pytest.mark.parametrize("case", sorted(ENGINE_CASES))
@pytest.mark.parametrize("variant", VARIANTS)
def test_engine_readback_with_sync_connector(variant, case):
    """Through the engine (paged memory, sync connector, Checker after every step) the fixed
    allocator runs clean with the same tables as the allocator-level scenario; the buggy
    variant raises a Violation (the duplicated block is caught where it changes hands)."""
    spec = dict(ENGINE_CASES[case])
    expected = spec.pop("tables")
    tables = engine_scenario(variant, **spec)
    if variant is None:
        assert tables == expected
