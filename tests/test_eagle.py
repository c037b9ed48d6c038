"""The EAGLE drop: a hit gives back the block whose last drafter KV depends on the token after it."""

from __future__ import annotations

import pytest
from helpers import prefill, req

from kvprop.allocator.specs import AllocatorConfig, ChunkedLocal, EngineConfig, FullAttention, Mamba, SlidingWindow
from kvprop.errors import ConfigError
from kvprop.search.alphabet import AddLargeRequest, AddRequest
from kvprop.search.execute import execute
from kvprop.search.trace import Trace, config_from_dict, config_to_dict
from kvprop.targets.kvprop import make_allocator

BS = 4
PROMPT = list(range(3 * BS))  # three full blocks


def eagle_allocator(groups, num_blocks=16):
    return make_allocator(AllocatorConfig(tuple(groups), num_blocks, eagle=True))


def hit_after(groups, first, second, num_blocks=16) -> int:
    """The hit ``second`` gets once ``first`` has been computed and cached."""
    mgr = eagle_allocator(groups, num_blocks)
    a = req("A", first, BS)
    prefill(mgr, a)
    mgr.cache_blocks(a, a.num_computed_tokens)
    return mgr.get_computed_blocks(req("B", second, BS))[1]


def test_one_full_attention_group_gives_back_the_last_block_of_its_hit():
    """Three blocks cached, a longer prompt: without the drop the hit is 12 tokens."""
    assert hit_after([FullAttention(BS)], PROMPT, PROMPT + [90, 91]) == 2 * BS


def test_one_group_looks_up_no_further_than_the_last_token_before_dropping():
    """Resending the 12-token prompt: the lookup stops at 11 tokens (2 blocks), then drops one."""
    assert hit_after([FullAttention(BS)], PROMPT, PROMPT) == BS


def test_a_window_needs_one_block_more_than_its_window_then_gives_it_back():
    """Window of 5 tokens: token 8's window needs block 1 (A's block id 2); block 2 must be
    cached too and goes back; block 0 is never attended again (the null block)."""
    mgr = eagle_allocator([SlidingWindow(BS, 5)])
    a = req("A", PROMPT, BS)
    prefill(mgr, a)
    mgr.cache_blocks(a, a.num_computed_tokens)
    hits, num_hit, _ = mgr.get_computed_blocks(req("B", PROMPT + [90], BS))
    assert (num_hit, [b.block_id for b in hits[0]]) == (2 * BS, [0, 2])


def test_two_groups_look_one_block_past_the_candidate_before_dropping():
    """Resending the prompt to full attention and a window: the lookup reaches the hashed 12
    tokens past the 11-token limit, so the drop lands on 8 where one group alone gets 4."""
    groups = [FullAttention(BS), SlidingWindow(BS, 2 * BS)]
    assert hit_after(groups, PROMPT, PROMPT, num_blocks=24) == 2 * BS


@pytest.mark.parametrize(
    "groups, retention, problem",
    [
        ((FullAttention(BS), ChunkedLocal(BS, 2 * BS)), None, "FullAttention and SlidingWindow only"),
        ((Mamba(BS, "align"),), None, "FullAttention and SlidingWindow only"),
        ((FullAttention(BS),) * 3, None, "at most two groups, got 3"),
    ],
)
def test_the_eagle_drop_is_refused_where_it_is_not_modelled(groups, retention, problem):
    with pytest.raises(ConfigError, match=problem):
        AllocatorConfig(groups, 32, eagle=True, retention_interval=retention)


def test_retention_keeps_the_tail_an_eagle_hit_reads_one_block_later():
    """Window of 5 tokens (1 block), interval 0, a 14-token prompt in blocks of 4: a resend
    looks up to 13 tokens, 3 blocks, and drops to 8; its hit reads block 1 (the window) and
    block 2 (past it). A longer sibling looks up to 12, the same blocks. Block 0 goes unhashed."""
    mgr = make_allocator(AllocatorConfig((SlidingWindow(BS, 5),), 16, eagle=True, retention_interval=0))
    a = req("A", list(range(14)), BS)
    prefill(mgr, a)
    mgr.cache_blocks(a, a.num_computed_tokens)
    table = mgr.coordinator.managers[0].req_to_blocks["A"]
    assert [b.key is not None for b in table[:3]] == [False, True, True]


def test_a_trace_keeps_the_eagle_drop():
    config = EngineConfig(AllocatorConfig((FullAttention(BS),), 8, eagle=True))
    assert config_from_dict(config_to_dict(config)).allocator.eagle is True


def test_the_variants_minimised_trace_passes_on_the_correct_allocator():
    """Found by the walker (``kvprop fuzz --variant eagle-keeps-last-block --seed 0``) and
    minimised to two requests: the correct allocator drops the one-token hit."""
    config = EngineConfig(AllocatorConfig((FullAttention(1),), 4, eagle=True), token_budget=1)
    steps = (AddLargeRequest(parent=0, seed=0), AddRequest(parent=0, cut=1, extra=1, seed=0, max_new_tokens=1))
    trace = Trace(config=config, steps=steps, seed=0, driver="walk")
    assert (execute(trace).__class__, execute(trace, variant="eagle-keeps-last-block").kind) == (
        type(None),
        "hit-too-long",
    )
