"""A trace is data: it never chooses code to run, and its numbers, nesting and file type are
bounded before anything is built from it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from test_cli import ROOT
from test_cli import kvprop as cli

TRACE = ROOT / "tests" / "data" / "one-token-reload-uncached.json"

WRITER = """
from pathlib import Path

Path("written-by-target").write_text("ran")


def make_target(config):
    from kvprop.allocator.view import AllocatorView
    from kvprop.targets.kvprop import make_allocator

    allocator = make_allocator(config)
    return allocator, AllocatorView(allocator)
"""


def kvprop(*args, cwd):
    """``kvprop`` run in ``cwd``, where the test writes its target module."""
    return cli(*args, cwd=cwd, env={"PYTHONPATH": f"{ROOT}{os.pathsep}{cwd}"})


def write_trace(tmp_path: Path, **changes) -> Path:
    data = json.loads(TRACE.read_text())
    data.update(changes)
    path = tmp_path / "trace with space.json"
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def writer_trace(tmp_path):
    (tmp_path / "writer_target.py").write_text(WRITER)
    return write_trace(tmp_path, target="writer_target:make_target")


@pytest.mark.parametrize("command", ["replay", "minimise", "emit-test"])
def test_a_trace_naming_outside_code_runs_nothing(tmp_path, writer_trace, command):
    r = kvprop(command, str(writer_trace), cwd=tmp_path)
    assert (r.returncode, (tmp_path / "written-by-target").exists(), "Traceback" in r.stderr) == (2, False, False)


def test_the_refusal_names_the_target_and_the_command_that_allows_it(tmp_path, writer_trace):
    r = kvprop("replay", str(writer_trace), cwd=tmp_path)
    allow = f"kvprop replay '{writer_trace}' --target writer_target:make_target"
    assert ("names target 'writer_target:make_target'" in r.stderr, allow in r.stderr) == (True, True), r.stderr


def test_a_trace_runs_outside_code_that_the_command_line_names(tmp_path, writer_trace):
    r = kvprop("replay", str(writer_trace), "--target", "writer_target:make_target", cwd=tmp_path)
    assert (r.returncode, (tmp_path / "written-by-target").exists()) == (0, True), r.stdout + r.stderr


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('{"format": "kvprop-trace/1", "seed": ' + "9" * 5000 + "}", "an integer of 5,000 digits (at most 20)"),
        ('{"format": "kvprop-trace/1", "seed": 1.5}', "not an integer"),
        ('{"format": "kvprop-trace/1", "seed": NaN}', "not an integer"),
        ("[" * 50 + "]" * 50, "nested deeper than 6 levels"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ],
    ids=["huge-integer", "float", "nan", "deep", "very-deep"],
)
def test_a_trace_beyond_the_bounds_exits_2(tmp_path, text, says):
    path = tmp_path / "t.json"
    path.write_text(text)
    r = kvprop("replay", str(path), cwd=tmp_path)
    assert (r.returncode, says in r.stderr, "Traceback" in r.stderr) == (2, True, False), r.stderr


def test_a_failure_kind_outside_the_registry_exits_2(tmp_path):
    data = json.loads(TRACE.read_text())
    data["failure"]["kind"] = "made-up-kind"
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    r = kvprop("replay", str(path), cwd=tmp_path)
    assert (r.returncode, "failure.kind: 'made-up-kind' is not a kind kvprop reports" in r.stderr) == (2, True)


@pytest.mark.parametrize("command", [("replay",), ("bench", "targets", "--baseline")])
def test_a_fifo_is_refused_without_being_opened(tmp_path, command):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    r = kvprop(*command, str(fifo), cwd=tmp_path)  # opening it would block: the timeout would fail the test
    assert (r.returncode, "is not a regular file" in r.stderr) == (2, True), r.stderr


def test_an_error_quoting_many_unknown_fields_names_the_first_few_and_counts_the_rest(tmp_path):
    data = json.loads(TRACE.read_text())
    data["config"].update({f"field{i:05d}": 0 for i in range(10_000)})
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    r = kvprop("replay", str(path), cwd=tmp_path)
    says = "unknown field(s) field00000, field00001, field00002, field00003, field00004, field00005, field00006, "
    says += "field00007 and 9,992 more; allowed:"
    assert (r.returncode, says in r.stderr, len(r.stderr) < 2_000) == (2, True, True), r.stderr[:500]


def test_a_list_of_made_up_kinds_is_quoted_short(tmp_path):
    names = ",".join(f"kind{i}" for i in range(5_000))
    r = kvprop("fuzz", "--known", names, "--seconds", "1", cwd=tmp_path)
    assert (r.returncode, "kind7 and 4,992 more" in r.stderr, len(r.stderr) < 4_000) == (2, True, True), r.stderr[:500]


def test_emit_test_refuses_a_target_that_is_not_a_target_name(tmp_path):
    r = kvprop("emit-test", str(TRACE), "--target", "not a name", "--out", str(tmp_path / "t.py"), cwd=tmp_path)
    says = (
        "target must be 'kvprop', 'vllm', 'vllm-scheduler', 'sglang', 'sglang-rust' or 'package.module:factory', "
        "got 'not a name'"
    )
    assert (r.returncode, says in r.stderr, (tmp_path / "t.py").exists()) == (2, True, False), r.stderr
