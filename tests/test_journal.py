"""The journal read while its worker writes it: where a run is, for the call timeout that applies."""

from __future__ import annotations

import pytest

from kvprop.search.journal import building
from kvprop.search.supervisor import START_GRACE, hung_for

HEADER = 'run {"index": 0, "trace": {}}\n'


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", False),
        (HEADER, True),
        (HEADER[:12], True),  # the header half written
        (HEADER + "built\n", False),
        (HEADER + "built\nop AddRequest 1 2", False),  # an operation half written
        (HEADER + "drain\n", False),
    ],
    ids=["empty", "header", "half-header", "built", "half-operation", "drain"],
)
def test_a_run_is_building_until_its_journal_says_built(tmp_path, text, expected):
    path = tmp_path / "journal"
    path.write_text(text)
    assert building(path) == expected


def test_a_worker_building_its_target_is_held_to_the_build_timeout(tmp_path):
    path = tmp_path / "journal"
    path.write_text(HEADER)
    written = path.stat().st_mtime
    assert hung_for(path, written, written + 30, call_timeout=10, build_timeout=60) is None


def test_a_worker_in_an_operation_is_held_to_the_call_timeout(tmp_path):
    path = tmp_path / "journal"
    path.write_text(HEADER + "built\nop Step 1\n")
    written = path.stat().st_mtime
    assert hung_for(path, written, written + 30, call_timeout=10, build_timeout=60) == pytest.approx(30, abs=1)


def test_a_worker_before_its_first_run_is_held_to_the_start_grace(tmp_path):
    path = tmp_path / "journal"
    path.write_text("")
    assert hung_for(path, 0.0, START_GRACE - 1, call_timeout=1, build_timeout=1) is None
