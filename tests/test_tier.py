"""The external tier's capacity and eviction policies (kvprop.sim.tier_policy, kvprop.sim.connector)."""

import pytest

from kvprop.allocator.specs import AllocatorConfig, EngineConfig, FullAttention
from kvprop.errors import ConfigError
from kvprop.sim.connector import Connector, PendingLoad
from kvprop.sim.memory import PagedMemory
from kvprop.sim.tier_policy import AdaptiveReplacement, LeastRecentlyUsed


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
