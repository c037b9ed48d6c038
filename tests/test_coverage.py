"""``kvprop coverage``: statement and branch coverage of the target's allocator, reached by walks."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import coverage as coveragepy
import pytest

from kvprop.front import coverage as kc

ROOT = Path(__file__).resolve().parent.parent
ALLOCATOR = ROOT / "kvprop" / "allocator"
KEYS = {"target", "seconds", "runs", "steps", "finds", "total", "files", "classes", "never_entered", "empty_files"}


def kvprop(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "kvprop", *args],
        cwd=cwd or ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )


# ---- per class and per function, on a module small enough to know by heart -------------------

SAMPLE = '''\
class Pool:
    def called(self):
        return 1

    def never(self):
        """A docstring is not a statement."""
        return 2

    def one_liner(self): return 3

    @staticmethod
    def decorated_one_liner(): return 4

    def branchy(self, x):
        if x:
            return 5
        return 6


def outer():
    def inner():
        return 7

    return 8


import abc


class Base(abc.ABC):
    @abc.abstractmethod
    def hook(self):
        pass
'''


def test_classes_and_never_entered_functions_of_a_known_module(tmp_path, monkeypatch):
    package = tmp_path / "covsample"
    package.mkdir()
    (package / "__init__.py").write_text('"""Only a docstring."""\n')
    (package / "mod.py").write_text(SAMPLE)
    monkeypatch.syspath_prepend(str(tmp_path))
    cov = coveragepy.Coverage(branch=True, include=[str(package / "*")], data_file=None, config_file=False)
    cov.start()
    try:
        from covsample import mod

        pool = mod.Pool()
        pool.called()
        pool.one_liner()
        pool.branchy(True)
        mod.outer()
    finally:
        cov.stop()
    files = [str((package / n).resolve()) for n in ("__init__.py", "mod.py")]
    scope = kc.Scope(tuple(files), (), "sample", str(package.resolve()))
    rows, classes, never, empty, functions = kc.tabulate(cov, scope)

    assert empty == ["__init__.py"] and [r.file for r in rows] == ["mod.py"]
    assert {(f.name, f.abstract) for f in never} == {
        ("Pool.never", False),
        ("Pool.decorated_one_liner", False),
        ("outer.inner", False),
        ("Base.hook", True),
    }
    pool_row, base_row = classes
    assert (base_row.name, base_row.figures.statements, base_row.figures.missed) == ("Base", 1, 1)  # pass
    assert pool_row.name == "Pool" and pool_row.line == 1
    f = pool_row.figures
    # a class counts its methods' bodies, not what ran as it was defined (def lines, decorators)
    # nor a body on its def line: statements 3 7 15 16 17 (a docstring is none); missed 7 and 17;
    # line 15's two exits, of which 15->17 never ran from a line that did: partial
    assert (f.statements, f.missed, f.branches, f.missed_branches, f.partial) == (5, 2, 2, 1, 1)
    by_name = {f.name: (f.figures.statements, f.figures.missed) for f in functions}
    # outer counts its own body and inner's, which never ran
    assert (by_name["Pool.branchy"], by_name["Pool.never"], by_name["outer"]) == ((3, 1), (1, 1), (2, 1))
    whole = rows[0].figures  # coverage.py's own summary of the file: Pool, outer(), the import, Base
    assert whole == kc.Figures(12 + 4 + 1 + 4, 2 + 1 + 0 + 1, 6, 2, 2)
    assert whole.percent == pytest.approx(100 * (17 + 4) / (21 + 6))


def test_figures_percent_is_statements_and_branches_together():
    f = kc.Figures(statements=10, missed=2, branches=4, missed_branches=1, partial=1)
    assert f.percent == pytest.approx(100 * 11 / 14)
    assert f.percent_statements == pytest.approx(80.0)
    assert kc.ZERO.percent == 100.0
    assert (f + f).statements == 20


# ---- the command on kvprop's own allocator ---------------------------------------------------


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    html = tmp_path_factory.mktemp("html") / "report"
    r = kvprop("coverage", "--seconds", "2", "--json", "--html", str(html))
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout), html


def test_json_has_the_figures(measured):
    report, html = measured
    assert KEYS <= set(report)
    assert report["target"] == "kvprop" and report["runs"] >= 1 and report["steps"] > 0
    assert (html / "index.html").is_file() and report["html"] == str(html / "index.html")
    assert report["imported_before"] == []  # a fresh process imports the allocator under measurement


def _has_statements(path: Path) -> bool:
    body = ast.parse(path.read_text()).body
    return len(body) > (1 if body and isinstance(body[0], ast.Expr) else 0)


def test_every_allocator_module_appears_and_the_total_is_plausible(measured):
    report, _ = measured
    files = {f["file"]: f for f in report["files"]}
    for path in sorted(ALLOCATOR.glob("*.py")):
        if _has_statements(path):
            assert files[path.name]["statements"] > 0, path.name
        else:  # a docstring alone (the package's __init__.py): no statement to count
            assert path.name in report["empty_files"]
    assert 50 < report["total"]["percent"] <= 100
    assert report["total"]["statements"] == sum(f["statements"] for f in files.values())
    classes = {(c["file"], c["class"]) for c in report["classes"]}
    assert {("block_pool.py", "BlockPool"), ("kv_cache_manager.py", "KVCacheManager")} <= classes


def test_never_entered_lists_uncalled_functions_only(measured):
    report, _ = measured
    never = {(f["file"], f["function"]) for f in report["never_entered"]}
    # nothing in kvprop calls FreeBlockQueue.appendleft; every walk allocates blocks
    assert ("block_pool.py", "FreeBlockQueue.appendleft") in never
    assert ("block_pool.py", "BlockPool.get_new_blocks") not in never
    assert ("kv_cache_manager.py", "KVCacheManager.allocate_slots") not in never


def test_measure_in_process_and_render():
    report = kc.measure(seconds=0.3, seed=1, max_ops=20)
    text = kc.render(report)
    assert report.runs >= 1 and report.max_ops == 20
    assert "TOTAL" in text and "block_pool.py:BlockPool" in text and "functions never entered" in text
    assert ("imported before measuring began" in text) == bool(report.imported_before)
    header, rule, *_ = text.split("\n\n")[1].splitlines()
    assert len(header) == len(rule)  # aligned columns under one rule


def test_the_specs_a_release_registers_are_counted_and_each_not_driven_one_named_with_its_reason():
    import attrs

    report = attrs.evolve(
        kc.measure(seconds=0.1, seed=1, max_ops=5),
        specs=(
            {"spec": "FullAttentionSpec", "manager": "FullAttentionManager", "driven": True, "reason": ""},
            {"spec": "RingSpec", "manager": "RingManager", "driven": False, "reason": "a ring"},
            {"spec": "NewSpec", "manager": "NewManager", "driven": False, "reason": None},
        ),
    )
    lines = [line.split() for line in kc.render(report).splitlines() if line.lstrip().startswith(("specs ", "refused"))]
    assert lines == [
        ["specs", "driven:", "1", "of", "3", "the", "release", "registers"],
        ["refused:", "RingSpec", "a", "ring"],
        ["refused:", "NewSpec", "kvprop", "records", "no", "reason"],
    ]


# ---- bad input: exit 2 with a message ---------------------------------------------------------


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_a_measurement_of_both_vllm_targets_walks_each_in_turn():
    assert (kc.targets_of("vllm+vllm-scheduler"), kc.targets_of("vllm")) == (["vllm", "vllm-scheduler"], ["vllm"])


def test_vllm_target_without_vllm_exits_2_with_how_to_install():
    r = kvprop("coverage", "--target", "vllm", "--seconds", "1")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "needs vLLM importable" in r.stderr and "make vllm-env" in r.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--seconds", "0"], "expected a finite number of seconds > 0"),
        (["--max-ops", "0"], "expected an integer in [1, 10,000]"),
        (["--target", "no_such_module.x:f"], "cannot import 'no_such_module.x'"),
        (["--target", "vllm", "--variant", "hits-recached"], "applies to the kvprop target only"),
        (["--html", "setup.cfg"], "is a file; give a directory"),
        (["--target", "vllm+kvprop"], "several targets must be distinct ones of ['vllm', 'vllm-scheduler']"),
    ],
)
def test_bad_input_exits_2(args, message):
    r = kvprop("coverage", *args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr, r.stderr
