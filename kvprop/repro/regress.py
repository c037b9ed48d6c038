"""Standalone pytest regression tests generated from traces.

The test replays the trace against the target it was found on — or against
$KVPROP_VARIANT / $KVPROP_TARGET when set — and fails while the bug is present.
Commit it next to your tests: it needs only kvprop, not Hypothesis's database.

Traces arrive from other machines, so the generated source holds trace data only as data:
the trace's JSON as one string literal written by ``repr`` (parsed and validated with
``kvprop.search.trace.from_dict`` when the test runs), plus the test's name reduced to
``[a-z0-9_]``. Nothing from a trace is ever pasted into code, a docstring or a comment.
"""

from __future__ import annotations

import json
import re

from kvprop import __version__
from kvprop.search.trace import Trace, from_dict, to_dict

MAX_NAME = 80  # a kind is free text from the target; the file and function name stay short

# Fixed text: no part of it comes from a trace.
PREAMBLE = '''"""A kvprop regression test, generated from a trace.

It replays TRACE_JSON against the variant and target the trace was found on (override them
with $KVPROP_VARIANT or $KVPROP_TARGET) and fails, with the step log, while the bug is present.
The trace is data: it is parsed and validated when the test runs, never pasted into code.
"""

import importlib.util
import json
import os
import sys
from pathlib import Path

from kvprop.search.execute import execute
from kvprop.search.trace import from_dict

'''

HELPERS = '''

def _find_target_module(target):
    """Make a path-loaded target (``package.module:factory``) importable from any directory:
    unless its top-level module already is, add the nearest directory above this file that
    holds it, as running from the project root would."""
    if not isinstance(target, str) or ":" not in target:
        return
    top = target.partition(":")[0].partition(".")[0]
    if not top.isidentifier():
        return
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin is not None:
        return  # a module or regular package of that name is importable: it wins, as in kvprop
    for base in Path(__file__).resolve().parents:
        if (base / (top + ".py")).is_file() or (base / top).is_dir():
            if str(base) not in sys.path:
                sys.path.append(str(base))
            return
'''

BODY = """():
    trace = from_dict(json.loads(TRACE_JSON))
    variant = os.environ.get("KVPROP_VARIANT", trace.variant)
    target = os.environ.get("KVPROP_TARGET", trace.target)
    _find_target_module(target)
    steps = []
    failure = execute(
        trace,
        variant=variant,
        target=target,
        on_step=lambda i, op, outcome: steps.append(f"  {i}: {op} -> {outcome}"),
    )
    assert failure is None, "\\n".join([*steps, f"FAILED at {failure.describe()}"])
"""

NAME = re.compile(r"[a-z0-9_]+", re.ASCII)


def test_name(trace: Trace) -> str:
    """The test's name after ``test_``: ASCII letters, digits and underscores only."""
    kind = trace.failure.kind if trace.failure else "trace"
    text = f"{kind}_{trace.driver}_seed{trace.seed}".lower()
    name = re.sub(r"[^a-z0-9_]+", "_", text, flags=re.ASCII).strip("_")[:MAX_NAME].rstrip("_")
    return name or "trace"


def _literal(text: str) -> str:
    """``text`` as a parenthesised run of ``repr`` literals, one per line: a single constant."""
    lines = text.splitlines(keepends=True) or [""]
    return "(\n" + "".join(f"    {line!r}\n" for line in lines) + ")"


def render(trace: Trace, source: str = "a trace") -> str:
    """The test's source: it replays on the variant and target the trace was found on.

    The trace must be one ``from_dict`` accepts (a TraceError says why not): the generated
    test validates it again when it runs."""
    data = to_dict(trace)
    from_dict(data)  # refuse here, not in the generated test, a trace it could not load
    name = test_name(trace)
    if not NAME.fullmatch(name):  # test_name guarantees it; the source depends on it
        raise ValueError(f"unsafe test name {name!r}")
    text = json.dumps(data, indent=1, sort_keys=True)  # ASCII: json escapes the rest
    return "".join(
        [
            PREAMBLE,
            f"GENERATED_BY = {f'kvprop {__version__}'!r}\n",
            f"SOURCE = {str(source)!r}\n",
            f"TRACE_JSON = {_literal(text)}\n",
            HELPERS,
            "\n\ndef test_",
            name,
            BODY,
        ]
    )
