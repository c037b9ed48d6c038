"""``kvprop bench``'s parts report what they measure in the shape the tables take; figures move
with the machine, so no test here holds one to a value."""

from __future__ import annotations

import pytest

from kvprop.front import bench, choices, find_bench, startup_bench

STARTUP_COLUMNS = ["command", "runs", "min_s", "median_s", "goal", "met"]


def test_the_startup_part_runs_by_default_and_the_parts_keep_their_old_names():
    assert ("startup" in choices.DEFAULT_PARTS, bench.PARTS, bench.DEFAULT_PARTS) == (
        True,
        choices.PARTS,
        choices.DEFAULT_PARTS,
    )


def test_the_startup_part_has_a_row_per_command_that_runs_nothing():
    said: list[str] = []
    rows = startup_bench.rows(quick=True, progress=said.append)
    commands = ["kvprop --help", "kvprop --version", "kvprop targets", "kvprop fuzz --seconds -1"]
    assert ([r["command"] for r in rows], said) == (commands, [f"startup: {c}, 3 processes" for c in commands])
    assert [list(r) for r in rows] == [STARTUP_COLUMNS] * len(rows)
    assert [(r["runs"], r["goal"], r["min_s"] <= r["median_s"]) for r in rows] == [(3, "< 1 s", True)] * len(rows)
    assert [r["met"] for r in rows] == ["yes" if r["median_s"] < startup_bench.GOAL else "no" for r in rows]


def test_a_command_that_exits_otherwise_than_expected_is_not_timed(monkeypatch):
    monkeypatch.setattr(startup_bench, "COMMANDS", ((("--version",), 2),))
    with pytest.raises(RuntimeError, match=r"`kvprop --version` exited 0, not 2"):
        startup_bench.rows(quick=True, progress=lambda text: None)


def test_a_quick_time_to_find_searches_each_variant_once_per_driver_within_its_caps():
    seeds, cap = find_bench.find_caps(quick=True)
    expected = len(find_bench.VARIANTS) * sum(cap[driver] for driver in find_bench.DRIVERS)
    assert (len(seeds), find_bench.time_to_find_bound(quick=True)) == (1, expected)
