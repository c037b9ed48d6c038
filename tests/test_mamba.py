"""State-space groups (docs/design.md §2): a table of states, hits at block boundaries,
retirement, the same-step rule and the scheduler's chunk alignment."""

from __future__ import annotations

import pytest
from helpers import NULL, allocator, engine, prefill, req

from kvprop.allocator.specs import AllocatorConfig, EngineConfig, FullAttention, Mamba
from kvprop.check.checker import Checker, drain
from kvprop.errors import ConfigError

BS = 4


def table(mgr, rid, group=0):
    return mgr.coordinator.managers[group].req_to_blocks[rid]


def ids(blocks):
    return [b.block_id for b in blocks]


def advance(mgr, request, n):
    """One more chunk of ``n`` tokens for an admitted request, computed."""
    assert mgr.allocate_slots(request, n) is not None
    request.num_computed_tokens += n


def test_a_chunk_keeps_one_state_block_at_its_end():
    mgr = allocator([Mamba(BS)], 16)
    r = req("r", range(13), BS)
    prefill(mgr, r, num_new=8)
    assert ids(table(mgr, "r")) == [NULL, 1]


def test_the_state_at_a_block_boundary_is_cached_there():
    mgr = allocator([Mamba(BS)], 16)
    r = req("r", range(13), BS)
    prefill(mgr, r, num_new=8)
    assert table(mgr, "r")[1].key == (r.block_hashes[1], 0)


def test_the_previous_state_is_released_once_the_next_step_has_continued_from_it():
    mgr = allocator([Mamba(BS)], 16)
    r = req("r", range(17), BS)
    prefill(mgr, r, num_new=8)
    r.num_computed_tokens = 8
    advance(mgr, r, 8)
    advance(mgr, r, 1)
    assert ids(table(mgr, "r")) == [NULL, NULL, NULL, 2, 3]


def test_a_hit_is_the_rightmost_cached_state_alone():
    mgr = allocator([Mamba(BS)], 16)
    a = req("a", range(13), BS)
    prefill(mgr, a, num_new=12)
    hits, num_hit, _ = mgr.get_computed_blocks(req("b", [*range(12), 99], BS))
    assert (ids(hits[0]), num_hit) == ([NULL, NULL, 1], 12)


def test_a_hit_on_a_state_cached_in_this_step_waits_for_the_next_step():
    mgr = allocator([Mamba(BS)], 16)
    prefill(mgr, req("a", range(9), BS), num_new=8)
    b = req("b", [*range(8), 5], BS)
    refused = prefill(mgr, b)[2]
    mgr.new_step_starts()
    assert (refused, prefill(mgr, req("c", [*range(8), 5], BS))[2] is not None) == (None, True)


def test_caching_off_keeps_the_running_state_and_the_next_one_only():
    mgr = allocator([Mamba(BS, "none")], 16, enable_caching=False)
    r = req("r", range(13), BS)
    prefill(mgr, r, num_new=8)
    r.num_computed_tokens = 8
    advance(mgr, r, 4)
    assert [b.is_null for b in table(mgr, "r")] == [True, False, False]


@pytest.mark.parametrize(("mode", "caching"), [("none", True), ("align", False)])
def test_the_mode_follows_prefix_caching(mode, caching):
    with pytest.raises(ConfigError, match="a Mamba group's mode is"):
        AllocatorConfig((Mamba(BS, mode),), 8, enable_caching=caching)


def test_a_state_group_runs_without_a_connector_only():
    with pytest.raises(ConfigError, match="connector must be 'off' with a Mamba group"):
        EngineConfig(AllocatorConfig((Mamba(BS),), 8), connector="sync")


@pytest.mark.parametrize(
    ("prompt", "budget", "chunks"),
    [
        (13, 6, [4, 4, 4, 1]),  # a non-final chunk ends on a block boundary
        (13, 16, [12, 1]),  # and never runs past the last boundary before the last token
        (3, 2, [2, 1]),  # a block wider than the budget advances inside it
    ],
)
def test_prefill_chunks_end_where_a_state_may_be_cached(prompt, budget, chunks):
    eng = engine([FullAttention(BS), Mamba(BS)], 32, token_budget=budget)
    eng.add_request(list(range(prompt)), 1)
    assert [next(iter(eng.step().scheduled.values())) for _ in chunks] == chunks


def test_a_hybrid_walk_with_a_shared_prefix_runs_clean():
    checker = Checker()
    eng = engine([FullAttention(BS), Mamba(BS)], 32, hooks=checker, token_budget=8)
    for tokens in ([*range(13)], [*range(12), 7, 7], [*range(8), 1, 2]):
        eng.add_request(tokens, 2)
        eng.step()
        checker.check_all(eng)
    assert (drain(eng, checker) > 0, eng.requests) == (True, {})
