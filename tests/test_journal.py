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


class _SizeAfterEachCall:
    """The journal's file, recording the size on disk after each call the journal makes."""

    def __init__(self, file, path):
        self.file, self.path, self.sizes = file, path, []

    def __getattr__(self, name):
        call = getattr(self.file, name)

        def recorded(*args):
            result = call(*args)
            self.sizes.append(self.path.stat().st_size)
            return result

        return recorded


def test_a_new_run_never_leaves_the_journal_empty_on_disk(tmp_path):
    """An empty journal reads as a worker that never began a run, which the supervisor holds to
    the start-up grace alone: a long call whose journal it reads empty would be judged hung."""
    from kvprop.allocator.specs import AllocatorConfig, EngineConfig, FullAttention
    from kvprop.search.journal import Journal
    from kvprop.search.trace import Trace

    journal = Journal(tmp_path / "journal")
    trace = Trace(EngineConfig(AllocatorConfig((FullAttention(4),), 8)), ())
    journal.begin(trace, 0)
    journal.file = watched = _SizeAfterEachCall(journal.file, journal.path)
    journal.begin(trace, 1)
    assert (min(watched.sizes) > 0, journal.path.read_text().count("\nrun ")) == (True, 0)
