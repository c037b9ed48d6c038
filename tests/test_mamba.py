"""State-space groups (docs/design.md §2): a table of states, hits at block boundaries,
retirement, the same-step rule and the scheduler's chunk alignment."""

from __future__ import annotations

from pathlib import Path

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


def test_a_state_group_takes_only_an_asynchronous_connector():
    with pytest.raises(ConfigError, match="connector must be 'off' or 'async' with a Mamba group"):
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


# ---- the connector with a state group ----------------------------------------------------


def published(prompt_len: int, tier_len: int):
    """A hybrid engine whose tier holds a remote node's first ``tier_len`` tokens of the prompt."""
    checker = Checker()
    eng = engine([FullAttention(BS), Mamba(BS)], 32, hooks=checker, connector="async")
    prompt = list(range(prompt_len))
    eng.connector.publish_prefix(prompt[:tier_len])
    return eng, checker, eng.add_request(prompt, 2)


def test_a_hit_through_the_tier_ends_on_the_last_block_boundary_before_the_last_token():
    eng, _, r = published(13, 13)
    assert eng.connector.num_new_matched_tokens(r, 0) == 12


def test_a_hit_through_the_tier_needs_the_state_at_its_end_only():
    eng, _, r = published(13, 13)
    for block_hash in r.block_hashes[1:]:
        del eng.connector.tier[block_hash][1]  # the state group's rows after the first block
    assert eng.connector.num_new_matched_tokens(r, 0) == 4


def test_a_load_writes_one_state_block_at_the_hit_end_and_the_request_continues_from_it():
    eng, checker, r = published(13, 13)
    eng.step()
    state_table = eng.allocator.get_block_ids(r.request_id)[1]
    eng.finish_load(r.request_id, ok=True)
    checker.check_all(eng)  # the loaded state after 12 tokens reads back at the hit's end
    assert ([b == NULL for b in state_table], eng.loaded) == ([True, True, False], [r])
    assert (drain(eng, checker) > 0, eng.requests) == (True, {})


def test_a_state_computed_at_a_block_boundary_is_offloaded_and_loads_for_the_next_request():
    checker = Checker()
    eng = engine([FullAttention(BS), Mamba(BS)], 32, hooks=checker, connector="async")
    eng.add_request(list(range(9)), 1)
    drain(eng, checker)
    eng.reset_prefix_cache()
    r = eng.add_request(list(range(10)), 1)
    assert eng.connector.num_new_matched_tokens(r, 0) == 8
    assert (drain(eng, checker) > 0, eng.requests) == (True, {})


# ---- the same-step rule for a block a queued copy fills ------------------------------------

COPY_FILLED_HIT = Path(__file__).parent / "data" / "copy-filled-hit.json"


def _copy_filled_hit_replay():
    """A walk (seed 13, minimised): in the drain, r18's allocation copies its state block keyed
    inside it onto a block evicted from the free queue, which held that key at the step's
    start; r20's lookup hits that block. kvprop's allocator and vLLM 0.33.0 refuse r20 until
    the copy has run (``cached_blocks_this_step``)."""
    from kvprop.search.execute import execute
    from kvprop.search.trace import load

    return execute(load(COPY_FILLED_HIT))


def test_a_hit_on_a_block_a_queued_copy_fills_may_be_refused():
    assert _copy_filled_hit_replay() is None


def test_the_bound_without_the_copy_rule_calls_that_refusal_spurious(monkeypatch):
    from kvprop.check import checker

    monkeypatch.setattr(checker.Checker, "_filled_by_copies", staticmethod(lambda engine: set()))
    failure = _copy_filled_hit_replay()
    assert (failure.step, failure.kind) == (31, "spurious-refusal")
