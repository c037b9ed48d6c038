"""A campaign is a seed and a run budget: run i walks the same seed whichever worker runs it,
so the walker's finds are the same for one worker or many (kvprop.search.fuzz)."""

from __future__ import annotations

import pytest

from kvprop.search import fuzz
from kvprop.search import trace as tr

SEED = 11
RUNS = 48
VARIANT = "evict-keeps-hash"  # found in most walks: a campaign of a few dozen runs has many finds
KINDS = frozenset({"cache-map-stale", "cache-map-missing", "target-crash", "hit-too-long", "data-mismatch"})


def campaign(workers: int, known=frozenset(), first_run: int = 0, max_runs: int = RUNS):
    """(the reported find as a dict or None, every find as (run seed, kind), the runs counted)."""
    finds = []
    opts = fuzz.FuzzOptions(
        seconds=600, workers=workers, seed=SEED, variant=VARIANT, max_runs=max_runs, first_run=first_run, known=known
    )
    result = fuzz.search(opts, on_find=lambda trace, log=None: finds.append((trace.seed, trace.failure.kind)))
    reported = tr.to_dict(result.found) if result.found else None
    return reported, sorted(finds), result.runs


@pytest.mark.parametrize("workers", [2, 4])
def test_the_reported_find_is_the_same_on_any_number_of_workers(workers):
    assert campaign(workers)[0] == campaign(1)[0]


@pytest.mark.parametrize("workers", [2, 4])
def test_a_campaign_going_on_past_finds_has_the_same_finds_and_runs_on_any_number_of_workers(workers):
    assert campaign(workers, KINDS)[1:] == campaign(1, KINDS)[1:]


def test_the_campaign_going_on_runs_its_whole_budget():
    assert campaign(1, KINDS)[2] == RUNS


def test_two_batches_run_the_campaign_s_runs():
    first, second = campaign(1, KINDS, 0, RUNS // 2), campaign(2, KINDS, RUNS // 2, RUNS)
    assert sorted(first[1] + second[1]) == campaign(1, KINDS)[1]
