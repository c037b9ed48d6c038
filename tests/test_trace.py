"""The trace format: durable across the driver rename, strict on every field."""

from __future__ import annotations

import json

import pytest

from kvprop.search import trace as tr
from kvprop.search.walk import plan


def written_before_the_rename() -> dict:
    """A trace as kvprop wrote it before the search driver was called ``driver``."""
    data = tr.to_dict(plan(3))
    data["engine"] = data.pop("driver")
    data["failure"] = {"step": 2, "kind": "block-in-two-groups", "message": "block 6 is live in groups [0, 2]"}
    return data


def test_an_old_trace_naming_its_engine_still_reads():
    trace = tr.from_dict(json.loads(json.dumps(written_before_the_rename())))
    assert (trace.driver, trace.steps, trace.failure.origin) == ("walk", plan(3).steps, "violation")


def test_a_trace_round_trips_through_json():
    trace = plan(5)
    assert tr.from_dict(json.loads(json.dumps(tr.to_dict(trace)))) == trace


def test_an_unknown_driver_is_refused_with_the_allowed_ones():
    data = tr.to_dict(plan(3))
    data["driver"] = "engine"
    with pytest.raises(tr.TraceError, match=r"driver: expected one of \['walk', 'hypothesis'\], got 'engine'"):
        tr.from_dict(data)


def test_an_unknown_field_is_refused():
    data = tr.to_dict(plan(3))
    data["comment"] = "hello"
    with pytest.raises(tr.TraceError, match=r"unknown field\(s\) comment; allowed"):
        tr.from_dict(data)


def test_a_trace_written_before_retention_and_events_reads_as_dense_without_events():
    data = tr.to_dict(plan(3))
    del data["config"]["retention_interval"], data["config"]["enable_kv_cache_events"]
    allocator = tr.from_dict(data).config.allocator
    assert (allocator.retention_interval, allocator.enable_kv_cache_events) == (None, False)


def test_a_trace_written_before_drafts_reads_without_drafts():
    data = tr.to_dict(plan(3))
    del data["config"]["speculative_tokens"]
    for group in data["config"]["groups"]:
        group.pop("speculative_blocks", None)
    config = tr.from_dict(data).config
    assert (config.speculative_tokens, [getattr(g, "speculative_blocks", 0) for g in config.allocator.groups]) == (
        0,
        [0] * len(config.allocator.groups),
    )


def test_a_retention_interval_of_the_wrong_type_is_refused():
    data = tr.to_dict(plan(3))
    data["config"]["retention_interval"] = "0"
    with pytest.raises(tr.TraceError, match=r"config.retention_interval: expected int or null, got '0'"):
        tr.from_dict(data)


def test_a_trace_written_before_the_failure_policy_and_the_observers_reads_with_the_old_behaviour():
    data = tr.to_dict(plan(3))
    for field in ("load_failure_policy", "log_stats", "kv_cache_metrics"):
        del data["config"][field]
    config = tr.from_dict(data).config
    assert (config.load_failure_policy, config.allocator.log_stats, config.allocator.kv_cache_metrics) == (
        "recompute",
        True,
        False,
    )


def test_an_unknown_failure_policy_is_refused_with_the_allowed_ones():
    data = tr.to_dict(plan(3))
    data["config"]["load_failure_policy"] = "retry"
    with pytest.raises(tr.TraceError, match=r"load_failure_policy must be one of \['recompute', 'fail'\], got 'retry'"):
        tr.from_dict(data)
