"""The external tier's capacity, eviction policies and chunks (kvprop.sim.tier_policy, kvprop.sim.connector,
kvprop.targets.vllm.offload)."""

import attrs
import pytest
from helpers import engine

from kvprop.allocator.specs import AllocatorConfig, EngineConfig, FullAttention
from kvprop.errors import ConfigError
from kvprop.sim.connector import Connector, PendingLoad
from kvprop.sim.memory import PagedMemory
from kvprop.sim.tier_policy import AdaptiveReplacement, LeastRecentlyUsed
from kvprop.targets.vllm.offload import transfer_from


def idle(key) -> bool:
    return True


def test_lru_evicts_the_least_recently_used():
    lru = LeastRecentlyUsed(3)
    for key in "abc":
        lru.insert(key)
    lru.touch("a")
    assert lru.evict(2, idle) == ["b", "c"]


def test_lru_skips_a_busy_key():
    lru = LeastRecentlyUsed(3)
    for key in "abc":
        lru.insert(key)
    assert lru.evict(1, lambda key: key != "a") == ["b"]


def test_an_eviction_short_of_idle_keys_changes_nothing():
    lru = LeastRecentlyUsed(3)
    for key in "abc":
        lru.insert(key)
    assert (lru.evict(2, lambda key: key == "c"), lru.evict(3, idle)) == (None, ["a", "b", "c"])


def test_arc_evicts_a_key_seen_once_before_one_seen_again():
    arc = AdaptiveReplacement(3)
    for key in "abc":
        arc.insert(key)
    arc.touch("a")
    assert arc.evict(1, idle) == ["b"]


def test_arc_remembers_what_it_evicted_and_grows_the_recent_list_on_its_return():
    arc = AdaptiveReplacement(3)
    for key in "ab":
        arc.insert(key)
    arc.evict(1, idle)
    arc.insert("a")
    assert (arc.target, list(arc.t1), list(arc.b1)) == (1.0, ["b", "a"], [])


def test_arc_takes_from_the_frequent_list_while_the_recent_one_is_below_its_target():
    arc = AdaptiveReplacement(4)
    for key in "ab":
        arc.insert(key)
    arc.touch("a")  # T1 holds b, T2 a
    arc.target = 2.0
    assert arc.evict(1, idle) == ["a"]


def connector(capacity: int | None, mode: str = "sync", policy: str = "lru") -> Connector:
    return Connector(mode, PagedMemory(8, 2, "cpu"), 2, 1, capacity=capacity, policy=policy)


def held(tier: Connector) -> list:
    return sorted((block_hash, group) for block_hash, rows in tier.tier.items() for group in rows)


def test_a_full_tier_evicts_its_oldest_block_for_a_save():
    tier = connector(2)
    tier.offload([(10, 0, 1), (11, 0, 2)])
    tier.offload([(12, 0, 3)])
    assert held(tier) == [(11, 0), (12, 0)]


def test_an_unbounded_tier_keeps_every_save():
    tier = connector(None)
    tier.offload([(10, 0, 1), (11, 0, 2), (12, 0, 3)])
    assert held(tier) == [(10, 0), (11, 0), (12, 0)]


def test_a_block_a_load_reads_is_not_evicted():
    tier = connector(2)
    tier.offload([(10, 0, 1), (11, 0, 2)])
    tier.pending["r"] = PendingLoad("r", [], [], [], keys=frozenset({(10, 0)}))
    tier.offload([(12, 0, 3)])
    assert held(tier) == [(10, 0), (12, 0)]


def test_a_save_with_too_few_idle_blocks_is_dropped_whole():
    tier = connector(2, mode="async")
    tier.offload([(10, 0, 1), (11, 0, 2)])
    tier.offload([(12, 0, 3)])
    assert (sorted(tier.saving), tier.num_saves) == ([(10, 0), (11, 0)], 1)


def test_a_failed_save_gives_its_room_back():
    tier = connector(1, mode="async")
    tier.offload([(10, 0, 1)])
    tier.finish_save(0, ok=False)
    tier.offload([(11, 0, 2)])
    tier.finish_save(1, ok=True)
    assert held(tier) == [(11, 0)]


def test_a_tier_setting_without_a_connector_is_refused():
    with pytest.raises(ConfigError, match="tier_blocks must be null"):
        EngineConfig(AllocatorConfig((FullAttention(2),), 8), tier_blocks=4)


def test_an_unknown_tier_policy_is_refused():
    with pytest.raises(ConfigError, match=r"tier_policy must be one of \['lru', 'arc'\]"):
        EngineConfig(AllocatorConfig((FullAttention(2),), 8), connector="async", tier_policy="lfu")


def test_a_chunk_setting_without_a_connector_is_refused():
    with pytest.raises(ConfigError, match="tier_chunk must be 1 with connector 'off'"):
        EngineConfig(AllocatorConfig((FullAttention(2),), 8), tier_chunk=2)


def test_a_tier_smaller_than_a_chunk_is_refused():
    with pytest.raises(ConfigError, match="tier_blocks must hold one chunk at least: 1 blocks in chunks of 2"):
        EngineConfig(AllocatorConfig((FullAttention(2),), 8), connector="async", tier_blocks=1, tier_chunk=2)


def test_kvprops_own_tier_refuses_chunks():
    with pytest.raises(ConfigError, match="tier_chunk must be 1 for kvprop's own tier"):
        engine([FullAttention(2)], 8, connector="async", tier_chunk=2)


@attrs.frozen
class Spec:
    """One side of a transfer as vLLM's offloading connector lists it (``GPULoadStoreSpec``:
    block ids, each group's count and the logical index of its first block; the CPU side's
    ``block_ids`` are chunks)."""

    block_ids: tuple
    group_sizes: tuple = ()
    block_indices: tuple = ()


@attrs.frozen
class Job:
    req_id: str
    src_spec: Spec
    dst_spec: Spec


def test_a_store_takes_each_groups_chunks_in_turn():
    """A 0.34.0 store of three groups in chunks of 2 blocks, the first two from logical block 4,
    the third from block 2: each group fills whole chunks of its own."""
    gpu = Spec((11, 12, 14, 15, 9, 16, 17, 18), (2, 2, 4), (4, 4, 2))
    transfer = transfer_from(7, Job("r0", gpu, Spec((1, 2, 3, 4))), load=False, blocks_per_chunk=2)
    assert (transfer.gpu, transfer.cpu) == (
        [(0, 11), (0, 12), (1, 14), (1, 15), (2, 9), (2, 16), (2, 17), (2, 18)],
        [(1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1), (4, 0), (4, 1)],
    )


def test_a_load_from_inside_a_chunk_skips_the_blocks_before_it():
    """A 0.34.0 load whose second group starts at logical block 5, the second block of its chunk
    of 2: its first block is that chunk's second, and its next one starts the next chunk."""
    gpu = Spec((14, 13, 6, 5), (1, 2, 1), (6, 5, 6))
    transfer = transfer_from(3, Job("r3", Spec((6, 2, 7, 5)), gpu), load=True, blocks_per_chunk=2)
    assert (transfer.gpu, transfer.cpu) == ([(0, 14), (1, 13), (1, 6), (2, 5)], [(6, 0), (2, 1), (7, 0), (5, 0)])
