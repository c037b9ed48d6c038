"""The full KV cache report (docs/design.md §2, KV cache events): a request that asks for it
has its hit announced again, one event per real hit block, and a router replaying the events
must hold every key announced again (invariant 13)."""

from __future__ import annotations

import pytest
from helpers import report_find

from kvprop.allocator.events import Reannounced, Stored
from kvprop.allocator.specs import AllocatorConfig, EngineConfig, FullAttention, SlidingWindow
from kvprop.check.events import EventLedger
from kvprop.errors import ConfigError, Violation
from kvprop.search.execute import execute
from kvprop.search.trace import config_from_dict, config_to_dict
from kvprop.sim.request import Request
from kvprop.targets.kvprop import make_allocator

BS = 2
GROUPS = (FullAttention(BS), SlidingWindow(BS, 2))


def allocator(variant=None):
    config = AllocatorConfig(GROUPS, 16, enable_kv_cache_events=True, kv_cache_report_mode="full")
    return make_allocator(config, variant=variant)


def lookup_events(variant=None):
    """'a' computes 6 tokens; 'b', the same 6 and one more, looks its 6 up."""
    mgr = allocator(variant)
    a = Request("a", list(range(6)), 1, BS, 1000)
    assert mgr.allocate_slots(a, 6) is not None
    a.num_computed_tokens = 6
    mgr.take_events()
    b = Request("b", [*range(6), 9], 1, BS, 1000)
    hits, num_hit, _ = mgr.get_computed_blocks(b)
    return b, mgr.take_events()


def test_a_hit_is_announced_again_block_by_block_where_a_group_holds_one():
    b, events = lookup_events()
    full = [Reannounced((h, 0)) for h in b.block_hashes]
    window = [Reannounced((b.block_hashes[2], 1))]  # the window's hit: nulls, then its last block
    assert events == full + window


def test_vllms_rule_announces_the_windows_skipped_positions_too():
    b, events = lookup_events("reannounces-every-position")
    assert events[3:] == [Reannounced((h, 1)) for h in b.block_hashes]


def test_a_key_announced_again_changes_nothing_a_router_holds():
    ledger = EventLedger()
    ledger.apply([Stored(("h", 0)), Reannounced(("h", 0))])
    assert dict(ledger.counts) == {("h", 0): 1}


def test_a_key_announced_again_that_no_event_stored_is_a_violation():
    with pytest.raises(Violation, match="events-reannounce-unheld"):
        EventLedger().apply([Reannounced(("h", 1))])


def test_the_full_report_needs_events():
    with pytest.raises(ConfigError, match="'full' needs enable_kv_cache_events=True"):
        AllocatorConfig(GROUPS, 16, kv_cache_report_mode="full")


@pytest.mark.parametrize("name", ["skipped-positions", "inside-a-block"])
def test_the_traces_of_vllms_full_report_finds_pass_on_kvprops_allocator(name):
    assert execute(report_find(name)) is None


def test_a_trace_keeps_the_report_mode():
    config = EngineConfig(AllocatorConfig(GROUPS, 16, enable_kv_cache_events=True, kv_cache_report_mode="full"))
    assert config_from_dict(config_to_dict(config)) == config
