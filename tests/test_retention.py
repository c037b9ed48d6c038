"""Prefix-cache retention (docs/design.md §8.3): which sliding-window blocks get a hash, in
kvprop's allocator and in the contract the checker holds every target to."""

from __future__ import annotations

import pytest
from helpers import allocator, prefill, req
from hypothesis import given
from hypothesis import strategies as st

from kvprop.allocator.retention import kept_block_mask, kept_state_mask
from kvprop.allocator.specs import AllocatorConfig, ChunkedLocal, FullAttention, Mamba, SlidingWindow
from kvprop.check.retention import retained_indices
from kvprop.errors import ConfigError

SWA = SlidingWindow(4, 8)  # a hit needs the 2 blocks before its end


class Prompt:
    def __init__(self, num_prompt_tokens, shared_prefix_boundary=0):
        self.num_prompt_tokens = num_prompt_tokens
        self.shared_prefix_boundary = shared_prefix_boundary


def kept(spec, interval, prompt, n=8):
    boundaries = [prompt.num_prompt_tokens - 1] + [prompt.shared_prefix_boundary] * bool(prompt.shared_prefix_boundary)
    return [i for i, k in enumerate(kept_block_mask(spec, interval, boundaries, 0, n)) if k]


def test_dense_retention_hashes_every_block():
    assert kept(SWA, None, Prompt(33)) == list(range(8))


def test_dense_retention_hashes_nothing_for_a_one_token_window():
    assert kept(SlidingWindow(4, 1), None, Prompt(33)) == []


def test_interval_zero_keeps_only_the_tail_before_the_prompts_last_block_boundary():
    assert kept(SWA, 0, Prompt(25)) == [4, 5]  # token 24 -> boundary at block 6


def test_interval_zero_also_keeps_the_tail_before_the_junction():
    assert kept(SWA, 0, Prompt(25, shared_prefix_boundary=12)) == [1, 2, 4, 5]


def test_a_positive_interval_keeps_a_tail_before_each_multiple():
    assert kept(SWA, 16, Prompt(2)) == [2, 3, 6, 7]


def test_an_interval_no_longer_than_the_tail_keeps_everything():
    assert kept(SWA, 8, Prompt(2)) == list(range(8))


@given(
    block_size=st.sampled_from([1, 2, 3, 4, 8]),
    window=st.integers(1, 40),
    per=st.one_of(st.none(), st.integers(0, 6)),
    prompt=st.integers(1, 80),
    junction_blocks=st.integers(0, 20),
    n=st.integers(0, 30),
)
def test_the_allocators_mask_is_the_checkers_contract(block_size, window, per, prompt, junction_blocks, n):
    spec = SlidingWindow(block_size, window)
    interval = None if per is None else per * block_size
    request = Prompt(prompt, junction_blocks * block_size)
    retained = retained_indices(spec, interval, request, n)
    expected = list(range(n)) if retained is None else sorted(retained)
    assert kept(spec, interval, request, n) == expected


def test_the_contract_leaves_full_and_chunked_groups_dense():
    assert [retained_indices(s, 0, Prompt(9), 4) for s in (FullAttention(4), ChunkedLocal(4, 8))] == [None, None]


def test_a_thinned_request_counts_unhashed_blocks_as_cached():
    mgr = allocator([SWA], 16, retention_interval=0)
    r = req("r", range(25), 4)
    prefill(mgr, r)
    table = mgr.coordinator.managers[0].req_to_blocks["r"]
    assert (mgr.coordinator.managers[0].num_cached_block["r"], [b.key is not None for b in table]) == (
        6,
        [False, False, False, False, True, True, False],
    )


def test_a_replay_of_a_thinned_prompt_still_hits_at_its_boundary():
    mgr = allocator([SWA], 16, retention_interval=0)
    prefill(mgr, req("a", range(25), 4))
    assert mgr.get_computed_blocks(req("b", range(25), 4))[1] == 24


def test_the_junction_is_the_longest_group_hit_beyond_the_final_one():
    mgr = allocator([FullAttention(4), SWA], 32, retention_interval=0)
    prefill(mgr, req("a", range(25), 4))  # full caches 6 blocks; the window only blocks 4, 5
    b = req("b", [*range(16), 99, 98, 97, 96, 95], 4)  # shares 4 blocks; no window tail ends there
    assert mgr.get_computed_blocks(b)[1:] == (0, 16)


def test_a_junction_makes_the_next_request_keep_the_tail_before_it():
    mgr = allocator([FullAttention(4), SWA], 32, retention_interval=0)
    prefill(mgr, req("a", range(25), 4))
    prefill(mgr, req("b", [*range(16), 99, 98, 97, 96, 95], 4))
    c = req("c", [*range(16), 7, 7, 7, 7, 7], 4)
    assert mgr.get_computed_blocks(c)[1] == 16


@pytest.mark.parametrize(
    "groups, interval, allowed",
    [
        ((FullAttention(4),), 0, True),
        ((FullAttention(4),), 4, False),
        ((SWA,), 12, True),
        ((SWA,), 6, False),
        ((SWA,), -4, False),
    ],
)
def test_retention_values_follow_vllms_rule(groups, interval, allowed):
    try:
        AllocatorConfig(groups, 8, retention_interval=interval)
    except ConfigError:
        assert not allowed
    else:
        assert allowed


@given(
    block_size=st.sampled_from([1, 2, 4, 8]),
    per=st.one_of(st.none(), st.integers(0, 6)),
    prompt=st.integers(1, 80),
    junction_blocks=st.integers(0, 20),
    n=st.integers(0, 30),
)
def test_the_state_groups_mask_is_the_checkers_contract(block_size, per, prompt, junction_blocks, n):
    spec = Mamba(block_size)
    interval = None if per is None else per * block_size
    request = Prompt(prompt, junction_blocks * block_size)
    boundaries = [prompt - 1] + [request.shared_prefix_boundary] * bool(junction_blocks)
    mask = kept_state_mask(spec, interval, boundaries, 0, n)
    retained = retained_indices(spec, interval, request, n)
    expected = list(range(n)) if retained is None else sorted(retained)
    assert [i for i in range(n) if mask is None or mask[i]] == expected
