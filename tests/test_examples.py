"""The example target ``examples/toy_allocator.py``: a user's own allocator, written from the
target contract alone, tested end to end through the ``kvprop`` command and the pytest plugin.

Its ``TARGET`` declares the shapes it builds (one full-attention group, no events, no EAGLE
drop, ...), so kvprop's sampler draws only those and the toy refuses none. Its bare factory
declares nothing: kvprop draws every shape, of which the toy builds about 2%, under the 10% a
run needs to be called clean.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli import ROOT, kvprop

from kvprop.allocator.specs import AllocatorConfig, ChunkedLocal, FullAttention, Mamba, SlidingWindow
from kvprop.errors import ConfigError

TOY = ROOT / "examples" / "toy_allocator.py"
CORRECT = "examples.toy_allocator:TARGET"
BROKEN = "examples.toy_allocator:BROKEN_TARGET"
BARE = "examples.toy_allocator:make_target"


def fuzz_json(tmp_path, target: str, seed: int, max_runs: int):
    """``kvprop fuzz --json`` with one worker and a budget of runs, not seconds: the same walks every time."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    args = ("--workers", "1", "--max-runs", str(max_runs), "--seconds", "600", "--seed", str(seed), "--json")
    r = kvprop("fuzz", "--target", target, "--out", str(tmp_path / "cx"), *args, cwd=tmp_path)
    return r, json.loads(r.stdout)


@pytest.fixture(scope="module")
def correct_run(tmp_path_factory):
    return fuzz_json(tmp_path_factory.mktemp("correct"), CORRECT, seed=1, max_runs=300)


@pytest.fixture(scope="module")
def bare_run(tmp_path_factory):
    return fuzz_json(tmp_path_factory.mktemp("bare"), BARE, seed=1, max_runs=3000)


@pytest.fixture(scope="module")
def broken_run(tmp_path_factory):
    return fuzz_json(tmp_path_factory.mktemp("broken"), BROKEN, seed=1, max_runs=500)  # found at run 22


def test_fuzz_of_the_declared_toy_is_clean_and_refuses_nothing(correct_run):
    r, summary = correct_run
    actual = (r.returncode, summary["verdict"], summary["refused_configurations"], summary["steps"] > 0)
    assert actual == (0, "clean", 0, True), r.stderr


def test_fuzz_of_the_bare_factory_draws_every_shape_and_calls_the_toy_untested(bare_run):
    r, summary = bare_run
    built = summary["runs"] - summary["refused_configurations"]
    assert (r.returncode, summary["verdict"], 0 < built < 0.1 * summary["runs"]) == (2, "untested", True), r.stderr


def test_fuzz_counts_each_refusal_by_what_the_toy_cannot_do(bare_run):
    _, summary = bare_run
    undeclared = (
        f"target {BARE!r} does not declare deferred_frees, which this configuration needs: deferred_frees (batches "
        "in flight beside a connector that loads: a request's blocks are taken by pop_blocks_for_free() and freed by "
        "free_popped_blocks() once its last batch is back). Where its allocator and view offer those calls, declare "
        "them: the factory returns Built(allocator, view, Capabilities(deferred_frees=True)), or a Target(..., "
        "capabilities=Capabilities(deferred_frees=True)) names it; otherwise leave such configurations out of the "
        'Target\'s Shapes (options without "pipeline_depth"); docs/targets.md'
    )
    assert sorted(summary["refused_reasons"]) == [
        undeclared,
        "toy allocator: FullAttention only, got ChunkedLocal",
        "toy allocator: FullAttention only, got Mamba",
        "toy allocator: FullAttention only, got SlidingWindow",
        "toy allocator: no EAGLE drop (eagle=True)",
        "toy allocator: no KV cache events (enable_kv_cache_events=True)",
        "toy allocator: one KV cache group only, got 2",
        "toy allocator: one KV cache group only, got 3",
    ]


def test_fuzz_finds_the_broken_toy_from_scratch_and_minimises_it(broken_run):
    r, summary = broken_run
    find = summary["find"] or {}
    actual = (r.returncode, summary["verdict"], find.get("kind"), find.get("operations_minimised"))
    assert actual == (1, "found", "free-queue-membership", 3), r.stderr


def test_the_correct_toy_agrees_with_kvprops_allocator_step_for_step(tmp_path):
    r = kvprop("agree", "--target", CORRECT, "--walks", "400", "--json", cwd=tmp_path)
    summary = json.loads(r.stdout)
    assert (r.returncode, summary["agree"], summary["walks"] > 0) == (0, True, True), r.stderr


@pytest.mark.parametrize(
    "config, says",
    [
        (AllocatorConfig((FullAttention(4), FullAttention(4)), 16), "one KV cache group only, got 2"),
        (AllocatorConfig((SlidingWindow(4, 8),), 16), "FullAttention only, got SlidingWindow"),
        (AllocatorConfig((ChunkedLocal(4, 8),), 16), "FullAttention only, got ChunkedLocal"),
        (AllocatorConfig((Mamba(4),), 16), "FullAttention only, got Mamba"),
        (AllocatorConfig((FullAttention(4),), 16, enable_kv_cache_events=True), "no KV cache events"),
        (AllocatorConfig((FullAttention(4),), 16, eagle=True), "no EAGLE drop"),
    ],
)
def test_the_factory_refuses_what_the_toy_cannot_do_by_name(config, says):
    from examples.toy_allocator import make_target

    with pytest.raises(ConfigError, match=f"^toy allocator: {says}"):
        make_target(config)


def test_the_factory_builds_one_full_attention_group_with_caching_on_or_off():
    from examples.toy_allocator import make_target

    built = [make_target(AllocatorConfig((FullAttention(4),), 16, caching))[1] for caching in (True, False)]
    assert [(v.num_blocks, v.num_free_blocks, v.free_queue_ids()[:3]) for v in built] == [(16, 15, [1, 2, 3])] * 2


# ---- the pytest plugin, in a user's own project (as tests/test_plugin.py runs it) ----------


@pytest.fixture
def project(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_plain.py").write_text("def test_plain():\n    assert True\n")
    return tmp_path


def pytest_with_kvprop(where: Path, target: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "KVPROP_"))}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider"]
        + ["--kvprop-target", target, "--kvprop-profile", "ci", *args],
        cwd=where,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_plugin_passes_the_correct_toy(project):
    run = pytest_with_kvprop(project, CORRECT, "--kvprop-examples", "20")
    actual = (run.returncode, f"PASSED kvprop[{CORRECT}]" in run.stdout, "2 passed" in run.stdout)
    assert actual == (0, True, True), run.stdout + run.stderr


def test_the_plugin_fails_the_broken_toy_with_the_violation(project):
    run = pytest_with_kvprop(project, BROKEN, "--kvprop-out", "found")
    says = f"kvprop: target {BROKEN!r} failed free-queue-membership (Hypothesis, profile ci"
    actual = (run.returncode, f"FAILED kvprop[{BROKEN}]" in run.stdout, says in run.stdout)
    assert actual == (1, True, True), run.stdout + run.stderr


def test_the_toy_is_at_most_200_lines():
    lines = TOY.read_bytes().count(b"\n")  # what `wc -l` counts
    assert lines <= 200, lines
