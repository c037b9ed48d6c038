"""Prefill checkpoints of a state group (docs/design.md §2 "Prefill checkpoints"): a chunk
saves the state at its checkpoint into the column before its running state, the manager
reserves and keys that column, and the scheduler needs no stop there. Blocks of 4 tokens."""

from __future__ import annotations

import pytest
from helpers import NULL, VOCAB, checkpoint_find

from kvprop.allocator.checkpoint import chunk_checkpoint
from kvprop.allocator.hashing import state_fingerprint
from kvprop.allocator.specs import AllocatorConfig, EngineConfig, FullAttention, Mamba
from kvprop.errors import ConfigError
from kvprop.repro.minimise import _simpler_configs
from kvprop.search.execute import execute
from kvprop.search.trace import config_from_dict, config_to_dict
from kvprop.sim.request import Request
from kvprop.targets.kvprop import build_kvprop_engine, make_allocator

BS = 4


def state_allocator(variant=None, hash_unit=None, retention_interval=None, speculative_blocks=0):
    groups = (FullAttention(BS),) if hash_unit else ()
    groups += (Mamba(BS, speculative_blocks=speculative_blocks, checkpoint=1),)
    config = AllocatorConfig(groups, 16, hash_unit=hash_unit, retention_interval=retention_interval)
    return make_allocator(config, variant=variant)


def req(rid, n, unit=None):
    return Request(rid, list(range(n)), 1, BS, VOCAB, unit=unit)


def state_table(mgr, rid):
    return [b.block_id for b in mgr.coordinator.managers[-1].req_to_blocks[rid]]


def compute(mgr, request, n):
    assert mgr.allocate_slots(request, n) is not None
    request.num_computed_tokens += n


@pytest.mark.parametrize(
    ("start", "end", "unit", "alignment", "checkpoint"),
    [
        (0, 11, 2, 1, 10),  # the last unit boundary before the last token
        (0, 11, 2, 5, 10),  # the kernel's grid divides its offset into the chunk
        (0, 11, 2, 3, 0),  # ... or the chunk saves none
        (1, 11, 2, 1, 0),  # a chunk must start on a unit boundary
        (8, 11, 2, 1, 0),  # its column (index 1) must lie past the starting state's (index 1)
        (0, 11, 2, None, 0),  # a kernel without checkpoints
    ],
)
def test_where_a_chunk_saves_a_checkpoint(start, end, unit, alignment, checkpoint):
    assert chunk_checkpoint(start, end, unit, BS, alignment) == checkpoint


def test_the_checkpoint_column_is_keyed_at_the_checkpoint_not_at_its_blocks_end():
    mgr = state_allocator(hash_unit=2)
    a = req("a", 11, unit=2)
    compute(mgr, a, 11)
    block = mgr.pool.blocks[state_table(mgr, "a")[1]]
    assert (state_table(mgr, "a")[0], block.key, block.key_tokens) == (NULL, (a.unit_hashes[4], 1), 10)


def test_with_retention_zero_a_chunk_before_the_prefills_end_reserves_no_column():
    mgr = state_allocator(retention_interval=0)
    compute(mgr, req("a", 20), 12)
    assert state_table(mgr, "a")[:2] == [NULL, NULL]


def test_with_dense_retention_every_chunk_saves_its_checkpoint_at_a_block_boundary():
    mgr = state_allocator()
    a = req("a", 20)
    compute(mgr, a, 12)
    assert mgr.pool.blocks[state_table(mgr, "a")[1]].key == (a.block_hashes[1], 0)


def scratch_case(variant=None):
    """A request with one draft column: chunk [0, 4), then [4, 12), before the prefill's end."""
    mgr = state_allocator(variant=variant, retention_interval=0, speculative_blocks=1)
    a = req("a", 20)
    compute(mgr, a, 4)
    before = state_table(mgr, "a")
    compute(mgr, a, 8)
    return before, state_table(mgr, "a")


def test_a_scratch_column_the_worker_writes_a_checkpoint_into_stays_in_place():
    before, after = scratch_case()
    assert (after[:2], len(after), after[2] in before) == (before, 4, False)


def test_vllm_0_33_moves_that_scratch_block_to_the_running_state():
    before, after = scratch_case("checkpoint-over-running-state")
    assert after[:3] == [before[0], NULL, before[1]]


def chunks(config, prompts, steps, variant=None):
    eng = build_kvprop_engine(config, variant, device="cpu")
    for prompt in prompts[:-1]:
        eng.add_request(prompt, 1)
        while eng.requests:
            eng.step()
    eng.add_request(prompts[-1], 1)
    return [next(iter(eng.step().scheduled.values())) for _ in range(steps)], eng


def hybrid(checkpoint, budget=16):
    groups = (FullAttention(BS), Mamba(BS, checkpoint=checkpoint))
    return EngineConfig(AllocatorConfig(groups, 32, hash_unit=2), token_budget=budget)


@pytest.mark.parametrize(("checkpoint", "expected"), [(None, [8, 2, 1]), (1, [11])])
def test_a_final_chunk_saving_the_prompts_checkpoint_needs_no_stop(checkpoint, expected):
    assert chunks(hybrid(checkpoint), [list(range(11))], len(expected))[0] == expected


def test_the_worker_writes_the_state_at_the_checkpoint_into_its_column():
    eng = build_kvprop_engine(hybrid(1), device="cpu")
    request = eng.add_request(list(range(11)), 2)
    eng.step()
    column = eng.target_calls.get_block_ids(request.request_id)[1][1]
    expected = state_fingerprint(1, 10, request.prefix_at(9))
    assert eng.memory.read([column * BS]) == [expected]


# 'b' hits 'a''s state at 6 tokens, inside block 1; a chunk from 6 saves a checkpoint
SHARED_TAIL = [list(range(7)), [*range(6), *range(50, 60)]]


def test_a_chunk_starting_inside_a_block_still_stops_at_its_boundary():
    assert chunks(hybrid(1), SHARED_TAIL, 2)[0] == [2, 8]


def test_vllm_0_33s_scheduler_runs_such_a_chunk_past_the_boundary():
    assert chunks(hybrid(1), SHARED_TAIL, 1, "checkpoint-chunk-past-block")[0] == [10]


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        ((Mamba(BS, checkpoint=1), Mamba(BS, checkpoint=2)), "every Mamba group must have the same checkpoint"),
    ],
)
def test_the_configuration_refuses_unlike_checkpoints(groups, message):
    with pytest.raises(ConfigError, match=message):
        AllocatorConfig(groups, 16)


def test_a_checkpoint_needs_align_mode():
    with pytest.raises(ConfigError, match="Mamba.checkpoint must be None in mode 'none'"):
        Mamba(BS, "none", checkpoint=1)


def test_a_trace_keeps_the_checkpoint():
    config = hybrid(4)
    assert config_from_dict(config_to_dict(config)) == config


def test_the_minimiser_tries_no_checkpoint_then_the_finest_grid():
    states = [c.allocator.groups[-1] for c in _simpler_configs(hybrid(4)) if c is not None]
    assert [s.checkpoint for s in states if isinstance(s, Mamba) and s.checkpoint != 4] == [None, 1]


def test_the_traces_of_vllm_0_33s_checkpoint_finds_pass_on_kvprops_allocator():
    assert [execute(checkpoint_find(name)) for name in ("over-running-state", "past-block")] == [None, None]


def test_the_variant_with_0_33s_rule_fails_that_finds_trace_on_kvprops_allocator():
    failure = execute(checkpoint_find("over-running-state"), variant="checkpoint-over-running-state")
    assert getattr(failure, "kind", None) == "data-mismatch"
