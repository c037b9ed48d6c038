"""kvprop's allocator without its own guards: a trace records the setting it ran with and
replays with it; ``kvprop fuzz --no-guards`` searches so, and only kvprop's own allocator has guards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from kvprop.allocator import guards
from kvprop.search import trace as trace_format
from kvprop.search.execute import execute
from kvprop.search.trace import Trace, TraceError
from kvprop.search.walk import plan, run_walk

ROOT = Path(__file__).resolve().parent.parent
VARIANT = "hits-recached"  # caught as cached-count-behind unguarded; the pool's guard raises first otherwise


def kvprop(*args):
    return subprocess.run(
        [sys.executable, "-m", "kvprop", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=600,
    )


@pytest.fixture(scope="module")
def unguarded_find() -> Trace:
    """The first walk that finds the variant with the guards off."""
    with guards.held(False):
        found = next(r for r in (run_walk(s, variant=VARIANT) for s in range(300)) if r.failure is not None)
    return attrs.evolve(found.trace, failure=found.failure)


def test_held_restores_the_setting():
    with guards.held(False):
        inside = guards.ENABLED
    assert (inside, guards.ENABLED) == (False, True)


def test_a_trace_records_the_guards_of_the_run_that_made_it(unguarded_find):
    assert unguarded_find.guards is False


def test_a_trace_that_ran_with_the_guards_does_not_spell_them():
    assert "guards" not in trace_format.to_dict(plan(0))


def test_a_trace_without_the_field_ran_with_the_guards():
    assert trace_format.from_dict(trace_format.to_dict(plan(0))).guards is True


def test_the_setting_survives_the_file(unguarded_find):
    assert trace_format.from_dict(json.loads(json.dumps(trace_format.to_dict(unguarded_find)))).guards is False


def test_a_setting_that_is_not_a_boolean_is_refused():
    d = {**trace_format.to_dict(plan(0)), "guards": "off"}
    with pytest.raises(TraceError, match="guards"):
        trace_format.from_dict(d)


def test_a_replay_runs_with_the_guards_its_trace_ran_with(unguarded_find):
    assert execute(unguarded_find, variant=VARIANT).kind == "cached-count-behind"


def test_the_same_operations_with_the_guards_on_end_at_a_guard(unguarded_find):
    failure = execute(attrs.evolve(unguarded_find, guards=True), variant=VARIANT)
    assert (failure.kind, "AllocatorError" in failure.message) == ("target-crash", True)


def test_fuzz_without_guards_on_another_target_is_refused():
    result = kvprop("fuzz", "--target", "vllm", "--no-guards", "--seconds", "1")
    assert (result.returncode, "has none of them" in result.stderr) == (2, True)


def test_bugs_refuses_an_unknown_variant_with_the_known_ones():
    result = kvprop("bugs", "--only", "no-such-bug")
    assert (result.returncode, "the variants are" in result.stderr) == (2, True)
