"""Speculative decoding: drafts are scheduled with the token they follow, verified, and the
computed count steps back over the rejected ones, whose slots stay allocated. Every
invariant is checked inside and after every step."""

from __future__ import annotations

import pytest
from helpers import engine

from kvprop.allocator.specs import AllocatorConfig, EngineConfig, FullAttention, Mamba, SlidingWindow, cdiv
from kvprop.check.checker import Checker, drain
from kvprop.search.alphabet import AddRequest
from kvprop.search.execute import execute
from kvprop.search.trace import Trace
from kvprop.sim.events import EV_SPEC_ACCEPT, EV_SPEC_REJECT

PROMPTS = [[0, 1, 2, 3, 0, 1, 2], [3, 3, 1], [2, 0, 2, 0, 2, 0, 2, 0, 1], [1]]


def outputs(speculative_tokens: int, state_group: bool = False):
    """Every request's tokens at the end, run to completion with every check on, and the events."""
    checker = Checker()
    groups = [FullAttention(8), Mamba(8, "align", speculative_tokens)] if state_group else [FullAttention(2)]
    eng = engine(groups, 64, hooks=checker, speculative_tokens=speculative_tokens, token_budget=16)
    requests = [eng.add_request(p, 12) for p in PROMPTS]
    drain(eng, checker)
    return [r.tokens for r in requests], eng.events


@pytest.mark.parametrize("k", [1, 2, 4])
def test_drafts_change_no_output(k):
    """Verification keeps only what decoding would have produced: the outputs with k drafts are
    the outputs without drafts."""
    assert outputs(k)[0] == outputs(0)[0]


@pytest.mark.parametrize("k", [1, 4])
def test_drafts_change_no_output_with_a_state_group(k):
    """The same with a state group: its scratch columns, their moves and the boundary copies
    keep every state the data oracle reads where the worker finds it."""
    assert outputs(k, state_group=True)[0] == outputs(0, state_group=True)[0]


def test_drafts_are_both_accepted_and_rejected():
    events = outputs(4)[1]
    assert (events[EV_SPEC_ACCEPT] > 0, events[EV_SPEC_REJECT] > 0) == (True, True)


def test_rejected_slots_stay_in_the_table():
    """After a rejection, the table still covers the drafts' positions (past the request's tokens)
    and later steps write into those blocks instead of taking new ones."""
    checker = Checker()
    eng = engine([SlidingWindow(1, 3)], 64, hooks=checker, speculative_tokens=4, token_budget=16)
    r = eng.add_request([0, 1, 2, 3], 20)
    surplus = []
    while r.request_id in eng.requests:
        eng.step()
        checker.check_all(eng)
        if r.request_id in eng.requests:
            surplus.append(len(eng.allocator.get_block_ids(r.request_id)[0]) - cdiv(r.num_tokens, 1))
    assert max(surplus) > 0


def test_the_blocks_accepted_tokens_fill_are_cached_after_verification():
    """vLLM's post-output caching with drafts: the cached count covers the computed tokens at once."""
    checker = Checker()
    eng = engine([FullAttention(2)], 64, hooks=checker, speculative_tokens=4, token_budget=16)
    r = eng.add_request([0, 1, 2], 20)
    counts = []
    for _ in range(4):
        eng.step()
        checker.check_all(eng)
        counts.append((eng.view.num_cached_blocks(0, r.request_id), r.num_computed_tokens // 2))
    assert [cached for cached, _ in counts] == [full for _, full in counts]


def test_a_cached_block_holding_a_rejected_draft_is_blamed():
    """With cache_blocks caching past the computed tokens, a verification pass caches the block
    whose last position still holds a rejected draft; the data oracle reads it back. (A prompt
    of two tokens: the block its first output fills is not full, so caching after that output
    reads no unwritten position first.)"""
    config = EngineConfig(AllocatorConfig((FullAttention(2),), 16, True), speculative_tokens=2)
    trace = Trace(config, (AddRequest(0, 0, 2, 1, 6),))
    failure = execute(trace, variant="cache-past-computed")
    assert (failure.kind, "reads -1" in failure.message) == ("data-mismatch", False)
    assert execute(trace) is None
