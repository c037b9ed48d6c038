"""Every violation kind is registered once, worded in one function, and can fire."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from kvprop.check.kinds import KINDS

PACKAGE = Path(__file__).resolve().parent.parent / "kvprop"


def raised_kinds() -> dict[str, set[str]]:
    """kind -> the functions (module:function) that construct a Violation of that kind."""
    where = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for func in ast.walk(tree):
            if not isinstance(func, ast.FunctionDef):
                continue
            for node in ast.walk(func):
                if (
                    isinstance(node, ast.Call)
                    and getattr(node.func, "id", None) == "Violation"
                    and node.args
                    and isinstance(node.args[0], ast.Constant)
                ):
                    where[node.args[0].value].add(f"{path.relative_to(PACKAGE)}:{func.name}")
    return where


def test_every_raised_kind_is_registered():
    assert sorted(set(raised_kinds()) - set(KINDS)) == []


def test_every_registered_kind_is_raised_somewhere():
    assert sorted(set(KINDS) - set(raised_kinds())) == []


def test_each_kind_is_raised_by_exactly_one_function():
    assert {k: sorted(f) for k, f in raised_kinds().items() if len(f) > 1} == {}


def test_every_kind_is_raised_by_the_invariants_module():
    assert {k for k, f in raised_kinds().items() if any(not w.startswith("check/invariants.py") for w in f)} == set()
