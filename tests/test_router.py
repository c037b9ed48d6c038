"""A KV-aware router's view of the KV cache events (invariant 17): a set of (key, medium), which
kvprop's pool keeps exact and vLLM's per-block announcements do not."""

from __future__ import annotations

import attrs
import pytest

from kvprop.allocator.block_pool import BlockPool
from kvprop.allocator.events import CPU, Cleared, Reannounced, Removed, Stored
from kvprop.check.events import EventLedger
from kvprop.check.router import RouterView
from kvprop.errors import Violation
from kvprop.search.walk import run_walk
from kvprop.targets.variants import AnnouncesEveryCopyPool

KEY = (7, 0)


def twice_cached(pool_class=BlockPool) -> tuple:
    """A pool of four usable blocks whose blocks 1 and 2 are both cached under KEY and free,
    queued 3, 4, 1, 2; the events so far taken."""
    pool = pool_class(5, enable_events=True)
    one, two = pool.get_new_blocks(2)
    pool.cache_block(one, *KEY)
    pool.cache_block(two, *KEY)
    pool.free_blocks([one, two])
    return pool, pool.take_events()


@attrs.frozen
class Map:
    """A view of a cache map: key -> blocks under it."""

    counts: dict

    def cache_map_items(self):
        return [(key, block) for key, n in self.counts.items() for block in range(n)]

    def cache_count(self, key) -> int:
        return self.counts.get(key, 0)


@attrs.frozen
class Tier:
    keys: frozenset
    publishes: bool = True

    def holds(self, key) -> bool:
        return key in self.keys


def judged(events, view, tier=None, named=None) -> str | None:
    router = RouterView()
    router.apply(events)
    try:
        router.judge(view, tier, named)
    except Violation as e:
        return e.kind
    return None


# ---- kvprop's pool: a key is announced when it enters the map and when it leaves ----------


def test_a_key_two_blocks_hold_is_announced_stored_once():
    assert twice_cached()[1] == [Stored(KEY)]


def test_evicting_one_of_two_blocks_under_a_key_announces_nothing():
    pool, _ = twice_cached()
    pool.get_new_blocks(3)  # blocks 3, 4 and 1
    assert pool.take_events() == []


def test_evicting_the_last_block_under_a_key_announces_it_removed():
    pool, _ = twice_cached()
    pool.get_new_blocks(4)
    assert pool.take_events() == [Removed(KEY)]


def test_vllms_rule_announces_every_block_stored_and_every_eviction():
    pool, stored = twice_cached(AnnouncesEveryCopyPool)
    pool.get_new_blocks(3)
    assert (stored, pool.take_events()) == ([Stored(KEY), Stored(KEY)], [Removed(KEY)])


# ---- the router's set --------------------------------------------------------------------


def test_stored_twice_and_removed_once_a_set_forgets_what_a_count_keeps():
    events = [Stored(KEY), Stored(KEY), Removed(KEY)]
    ledger = EventLedger()
    ledger.apply(events)
    ledger.compare(Map({KEY: 1}))  # invariant 13 holds: one block, counted once
    assert judged(events, Map({KEY: 1})) == "router-forgets-resident"


def test_a_set_replaying_kvprops_pool_holds_the_key_one_block_keeps():
    pool, stored = twice_cached()
    pool.get_new_blocks(3)
    assert judged([*stored, *pool.take_events()], Map({KEY: 1})) is None


def test_a_hit_announced_again_is_a_store_to_the_router():
    assert judged([Reannounced(KEY)], Map({})) == "router-advertises-absent"


def test_all_cleared_forgets_every_medium():
    router = RouterView()
    router.apply([Stored(KEY), Stored(KEY, CPU), Cleared()])
    assert router.held == set()


def test_a_key_the_cpu_tier_does_not_hold_is_advertised_absent():
    assert judged([Stored(KEY, CPU)], Map({}), Tier(frozenset())) == "router-advertises-absent"


def test_a_key_the_cpu_tier_kept_through_an_all_cleared_is_forgotten():
    events = [Stored(KEY, CPU), Cleared()]
    assert judged(events, Map({}), Tier(frozenset({KEY}))) == "router-forgets-resident"


def test_a_tier_that_announces_nothing_is_not_held_to_what_it_holds():
    events = [Stored(KEY, CPU), Cleared()]
    assert judged(events, Map({}), Tier(frozenset({KEY}), publishes=False)) is None


def test_without_a_tier_the_cpu_keys_are_not_judged():
    assert judged([Stored(KEY, CPU)], Map({})) is None


def test_incrementally_only_the_named_keys_are_judged():
    events = [Stored(KEY), Stored(KEY), Removed(KEY)]
    view = Map({KEY: 1, (8, 0): 1})  # (8, 0) never announced: judged at the next full sweep
    assert (judged(events, view, named={}), judged(events, view, named={"GPU": {KEY}})) == (
        None,
        "router-forgets-resident",
    )


# ---- the correct allocator, and vLLM's rule, in walks ----------------------------------------

CLEAN_WALKS = 300  # walks 0..299: 141 of them with events on, 16,839 of their steps (37,128 in all)


def test_the_correct_allocator_keeps_a_routers_set_exact_over_the_walks():
    results = [run_walk(seed) for seed in range(CLEAN_WALKS)]
    with_events = [r for r in results if r.trace.config.allocator.enable_kv_cache_events]
    assert ([r.failure for r in results if r.failure], sum(r.steps_run for r in with_events) > 10_000) == ([], True)


@pytest.mark.parametrize("guards", [True, False], ids=["guards", "no-guards"])
def test_a_walk_finds_vllms_rule_as_a_forgotten_key(guards, monkeypatch):
    from kvprop.allocator import guards as allocator_guards

    monkeypatch.setattr(allocator_guards, "ENABLED", guards)
    failure = run_walk(0, variant="announces-every-copy").failure
    assert (failure.origin, failure.kind) == ("violation", "router-forgets-resident")
