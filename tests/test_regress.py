"""Generated regression tests: trace data stays data, and the test runs from any directory."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import attrs
import helpers
import pytest

from kvprop.allocator.specs import AllocatorConfig, EngineConfig, FullAttention
from kvprop.repro import regress
from kvprop.search.alphabet import Step
from kvprop.search.execute import execute
from kvprop.search.trace import Failure, Trace, TraceError, to_dict

ROOT = Path(__file__).resolve().parent.parent
BUG = "interleaved-external-alloc"


def run_pytest(path, cwd, **env):
    """pytest on one generated file, kvprop importable through PYTHONPATH only."""
    base = {k: v for k, v in os.environ.items() if k not in ("KVPROP_VARIANT", "KVPROP_TARGET", "PYTHONPATH")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**base, "PYTHONPATH": str(ROOT), **env},
    )


def simple_trace(**fields) -> Trace:
    config = EngineConfig(AllocatorConfig((FullAttention(block_size=4),), 16, True), 8, 0, "off", 4)
    return Trace(config=config, steps=(Step(times=1),), **fields)


def payloads(marker: Path) -> list:
    m = str(marker)
    return [
        f'"""\nimport pathlib; pathlib.Path({m!r}).write_text("pwned")\n"""',
        f"'''\nimport pathlib; pathlib.Path({m!r}).write_text('pwned')\n'''",
        f"'); import os; os.system('touch {m}') #",
        f'"); import os; os.system("touch {m}") #',
        f"{{x}} {{{{0}}}} {{__import__('os').system('touch {m}')}}",
        f"\\\\ \\'); open({m!r}, 'w') #\\",
        f"\n# comment\nopen({m!r}, 'w').write('pwned')\n",
        f"\u00e9\u2028\u2029\x00\x1b\U0001f600 \N{LATIN SMALL LETTER A WITH GRAVE}; open({m!r}, 'w')",
    ]


FIELDS = ("message", "variant", "target", "exception")  # a kind outside the registry is refused


def hostile_trace(marker: Path, field: str | None = None, payload: str | None = None) -> Trace:
    """``payload`` in ``field``; by default every payload in every field at once."""
    p = payloads(marker)
    if field is not None:
        text = {field: payload}
    else:
        text = {"message": "".join(p[::-1]), "variant": " ".join(p)}
        text |= {"target": ":".join(p), "exception": " ".join(p[::-1])}
    failure = Failure(1, text.get("kind", "block-in-two-groups"), text.get("message", "a message"), "target-crash")
    return simple_trace(
        variant=text.get("variant"),
        target=text.get("target"),
        seed=7,
        failure=attrs.evolve(failure, exception=text.get("exception", "ValueError")),
    )


def test_a_hostile_trace_cannot_run_code(tmp_path):
    """Each payload in each trace field, and all at once: every generated test compiles, runs
    and passes on the correct allocator, and none writes the marker."""
    marker = tmp_path / "pwned"
    out = tmp_path / "generated"
    out.mkdir()
    cases = [(f, p) for f in FIELDS for p in payloads(marker)] + [(None, None)]
    for i, (field, payload) in enumerate(cases):
        source = regress.render(hostile_trace(marker, field, payload), source="'); open('x', 'w') #.json")
        path = out / f"test_hostile_{i}.py"
        path.write_text(source, encoding="utf-8")
        compile(source, str(path), "exec")
    r = run_pytest(out, tmp_path, KVPROP_VARIANT="correct", KVPROP_TARGET="kvprop")
    summary = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr
    assert (r.returncode, marker.exists(), summary.split(" in ")[0]) == (0, False, f"{len(cases)} passed"), r.stdout


def test_trace_text_appears_only_inside_the_one_json_constant(tmp_path):
    trace = hostile_trace(tmp_path / "pwned")
    tree = ast.parse(regress.render(trace))
    strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    fragments = [line for p in payloads(tmp_path / "pwned") for line in p.splitlines() if len(line) > 8]
    holding = [s for s in strings if any(f in s for f in fragments)]
    assert [json.loads(s) for s in holding] == [to_dict(trace)]


def test_the_module_docstring_is_fixed_text(tmp_path):
    hostile = ast.get_docstring(ast.parse(regress.render(hostile_trace(tmp_path / "pwned"))))
    plain = ast.get_docstring(ast.parse(regress.render(simple_trace())))
    assert hostile == plain


def test_a_hostile_kind_is_refused_at_render(tmp_path):
    trace = hostile_trace(tmp_path / "pwned", "kind", payloads(tmp_path / "pwned")[0])
    with pytest.raises(TraceError, match="failure.kind"):
        regress.render(trace)


def test_a_trace_from_dict_would_refuse_is_refused_at_render():
    trace = simple_trace(seed="__import__('os').system('true')")
    with pytest.raises(TraceError, match="seed"):
        regress.render(trace)


@pytest.fixture(scope="module")
def motivating_trace() -> Trace:
    trace = helpers.motivating_trace()
    return attrs.evolve(trace, failure=execute(trace, variant=BUG))


def test_generated_test_fails_on_the_variant_and_passes_on_the_correct_allocator(motivating_trace, tmp_path):
    path = tmp_path / "test_motivating.py"
    path.write_text(regress.render(motivating_trace, source="found.json"), encoding="utf-8")
    bad = run_pytest(path, tmp_path)
    good = run_pytest(path, tmp_path, KVPROP_VARIANT="correct")
    assert (bad.returncode, "FAILED at step" in bad.stdout, good.returncode) == (1, True, 0), bad.stdout + good.stdout


TARGET_MODULE = """
from kvprop.allocator.view import AllocatorView
from kvprop.targets.kvprop import make_allocator


def make_target(config):
    allocator = make_allocator(config)
    return allocator, AllocatorView(allocator)
"""


def test_generated_test_for_a_path_target_runs_from_another_directory(tmp_path):
    project = tmp_path / "proj"
    (project / "mypkg").mkdir(parents=True)
    (project / "mypkg" / "__init__.py").write_text("")
    (project / "mypkg" / "target.py").write_text(TARGET_MODULE)
    path = project / "regressions" / "test_x.py"
    path.parent.mkdir()
    path.write_text(regress.render(simple_trace(target="mypkg.target:make_target")), encoding="utf-8")
    r = run_pytest(path, tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
