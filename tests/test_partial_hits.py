"""Hits inside a block (docs/design.md §2 "Hits inside a block"): with a hash unit below the
block size, the prompt's last unit boundary is keyed inside its block, a later request hits
there and gets a copy of the shared block, and the request that keyed a state block moves the
key onto a copy of it. Blocks of 4 tokens, a hash unit of 2: a 7-token prompt ends its last
unit boundary at 6, inside block index 1."""

from __future__ import annotations

import pytest
from helpers import NULL, VOCAB

from kvprop.allocator.specs import AllocatorConfig, EngineConfig, FullAttention, Mamba, SlidingWindow
from kvprop.errors import ConfigError
from kvprop.sim.request import Request
from kvprop.targets.kvprop import make_allocator

BS, UNIT = 4, 2


def fine_allocator(num_blocks=16):
    return make_allocator(AllocatorConfig((FullAttention(BS), Mamba(BS)), num_blocks, hash_unit=UNIT))


def req(rid, tokens):
    return Request(rid, list(tokens), 4, BS, VOCAB, unit=UNIT)


def table(mgr, rid, group):
    return [b.block_id for b in mgr.coordinator.managers[group].req_to_blocks[rid]]


def admit(mgr, request, num_new):
    hits, num_hit, _ = mgr.get_computed_blocks(request)
    result = mgr.allocate_slots(request, num_new, num_new_computed_tokens=num_hit, new_computed_blocks=hits)
    assert result is not None
    request.num_computed_tokens = num_hit + num_new
    return hits, num_hit


def producer(mgr):
    """'a' computes its 7-token prompt up to the last unit boundary, 6: full attention takes
    blocks 1 and 2, the state group [NULL, 3]."""
    a = req("a", range(7))
    admit(mgr, a, 6)
    mgr.new_step_starts()
    return a


def test_the_unit_hashes_chain_per_unit_and_a_block_hash_is_the_one_at_its_end():
    a = req("a", range(8))
    assert (len(a.unit_hashes), a.block_hashes) == (4, [a.unit_hashes[1], a.unit_hashes[3]])


def test_full_attention_keys_the_prompt_tail_inside_its_block():
    mgr = fine_allocator()
    a = producer(mgr)
    block = mgr.pool.blocks[2]
    assert (table(mgr, "a", 0), block.key, block.key_tokens) == ([1, 2], (a.unit_hashes[2], 0), 6)


def test_the_state_group_keys_its_running_block_at_the_tail_and_leaves_it_uncounted():
    mgr = fine_allocator()
    a = producer(mgr)
    state = mgr.coordinator.managers[1]
    assert (table(mgr, "a", 1), mgr.pool.blocks[3].key, state.num_cached_block["a"]) == (
        [NULL, 3],
        (a.unit_hashes[2], 1),
        1,
    )


def test_a_request_sharing_the_tail_hits_inside_the_block():
    mgr = fine_allocator()
    producer(mgr)
    hits, num_hit, _ = mgr.get_computed_blocks(req("b", [*range(6), 99, 98]))
    assert ([[b.block_id for b in group] for group in hits], num_hit) == ([[1, 2], [NULL, 3]], 6)


def test_a_hit_inside_a_block_puts_a_copy_of_it_in_the_table():
    mgr = fine_allocator()
    producer(mgr)
    admit(mgr, req("b", [*range(6), 99, 98]), 2)
    assert (table(mgr, "b", 0), table(mgr, "b", 1)) == ([1, 4], [NULL, 5])


def test_the_copies_hold_both_ends_until_the_scheduler_takes_them():
    mgr = fine_allocator()
    producer(mgr)
    admit(mgr, req("b", [*range(6), 99, 98]), 2)
    before = [mgr.pool.blocks[b].ref_cnt for b in (2, 4, 3, 5)]
    copies = mgr.take_kv_cache_block_copies()
    after = [mgr.pool.blocks[b].ref_cnt for b in (2, 4, 3, 5)]
    assert (copies, before, after) == ([(2, 4), (3, 5)], [2, 2, 2, 2], [1, 1, 1, 1])


def test_the_copy_is_counted_when_the_capacity_is_checked():
    mgr = fine_allocator(num_blocks=6)  # 5 usable: a holds 3, so 2 are free for b's two copies
    producer(mgr)
    b = req("b", [*range(6), 99, 98])
    hits, num_hit, _ = mgr.get_computed_blocks(b)
    assert mgr.allocate_slots(b, 2, num_new_computed_tokens=num_hit, new_computed_blocks=hits) is not None


def test_the_producer_moves_its_state_key_onto_a_copy_and_keeps_writing_its_block():
    mgr = fine_allocator()
    a = producer(mgr)
    assert mgr.allocate_slots(a, 1) is not None
    blocks = mgr.pool.blocks
    assert (table(mgr, "a", 1), blocks[3].key, blocks[4].key, mgr.take_kv_cache_block_copies()) == (
        [NULL, 3],
        None,
        (a.unit_hashes[2], 1),
        [(3, 4)],
    )


def test_a_full_block_is_promoted_to_its_full_key_and_keeps_the_tail_as_a_further_key():
    mgr = fine_allocator()
    a = req("a", [*range(7), 7])
    a.num_prompt_tokens = 7  # the prompt ends at 7; the eighth token was decoded
    admit(mgr, a, 6)
    mgr.new_step_starts()
    assert mgr.allocate_slots(a, 2) is not None
    block = mgr.pool.blocks[2]
    assert (block.key, block.key_tokens, mgr.pool.keys_of(block)[1:]) == (
        (a.block_hashes[1], 0),
        8,
        [(a.unit_hashes[2], 0)],
    )


def test_a_second_key_inside_a_cached_block_joins_its_further_keys():
    mgr = fine_allocator()
    pool = mgr.pool
    block = pool.get_new_blocks(1)[0]
    pool.cache_block(block, 111, 0, 4)
    pool.cache_partial(block, 222, 0, 2)
    assert (pool.keys_of(block), pool.get_cached_block(222, 0) is block) == ([(111, 0), (222, 0)], True)


def test_eviction_drops_every_key_of_a_block():
    mgr = make_allocator(AllocatorConfig((FullAttention(BS), Mamba(BS)), 2, hash_unit=UNIT))
    pool = mgr.pool
    block = pool.get_new_blocks(1)[0]
    pool.cache_block(block, 111, 0, 4)
    pool.cache_partial(block, 222, 0, 2)
    pool.free_blocks([block])
    pool.get_new_blocks(1)
    assert (pool.cached, pool.extra_keys, block.key) == ({}, {}, None)


@pytest.mark.parametrize(
    ("groups", "unit", "why"),
    [
        ((FullAttention(4), Mamba(4)), 3, "divisor of block_size=4"),
        ((Mamba(4),), 2, "at least two groups"),
        ((SlidingWindow(4, 4), Mamba(4)), 2, "every other one FullAttention"),
        ((FullAttention(4), FullAttention(4)), 2, "a Mamba group"),
    ],
)
def test_a_hash_unit_vllm_cannot_use_is_refused_with_the_rule(groups, unit, why):
    with pytest.raises(ConfigError, match=why):
        AllocatorConfig(groups, 16, hash_unit=unit)


def test_a_connector_with_hits_inside_a_block_is_refused():
    allocator = AllocatorConfig((FullAttention(4), Mamba(4)), 16, hash_unit=2)
    with pytest.raises(ConfigError, match="connector must be 'off'"):
        EngineConfig(allocator, connector="async")
