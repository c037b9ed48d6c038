"""``kvprop bench time_to_find``: how long each bug variant takes to find from scratch, by each driver.

Each search runs in an empty directory (an empty Hypothesis example database) and is capped, so
the part's length is bounded before it starts (``time_to_find_bound``); what is found is
minimised, and its length reported.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile

from kvprop.repro.minimise import minimise
from kvprop.search import DRIVERS, fuzz
from kvprop.search.machine import trace_length
from kvprop.targets.variants import VARIANTS


@contextlib.contextmanager
def fresh_directory():
    old = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        try:
            yield
        finally:
            os.chdir(old)


def find_row(variant: str, driver: str, seeds, cap: float, progress) -> dict:
    """One variant found from scratch by one driver over ``seeds``, each search capped at ``cap`` s."""
    secs: list[float] = []
    steps: list[int] = []
    shrunk: list[int] = []
    for seed in seeds:
        progress(f"time to find: {variant}, {driver}, seed {seed}")
        with fresh_directory():  # an empty Hypothesis example database for every search
            result = fuzz.search(
                fuzz.FuzzOptions(seconds=cap, workers=1, seed=seed * 1000, driver=driver, variant=variant)
            )
        if result.found is None:
            continue
        best = minimise(result.found, variant=variant)
        assert result.seconds_to_find is not None  # a search that found says when
        secs.append(result.seconds_to_find)
        steps.append(result.steps)
        shrunk.append(trace_length(best))
    return {
        "variant": variant,
        "driver": driver,
        "seeds": len(seeds),
        "found": len(secs),
        "median_s": round(statistics.median(secs), 2) if secs else None,
        "max_s": round(max(secs), 2) if secs else None,
        "median_steps": int(statistics.median(steps)) if steps else None,
        "max_steps": max(steps) if steps else None,
        "median_minimised": statistics.median(shrunk) if shrunk else None,
        "cap_s": cap,
    }


def find_caps(quick: bool) -> tuple[range, dict]:
    """The seeds and each driver's cap per search: a quick run searches once per variant and
    driver, briefly, so that a variant neither driver finds costs seconds, not minutes."""
    if quick:
        return range(1), {"walk": 5.0, "hypothesis": 8.0}
    return range(5), {"walk": 60.0, "hypothesis": 180.0}


def time_to_find_bound(quick: bool) -> float:
    """The longest the time-to-find part can search, in seconds: every search of every variant
    by both drivers running to its cap (minimising what is found comes on top)."""
    seeds, cap = find_caps(quick)
    return len(VARIANTS) * len(seeds) * sum(cap[driver] for driver in DRIVERS)


def time_to_find(quick: bool, progress) -> list[dict]:
    """Every variant found from scratch by each driver (``find_row``), within ``find_caps``."""
    seeds, cap = find_caps(quick)
    return [find_row(variant, driver, seeds, cap[driver], progress) for variant in VARIANTS for driver in DRIVERS]
