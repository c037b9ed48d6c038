"""End to end through the ``kvprop`` command: find, minimise, replay, emit a test."""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import motivating_trace

from kvprop import interrupt
from kvprop.front import cli, fuzz_command
from kvprop.front.cli import build_parser
from kvprop.search import trace as tr
from kvprop.targets.vllm.releases import RULES_0_33, as_flags, release_rules

BUG = "interleaved-external-alloc"
ROOT = Path(__file__).resolve().parent.parent


def kvprop(*args, cwd=None, env=None):
    return subprocess.run(
        [sys.executable, "-m", "kvprop", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        timeout=900,
    )


def kvprop_fuzz(cwd, out, args: str):
    """``kvprop fuzz`` with one worker writing to ``out``; ``args`` as one would type them."""
    return kvprop("fuzz", "--workers", "1", "--out", str(out), *args.split(), cwd=cwd)


def pytest_file(path, variant):
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)],
        cwd=path.parent,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT), "KVPROP_VARIANT": variant},
    )


def found(tmp_path, driver):
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "cx"
    # These seeds find the bug within seconds with either driver; these tests check what the
    # CLI does with a find, and kvprop bench measures how fast finds come.
    seed = 3 if driver == "walk" else 4  # the hypothesis stream at seed 3 needs 2,884 examples (tests/test_variants.py)
    r = kvprop_fuzz(tmp_path, out, f"--driver {driver} --variant {BUG} --seed {seed} --max-runs 3000 --seconds 600")
    assert r.returncode == 1, r.stdout + r.stderr
    traces = sorted(p for p in out.glob("*.json") if not p.name.endswith(".found.json"))
    tests = sorted(out.glob("test_*.py"))
    assert len(traces) == 1 and len(tests) == 1, r.stdout
    assert (out / traces[0].name.replace(".json", ".found.json")).exists()
    return r, traces[0], tests[0]


@pytest.fixture(scope="module")
def walk_find(tmp_path_factory):
    return found(tmp_path_factory.mktemp("walk"), "walk")


def test_walk_finds_the_motivating_bug_and_minimises_it(walk_find):
    r, trace_path, _ = walk_find
    data = json.loads(trace_path.read_text())
    assert data["failure"]["kind"] in {"block-in-two-groups", "connector-handoff", "cached-block-lost-hash"}
    assert len(data["steps"]) <= 10, r.stdout  # 9 for seed 3 with the current sampler
    assert "FOUND" in r.stdout and "FAILED at" in r.stdout


def test_replay_reproduces_on_the_variant_and_passes_on_the_correct_allocator(walk_find):
    _, trace_path, _ = walk_find
    bad = kvprop("replay", str(trace_path))
    assert bad.returncode == 1 and "REPRODUCED" in bad.stdout, bad.stdout + bad.stderr
    good = kvprop("replay", str(trace_path), "--variant", "correct")
    assert good.returncode == 0 and "PASSED" in good.stdout, good.stdout + good.stderr


def test_generated_test_fails_on_the_variant_and_passes_on_the_correct_allocator(walk_find):
    _, _, test_path = walk_find
    assert pytest_file(test_path, BUG).returncode == 1
    assert pytest_file(test_path, "correct").returncode == 0


def test_emit_test_writes_the_same_test_fuzz_wrote(walk_find, tmp_path):
    _, trace_path, test_path = walk_find
    out = tmp_path / "again.py"
    assert kvprop("emit-test", str(trace_path), "--out", str(out)).returncode == 0
    assert out.read_text() == test_path.read_text()


def test_hypothesis_driver_finds_the_motivating_bug(tmp_path):
    r, trace_path, test_path = found(tmp_path, "hypothesis")
    data = json.loads(trace_path.read_text())
    assert data["driver"] == "hypothesis"
    assert kvprop("replay", str(trace_path)).returncode == 1
    assert pytest_file(test_path, "correct").returncode == 0


def test_same_seed_gives_the_same_trace_twice(walk_find, tmp_path):
    first = walk_find[1].read_text()
    second = found(tmp_path, "walk")[1].read_text()
    assert first == second


def test_short_clean_fuzz_of_the_correct_allocator_exits_0(tmp_path):
    # a run budget, not a time budget: a loaded machine may spend seconds importing torch
    args = ("--workers", "2", "--seconds", "300", "--max-runs", "20", "--seed", "1")
    r = kvprop("fuzz", *args, "--out", str(tmp_path / "cx"), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "clean:" in r.stdout and "steps/s" in r.stdout
    assert list((tmp_path / "cx").iterdir()) == []


def test_finds_of_a_known_kind_are_saved_and_the_search_goes_on(tmp_path):
    known = "block-in-two-groups,connector-handoff,cached-block-lost-hash"
    out = tmp_path / "cx"
    r = kvprop_fuzz(tmp_path, out, f"--variant {BUG} --seed 3 --max-runs 300 --seconds 600 --json --known {known}")
    summary = json.loads(r.stdout)
    saved = len(list(out.glob("*.found.json")))
    assert (r.returncode, summary["verdict"], sum(summary["known_finds"].values())) == (0, "clean", saved)
    assert saved > 1 and summary["runs"] == 300


@pytest.mark.parametrize(
    "content, message",
    [
        ("not json", "not JSON"),
        ('{"format": "other"}', "format: expected 'kvprop-trace/1'"),
        ('{"format": "kvprop-trace/1", "steps": [], "config": {"groups": []}}', "config: missing field 'num_blocks'"),
        (
            '{"format": "kvprop-trace/1", "steps": [], "config": {"groups": [], "num_blocks": 8, '
            '"enable_caching": true, "token_budget": 8, "lookahead": 0, "connector": "off", "vocab": 4}}',
            "groups must be a tuple of 1 to",
        ),
        (
            '{"format": "kvprop-trace/1", "steps": [{"op": "Step", "times": -1}], "config": {}}',
            "steps[0].times: expected",
        ),
        ('{"format": "kvprop-trace/1", "steps": [{"op": "Teleport"}], "config": {}}', "unknown operation 'Teleport'"),
    ],
)
def test_malformed_trace_exits_2_with_a_clear_message(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    r = kvprop("replay", str(path))
    assert r.returncode == 2
    assert message in r.stderr, r.stderr


def test_unknown_variant_exits_2_and_lists_the_known_ones(tmp_path):
    r = kvprop("fuzz", "--variant", "no-such-bug", "--seconds", "1", cwd=tmp_path)
    assert r.returncode == 2
    assert "unknown variant 'no-such-bug'" in r.stderr and BUG in r.stderr


def test_missing_trace_file_exits_2(tmp_path):
    r = kvprop("replay", str(tmp_path / "nope.json"))
    assert r.returncode == 2 and "cannot read trace" in r.stderr


# ---- agree --------------------------------------------------------------------------------


def test_agree_with_a_target_that_wraps_kvprops_allocator_agrees():
    r = kvprop("agree", "--target", "tests.example_target:make_target", "--walks", "5", "--json", cwd=ROOT)
    summary = json.loads(r.stdout)
    assert (r.returncode, summary["agree"], summary["walks"], summary["steps"] > 0) == (0, True, 5, True), r.stderr


@pytest.mark.parametrize(
    ("target", "says"),
    [
        ("nosuch:make", "target 'nosuch:make': cannot import 'nosuch'"),
        ("kvprop", "agree compares kvprop's allocator with another target"),
        ("sglang", "target 'sglang' has no reference to agree with"),
        ("tests.example_target:nosuch", "has no attribute 'nosuch'"),
    ],
)
def test_agree_with_a_bad_target_exits_2_and_says_why(target, says):
    r = kvprop("agree", "--target", target, "--walks", "2", cwd=ROOT)
    assert (r.returncode, says in r.stderr, "Traceback" in r.stderr) == (2, True, False), r.stderr


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--target", "vllm", "--block-hits"), "--release-rules sets --block-hits itself: give one or the other"),
        (("--target", "tests.example_target:make_target"), "--release-rules applies to the vLLM targets"),
    ],
)
def test_agree_with_release_rules_and_what_they_exclude_exits_2(args, says):
    r = kvprop("agree", "--release-rules", *args, "--walks", "2", cwd=ROOT)
    assert (r.returncode, says in r.stderr, "Traceback" in r.stderr) == (2, True, False), r.stderr


def test_agree_with_release_rules_without_vllm_exits_2_and_says_how_to_get_it():
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    r = kvprop("agree", "--release-rules", "--target", "vllm", "--walks", "2", cwd=ROOT)
    says = "--release-rules: vLLM is not installed here; build a CPU-only vLLM environment"
    assert (r.returncode, says in r.stderr, "Traceback" in r.stderr) == (2, True, False), r.stderr


@pytest.mark.parametrize(
    ("release", "flags"),
    [
        ((0, 24, 0), "--no-junction --no-checkpoints --incremental-report --reference-variant announces-every-copy"),
        (
            (0, 30, 0),
            "--block-hits --no-checkpoints --reference-variant reannounces-every-position+announces-every-copy",
        ),
        ((0, 34, 0), f"--reference-variant {RULES_0_33}"),
    ],
)
def test_release_rules_name_what_each_release_lacks_and_its_known_bugs(release, flags):
    assert as_flags(release_rules(release)) == flags


# ---- start-up -----------------------------------------------------------------------------

# What a command that runs nothing must not import: each costs seconds (torch, Hypothesis) or
# stands for running something (an engine, a target's package).
HEAVY = ("torch", "hypothesis", "kvprop.sim.engine", "vllm", "sglang")


def imported(stderr: str) -> set[str]:
    """The modules ``-X importtime`` says a process imported: each line ends ``| name``."""
    return {line.rsplit("|", 1)[1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize(
    ("args", "status"),
    [
        (("--help",), 0),
        (("--version",), 0),
        (("replay", "--help"), 0),
        (("targets",), 0),
        (("fuzz", "--seconds", "-1"), 2),
    ],
    ids=["help", "version", "command-help", "targets", "argument-error"],
)
def test_a_command_that_runs_nothing_imports_neither_torch_nor_hypothesis_nor_an_engine(args, status):
    r = kvprop(*args, cwd=ROOT, env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert (r.returncode, sorted(imported(r.stderr) & set(HEAVY))) == (status, []), r.stderr[-2000:]


# ---- bench --------------------------------------------------------------------------------


def test_bench_with_an_unknown_part_exits_2_and_lists_the_parts():
    r = kvprop("bench", "nosuch", cwd=ROOT)
    says = (
        "invalid part 'nosuch' (choose from startup, throughput, supervision, scaling, time_to_find, vllm, sglang, "
        "ray, targets)"
    )
    assert (r.returncode, says in r.stderr, "Traceback" in r.stderr) == (2, True, False), r.stderr


def test_bench_vllm_without_vllm_exits_2_and_says_how_to_get_it():
    pytest.importorskip("torch")
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is importable here")
    r = kvprop("bench", "vllm", cwd=ROOT)
    says = "target 'vllm' needs vLLM importable"
    assert (r.returncode, says in r.stderr, "Traceback" in r.stderr) == (2, True, False), r.stderr


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (None, "cannot read baseline"),
        ("{not json", "not JSON"),
        ('{"targets": [{"value": 1}]}', 'each with a "measure" string and a "value"'),
        ("[1, 2]", 'an object whose "targets" is a list of rows'),
    ],
    ids=["missing", "not-json", "row-without-measure", "not-an-object"],
)
def test_bench_with_a_bad_baseline_exits_2_before_measuring(tmp_path, content, says):
    path = tmp_path / "before.json"
    if content is not None:
        path.write_text(content)
    r = kvprop("bench", "--baseline", str(path), "targets", cwd=ROOT)
    assert (r.returncode, says in r.stderr, "Traceback" in r.stderr, "measuring" in r.stderr) == (
        2,
        True,
        False,
        False,
    ), r.stderr


def test_bench_baseline_needs_the_targets_part(tmp_path):
    path = tmp_path / "before.json"
    path.write_text('{"targets": []}')
    r = kvprop("bench", "--baseline", str(path), "scaling", cwd=ROOT)
    says = "--baseline adds a column to the targets table: name the targets part too"
    assert (r.returncode, says in r.stderr, "Traceback" in r.stderr) == (2, True, False), r.stderr


def test_a_baseline_row_stands_beside_the_same_measure():
    from kvprop.front.bench import with_baseline

    rows = [{"measure": "m", "value": 2, "target": ">= 1", "met": "yes"}, {"measure": "n", "value": 3}]
    assert with_baseline(rows, {"m": 1}) == [
        {"measure": "m", "before": 1, "value": 2, "target": ">= 1", "met": "yes"},
        {"measure": "n", "before": "not measured", "value": 3},
    ]


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("http://localhost:6379", "scheme 'http' of 'http://localhost:6379' is not one of"),
        ("redis://", "'redis://' names no host"),
        ("redis://localhost:99999", "Port out of range"),
        ("redis://localhost:port", "is not a URL"),
        ("unix://", "names no socket path"),
    ],
)
def test_a_bad_redis_url_exits_2_saying_what_is_allowed(tmp_path, url, says):
    r = kvprop("fuzz", "--seconds", "1", "--redis", url, cwd=tmp_path)
    assert (r.returncode, says in r.stderr, "Traceback" in r.stderr) == (2, True, False), r.stderr


def test_a_redis_url_nothing_answers_exits_2_naming_it(tmp_path):
    pytest.importorskip("redis")
    r = kvprop("fuzz", "--seconds", "1", "--workers", "1", "--redis", "redis://127.0.0.1:1", cwd=tmp_path)
    says = "--redis redis://127.0.0.1:1: cannot connect"
    assert (r.returncode, says in r.stderr, "Traceback" in r.stderr) == (2, True, False), r.stderr


# ---- output that cannot be written: exit 2 naming the path ----------------------------------


@pytest.fixture
def trace_file(tmp_path):
    path = tmp_path / "find.json"
    tr.save(motivating_trace(), path)
    return path


def under_a_file(tmp_path, name: str) -> Path:
    """A path whose folder is a regular file: nobody, root included, can write there."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    return blocker / name


@pytest.mark.parametrize(("command", "name"), [("emit-test", "test_find.py"), ("minimise", "find.json")])
def test_an_out_that_cannot_be_written_exits_2_naming_it(trace_file, tmp_path, command, name):
    out = under_a_file(tmp_path, name)
    r = kvprop(command, str(trace_file), "--out", str(out), cwd=tmp_path)
    assert (r.returncode, f"--out {str(out)!r}" in r.stderr, "internal error" in r.stderr) == (2, True, False), r.stderr


def test_coverage_html_that_cannot_be_written_exits_2_before_measuring(tmp_path):
    html = under_a_file(tmp_path, "html")
    r = kvprop("coverage", "--html", str(html), "--seconds", "1", "--out", str(tmp_path / "cx"), cwd=tmp_path)
    assert (r.returncode, f"--html {str(html)!r}" in r.stderr, r.stdout) == (2, True, ""), r.stderr


def test_bench_markdown_naming_a_folder_exits_2_before_measuring(tmp_path):
    r = kvprop("bench", "--markdown", str(tmp_path), "startup", cwd=ROOT)
    says = f"--markdown {str(tmp_path)!r} is a directory"
    assert (r.returncode, says in r.stderr, r.stdout) == (2, True, ""), r.stderr


# ---- a closed pipe ends kvprop quietly --------------------------------------------------------


def into_a_closed_pipe(*args, cwd):
    """``kvprop`` writing into a pipe whose reader is gone before it starts, as ``| head -1``
    leaves it: (exit code, stderr)."""
    read, write = os.pipe()
    os.close(read)
    try:
        r = subprocess.run(
            [sys.executable, "-m", "kvprop", *args],
            cwd=cwd,
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            timeout=900,
        )
    finally:
        os.close(write)
    return r.returncode, r.stderr


@pytest.mark.parametrize(
    "args", ["targets", "fuzz --max-runs 50 --workers 1 --seed 1 --out cx"], ids=["targets", "fuzz"]
)
def test_a_closed_pipe_ends_kvprop_quietly_with_141(tmp_path, args):
    assert into_a_closed_pipe(*args.split(), cwd=tmp_path) == (141, "")


# ---- fuzz: its budgets, and which one ended it -------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "seconds"),
    [("", 60.0), ("--max-runs 5", None), ("--max-runs 5 --seconds 9", 9.0), ("--seconds 9", 9.0)],
    ids=["neither", "runs", "runs-and-seconds", "seconds"],
)
def test_the_time_budget_is_60s_unless_a_run_budget_is_given_alone(argv, seconds):
    args = build_parser().parse_args(["fuzz", *argv.split()])
    assert fuzz_command.time_budget(args) == seconds


def test_a_run_budget_alone_runs_all_its_runs(tmp_path):
    r = kvprop_fuzz(tmp_path, tmp_path / "cx", "--seed 1 --max-runs 20 --json")
    summary = json.loads(r.stdout)
    actual = (r.returncode, summary["exit"], summary["runs"], summary["budget"], summary["stopped"])
    assert actual == (0, 0, 20, {"runs": 20, "seconds": None}, "runs"), r.stderr


def test_json_counts_the_runs_by_batches_in_flight_as_their_configurations_draw_them(tmp_path):
    from collections import Counter

    from kvprop.search.walk import start, walk_seed

    drawn = Counter(str(start(walk_seed(1, i)).config.pipeline_depth) for i in range(60))
    r = kvprop_fuzz(tmp_path, tmp_path / "cx", "--seed 1 --max-runs 60 --json")
    assert json.loads(r.stdout)["pipeline_depths"] == dict(sorted(drawn.items())), r.stderr


def test_a_time_budget_that_ends_before_the_run_budget_says_so(tmp_path):
    # no machine makes a million walks in a second: the clock ends this search, clean or untested
    r = kvprop_fuzz(tmp_path, tmp_path / "cx", "--seed 1 --max-runs 1000000 --seconds 1 --json")
    assert json.loads(r.stdout)["stopped"] == "time", r.stderr


@pytest.mark.parametrize(
    ("max_runs", "seconds", "stopped", "says"),
    [
        (2000, 60.0, "time", "stopped by the 60s time budget before the 2,000-run budget"),
        (None, 60.0, "time", "stopped by the 60s time budget"),
        (2000, None, "runs", "all 2,000 runs of the budget"),
    ],
)
def test_a_clean_summary_line_says_which_budget_ended_the_search(max_runs, seconds, stopped, says):
    args = argparse.Namespace(max_runs=max_runs, seconds=seconds)
    assert fuzz_command._why_stopped(args, stopped) == says


# ---- --json: one JSON object on stdout, whatever the exit ---------------------------------------


def test_json_with_a_find_prints_one_object_naming_it(tmp_path):
    r = kvprop_fuzz(tmp_path, tmp_path / "cx", f"--variant {BUG} --seed 4 --max-runs 100 --json")
    summary = json.loads(r.stdout)
    actual = (r.returncode, summary["exit"], summary["verdict"], summary["stopped"], summary["find"]["kind"])
    assert actual == (1, 1, "found", "find", "block-in-two-groups"), r.stderr


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ("fuzz --json --target nosuch:thing --max-runs 5", "target 'nosuch:thing': cannot import 'nosuch'"),
        ("fuzz --json --workers 0", "argument --workers: expected an integer in [1,"),
    ],
    ids=["configuration", "argument"],
)
def test_json_with_unusable_input_prints_one_object_with_exit_2_and_the_error(tmp_path, args, says):
    r = kvprop(*args.split(), "--out", str(tmp_path / "cx"), cwd=tmp_path)
    outcome = json.loads(r.stdout)
    assert (r.returncode, outcome["exit"], outcome["verdict"], says in outcome["error"]) == (2, 2, "unusable", True)


@pytest.mark.parametrize(
    ("error", "code", "verdict"),
    [(KeyboardInterrupt(), 130, "interrupted"), (RuntimeError("boom"), 3, "error")],
    ids=["interrupt", "internal-error"],
)
def test_json_after_an_interrupt_or_an_internal_error_prints_one_object_with_the_exit(
    monkeypatch, capsys, error, code, verdict
):
    def command(args):
        raise error

    monkeypatch.setattr(cli, "_function", lambda path: command)
    monkeypatch.setattr(interrupt, "install", lambda: None)  # pytest keeps its own signal handlers
    status = cli.main(["targets", "--json"])
    outcome = json.loads(capsys.readouterr().out)
    assert (status, outcome["exit"], outcome["verdict"]) == (code, code, verdict)
