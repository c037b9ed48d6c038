"""A counterexample on disk: the trace file and its generated regression test, side by side."""

from __future__ import annotations

from pathlib import Path

from kvprop.repro import regress
from kvprop.search import trace as tr
from kvprop.search.trace import Trace


def write(trace: Trace, out: Path) -> tuple[Path, Path]:
    """The trace file and its generated regression test, named after the violation."""
    out.mkdir(parents=True, exist_ok=True)
    name = regress.test_name(trace)
    trace_path = out / f"{name}.json"
    test_path = out / f"test_{name}.py"
    tr.save(trace, trace_path)
    test_path.write_text(regress.render(trace, source=trace_path.name))
    return trace_path, test_path
