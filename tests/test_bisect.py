"""``kvprop bisect``: what it refuses (exit 2, saying what is allowed) and how it reads the
releases' answers. Replays on real releases are in tests/test_vllm_scheduler.py, which runs in
a release's environment."""

import os
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
from helpers import motivating_trace

from kvprop.errors import ConfigError
from kvprop.front.bisect import Verdict, environments, parse_range, summary
from kvprop.search import trace as tr

ROOT = Path(__file__).resolve().parent.parent


def bisect(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "kvprop", "bisect", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=cwd,
        timeout=120,
    )


@pytest.fixture
def vllm_trace(tmp_path):
    path = tmp_path / "find.json"
    tr.save(attrs.evolve(motivating_trace(), target="vllm", variant=None), path)
    return path


@pytest.mark.parametrize("text", ["0.22.1-0.34.0", "0.22..", "v0.22.1..0.34.0", "0.34.0..0.22.1"])
def test_a_malformed_range_exits_2_saying_what_it_takes(vllm_trace, text):
    run = bisect(str(vllm_trace), "--releases", text)
    assert (run.returncode, "--releases" in run.stderr, "Traceback" in run.stderr) == (2, True, False)


def test_a_release_without_an_environment_exits_2_saying_how_to_build_it(vllm_trace, tmp_path):
    run = bisect(str(vllm_trace), "--releases", "0.22.1..0.23.0", "--envs", str(tmp_path / "venv-vllm-"))
    assert (run.returncode, "make vllm-env VLLM_VERSION=0.22.1" in run.stderr) == (2, True)


def test_a_trace_of_kvprops_own_allocator_exits_2_naming_the_vllm_targets(tmp_path):
    path = tmp_path / "find.json"
    tr.save(motivating_trace(), path)
    run = bisect(str(path), "--releases", "0.22.1..0.23.0")
    assert (run.returncode, "--target vllm or vllm-scheduler or sglang" in run.stderr) == (2, True)


def test_the_range_is_both_ends():
    assert parse_range("0.22.1..0.34.0") == ("0.22.1", "0.34.0")


def test_a_range_backwards_is_refused():
    with pytest.raises(ConfigError, match="the first release comes after the last"):
        parse_range("0.34.0..0.22.1")


def test_environments_are_the_folders_with_a_python_named_prefix_and_release(tmp_path):
    for name in ("venv-vllm-0.22.1", "venv-vllm-0.34.0", "venv-vllm-main", "other-0.30.0"):
        (tmp_path / name / "bin").mkdir(parents=True)
        (tmp_path / name / "bin" / "python").touch()
    (tmp_path / "venv-vllm-0.30.0").mkdir()  # no Python in it
    assert sorted(environments(str(tmp_path / "venv-vllm-"))) == ["0.22.1", "0.34.0"]


def test_the_summary_names_the_first_and_last_release_affected():
    verdicts = [
        Verdict("0.22.1", "affected", "block-in-two-groups"),
        Verdict("0.23.0", "affected", "block-in-two-groups"),
        Verdict("0.24.0", "passes", ""),
        Verdict("0.25.1", "refuses", "ConfigError"),
    ]
    result = summary(verdicts)
    assert (result["first_affected"], result["last_affected"], result["passes"], result["refuses"]) == (
        "0.22.1",
        "0.23.0",
        ["0.24.0"],
        ["0.25.1"],
    )
