"""KV cache events (invariant 13): kvprop's pool announces every key it adds or drops, and
the ledger a router would keep ends equal to the cache map."""

from __future__ import annotations

import pytest
from helpers import prefill, req

from kvprop.allocator.events import Cleared, Removed, Stored
from kvprop.allocator.specs import AllocatorConfig, EngineConfig, FullAttention
from kvprop.allocator.view import AllocatorView
from kvprop.check.events import EventLedger
from kvprop.errors import ConfigError, Violation
from kvprop.targets import build_engine
from kvprop.targets.kvprop import make_allocator

FULL = FullAttention(2)


def manager(num_blocks=4):
    return make_allocator(AllocatorConfig((FULL,), num_blocks, enable_kv_cache_events=True))


def test_caching_a_request_announces_each_full_block():
    mgr = manager()
    a = req("a", [1, 2, 3, 4, 5], 2)
    prefill(mgr, a)
    assert mgr.take_events() == [Stored((h, 0)) for h in a.block_hashes]


def test_reusing_a_cached_block_announces_its_removal():
    mgr = manager(num_blocks=3)
    a = req("a", [1, 2, 3], 2)
    prefill(mgr, a)
    mgr.free(a)
    mgr.take_events()
    prefill(mgr, req("b", [7, 8, 9, 9], 2))
    assert mgr.take_events()[0] == Removed((a.block_hashes[0], 0))


def test_a_reset_announces_that_everything_is_cleared():
    mgr = manager()
    prefill(mgr, req("a", [1, 2, 3], 2))
    mgr.free(req("a", [1, 2, 3], 2))
    mgr.take_events()
    assert (mgr.reset_prefix_cache(), mgr.take_events()) == (True, [Cleared()])


def test_events_are_off_by_default():
    mgr = make_allocator(AllocatorConfig((FULL,), 4))
    prefill(mgr, req("a", [1, 2, 3], 2))
    assert mgr.take_events() == []


def test_the_ledger_replays_to_the_cache_map():
    mgr = manager()
    ledger = EventLedger()
    prefill(mgr, req("a", [1, 2, 3, 4, 5], 2))
    ledger.apply(mgr.take_events())
    ledger.compare(AllocatorView(mgr))
    assert sum(ledger.counts.values()) == 2


def test_a_key_cached_without_an_event_diverges():
    mgr = manager()
    prefill(mgr, req("a", [1, 2, 3], 2))
    with pytest.raises(Violation, match="events-diverge: replaying the KV cache events gives 0 block"):
        EventLedger().compare(AllocatorView(mgr))


def test_a_target_that_does_not_declare_kv_events_cannot_run_with_events_on():
    config = EngineConfig(AllocatorConfig((FULL,), 4, enable_kv_cache_events=True))
    with pytest.raises(ConfigError, match="does not declare kv_events"):
        build_engine(config, target="tests.example_target:make_target_without_events")
