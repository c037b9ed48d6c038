"""A seed names one search: the command line and the library call give Hypothesis the same
stream, so ``kvprop fuzz --seed N`` and ``fuzz.search(FuzzOptions(seed=N))`` find the same trace
(a find quoted from either reproduces with the other)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from kvprop.search import fuzz
from kvprop.search import trace as tr

ROOT = Path(__file__).resolve().parent.parent
VARIANT, SEED, RUNS = "hit-stops-early", 4, 200  # found within a few examples at this seed


def command_line_find(out: Path, driver: str) -> dict:
    args = ["fuzz", "--driver", driver, "--variant", VARIANT, "--seed", str(SEED), "--max-runs", str(RUNS)]
    args += ["--seconds", "600", "--workers", "1", "--fresh", "--out", str(out), "--json"]
    run = subprocess.run(
        [sys.executable, "-m", "kvprop", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=out.parent,
        timeout=600,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    (found,) = out.glob("*.found.json")
    return json.loads(found.read_text())


def library_find(driver: str) -> dict:
    options = fuzz.FuzzOptions(seconds=600, seed=SEED, driver=driver, variant=VARIANT, fresh=True, max_runs=RUNS)
    result = fuzz.search(options)
    assert result.found is not None
    return tr.to_dict(result.found)


def test_the_command_line_and_the_library_find_the_same_trace_with_hypothesis(tmp_path):
    assert command_line_find(tmp_path / "cx", "hypothesis") == library_find("hypothesis")


def test_the_command_line_and_the_library_find_the_same_trace_with_the_walker(tmp_path):
    assert command_line_find(tmp_path / "cx", "walk") == library_find("walk")
