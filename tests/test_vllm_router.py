"""Invariant 17 on vLLM's targets: the offloading connector's CPU tier's events reach the router
with their medium, its own lookup answers for it, and the two ways vLLM's stream leaves a set
behind what the engine holds (docs/design.md §4, 17)."""

from __future__ import annotations

import os

import pytest

vllm = __import__("vllm") if os.environ.get("KVPROP_REQUIRE_VLLM") else pytest.importorskip("vllm")

from kvprop.allocator.events import CPU, GPU, Cleared  # noqa: E402
from kvprop.allocator.specs import AllocatorConfig, EngineConfig, FullAttention  # noqa: E402
from kvprop.search import trace as tr  # noqa: E402
from kvprop.search.execute import execute  # noqa: E402
from kvprop.targets import build_engine  # noqa: E402

pytestmark = pytest.mark.vllm


def offloaded():
    """A one-block request through vLLM's scheduler with its offloading connector (sync) and
    events on, finished and stored to the CPU tier; and the events of its two steps. Skips a
    release whose tier's events name no group (0.23.0: the hash alone), which are not judged."""
    allocator = AllocatorConfig((FullAttention(2),), 3, enable_kv_cache_events=True)
    engine = build_engine(EngineConfig(allocator, token_budget=2, connector="sync", vocab=4), target="vllm-scheduler")
    engine.add_request([1, 2], 1)
    engine.step()
    engine.step()
    events = engine.take_kv_events()
    if any(e.medium == CPU and e.key[1] is None for e in events):
        pytest.skip(f"vLLM {vllm.__version__}'s CPU tier names no group in its events")
    return engine, events


def test_the_cpu_tiers_store_reaches_the_router_beside_the_pools_with_its_medium():
    _, events = offloaded()
    assert [(type(e).__name__, e.medium) for e in events] == [("Stored", GPU), ("Stored", CPU)]


def test_the_cpu_tier_answers_by_its_own_lookup():
    engine, events = offloaded()
    tier = engine.offload_tier()
    assert (tier.publishes, tier.holds(events[-1].key), tier.holds((12345, 0))) == (True, True, None)


def test_a_reset_clears_the_pool_and_the_cpu_tier_keeps_its_keys():
    engine, events = offloaded()
    reset = engine.reset_prefix_cache(), engine.take_kv_events()
    assert (reset, engine.offload_tier().holds(events[-1].key)) == ((True, [Cleared()]), True)


def trace(target: str, config: dict, steps: list) -> tr.Trace:
    base = {
        "enable_caching": True,
        "enable_kv_cache_events": True,
        "lookahead": 0,
        "vocab": 4,
        "speculative_tokens": 0,
        "load_failure_policy": "recompute",
    }
    return tr.from_dict(
        {"format": "kvprop-trace/1", "target": target, "config": base | config, "steps": steps, "drain": True}
    )


# Minimised by kvprop from walk seed 0 on the `vllm` target, 0.34.0: one token a step, the second
# request computes the first one's blocks beside it, each block is announced, and the first
# eviction's BlockRemoved leaves a set without a key the other block still holds.
EVERY_COPY = trace(
    "vllm",
    {
        "groups": [{"kind": "full", "block_size": 3}, {"kind": "sliding_window", "block_size": 3, "window": 5}],
        "num_blocks": 9,
        "retention_interval": 0,
        "token_budget": 1,
        "connector": "off",
    },
    [
        {"op": "AddLargeRequest", "parent": 0, "seed": 0},
        {"op": "AddRequest", "parent": 0, "cut": 3, "extra": 1, "seed": 0, "max_new_tokens": 1},
    ],
)

# Minimised by kvprop from walk seed 4 on the `vllm-scheduler` target, 0.34.0: a block stored to
# the CPU tier, then a reset of the prefix cache; its AllBlocksCleared names no medium, so a
# router that clears the worker on it (Dynamo's) forgets the block the CPU tier still serves.
CLEARED_TIER = trace(
    "vllm-scheduler",
    {
        "groups": [{"kind": "full", "block_size": 2}],
        "num_blocks": 3,
        "retention_interval": None,
        "token_budget": 2,
        "connector": "sync",
    },
    [
        {"op": "AddRequest", "parent": 0, "cut": 0, "extra": 2, "seed": 0, "max_new_tokens": 1},
        {"op": "Step", "times": 2},
        {"op": "ResetPrefixCache"},
    ],
)


def test_vllm_announces_every_block_and_a_set_forgets_a_key_one_block_still_holds():
    failure = execute(EVERY_COPY, target="vllm")
    assert (failure.kind, failure.step, "the GPU holds" in failure.message) == ("router-forgets-resident", 2, True)


def test_kvprops_allocator_passes_the_same_walk_and_runs_as_vllms_rule_with_its_variant():
    as_vllm = execute(EVERY_COPY, target=None, variant="announces-every-copy")
    assert (execute(EVERY_COPY, target=None), as_vllm.kind) == (None, "router-forgets-resident")


def test_a_reset_leaves_a_set_without_the_cpu_tiers_keys():
    offloaded()  # a release whose tier's events name their group
    failure = execute(CLEARED_TIER, target="vllm-scheduler")
    assert (failure.kind, failure.step, "the CPU holds" in failure.message) == ("router-forgets-resident", 2, True)
