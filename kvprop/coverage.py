"""``kvprop coverage``: how much of the target's allocator the walks reach, measured by coverage.py.

Walks run in this process, one after another (``walk_seed(seed, 0, i)`` for i = 0, 1, ...,
as fuzz worker 0 draws them) until the time budget is spent, under a ``coverage.Coverage``
with branch measurement that is started before the allocator's modules are imported, so
their import-time lines (``def``, ``class``, imports) count as executed. Finds are counted,
not reported: ``kvprop fuzz`` is the command that finds.

What is measured:

- ``kvprop`` (the default): every module of kvprop's own allocator, ``kvprop/allocator/``;
- ``vllm``: vLLM's allocator, ``vllm/v1/core/`` ``block_pool.py``, ``kv_cache_coordinator.py``,
  ``kv_cache_manager.py`` and ``single_type_kv_cache_manager.py``;
- ``package.module:factory``: the module's file and every ``.py`` file under its package's
  directory (a top-level module: its file alone).

The figures are coverage.py's: per file statements, missed statements, branches (branch
exits), partial branches, and the percent of statements and branches together; per class
(its lines from the first decorator to its last line, methods included) the same figures;
and the functions never entered (no executed line in the body). Only the walk driver runs.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import attrs

from kvprop.errors import ConfigError

VLLM_FILES = ("block_pool.py", "kv_cache_coordinator.py", "kv_cache_manager.py", "single_type_kv_cache_manager.py")
VLLM_SCHEDULER_FILES = ("sched/scheduler.py",)
# the offloading connector's scheduler side, relative to the vllm package (0.23.0 on)
VLLM_CONNECTOR_FILE = "distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py"
NAMES = "'kvprop', 'vllm', 'vllm-scheduler' or 'package.module:factory'"  # as kvprop.targets (not imported here)
MAX_OPS = 10_000
PROGRESS_EVERY = 10.0

__all__ = ["Figures", "Report", "check", "measure", "render", "scope", "VLLM_FILES"]


# ---- figures ------------------------------------------------------------------------------


@attrs.frozen
class Figures:
    """coverage.py's counts for a file, a class, or all files together."""

    statements: int
    missed: int
    branches: int  # branch exits, as coverage.py counts them
    missed_branches: int
    partial: int  # missed exits of branch lines that did run (coverage.py's "BrPart")

    @property
    def percent(self) -> float:
        """Statements and branches together, as coverage.py's ``Cover`` column."""
        total = self.statements + self.branches
        done = self.statements - self.missed + self.branches - self.missed_branches
        return 100.0 * done / total if total else 100.0

    @property
    def percent_statements(self) -> float:
        return 100.0 * (self.statements - self.missed) / self.statements if self.statements else 100.0

    def __add__(self, other: Figures) -> Figures:
        return Figures(*(a + b for a, b in zip(attrs.astuple(self), attrs.astuple(other))))

    def as_dict(self) -> dict:
        return {
            **attrs.asdict(self),
            "percent": round(self.percent, 2),
            "percent_statements": round(self.percent_statements, 2),
        }


ZERO = Figures(0, 0, 0, 0, 0)


@attrs.frozen
class FileRow:
    file: str  # relative to the common directory of the measured files
    path: str  # absolute
    figures: Figures


@attrs.frozen
class ClassRow:
    file: str
    name: str  # qualified: Outer.Inner
    line: int
    figures: Figures


@attrs.frozen
class Function:
    file: str
    name: str  # qualified: Class.method, outer.inner
    line: int
    abstract: bool = False  # decorated @abstractmethod: a body no call reaches unless through super()


@attrs.frozen
class Report:
    target: str
    variant: str | None
    driver: str
    seed: int
    max_ops: int
    budget: float
    seconds: float  # the walks' time
    setup_seconds: float  # building the first engine, importing the target under measurement
    runs: int
    steps: int
    finds: int
    refused: int
    measured: str  # what was measured, in words
    root: str  # the common directory the file names are relative to
    files: tuple  # FileRow, with statements
    classes: tuple  # ClassRow
    never_entered: tuple  # Function
    empty_files: tuple = ()  # measured files without a single statement (a docstring alone)
    imported_before: tuple = ()  # measured modules imported before measuring began
    html: str | None = None

    @property
    def total(self) -> Figures:
        return sum((f.figures for f in self.files), ZERO)

    def as_dict(self) -> dict:
        return {
            "target": self.target,
            "variant": self.variant,
            "driver": self.driver,
            "seed": self.seed,
            "max_ops": self.max_ops,
            "budget": self.budget,
            "seconds": round(self.seconds, 3),
            "setup_seconds": round(self.setup_seconds, 3),
            "runs": self.runs,
            "steps": self.steps,
            "finds": self.finds,
            "refused": self.refused,
            "measured": self.measured,
            "root": self.root,
            "total": self.total.as_dict(),
            "files": [{"file": f.file, **f.figures.as_dict()} for f in self.files],
            "classes": [{"file": c.file, "class": c.name, "line": c.line, **c.figures.as_dict()} for c in self.classes],
            "never_entered": [
                {"file": f.file, "function": f.name, "line": f.line, "abstract": f.abstract} for f in self.never_entered
            ],
            "empty_files": list(self.empty_files),
            "imported_before": list(self.imported_before),
            "html": self.html,
        }


# ---- what a target's allocator is ------------------------------------------------------------


@attrs.frozen
class Scope:
    files: tuple  # absolute paths of every file reported
    include: tuple  # coverage.py include patterns
    measured: str
    root: str  # the common directory of the files


def _py_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*.py") if "__pycache__" not in p.parts)


def _scope_of(files, include, measured) -> Scope:
    files = tuple(sorted({os.path.realpath(f) for f in files}))
    if not files:
        raise ConfigError(f"{measured}: no Python file to measure")
    root = os.path.commonpath([os.path.dirname(f) for f in files])
    return Scope(files, tuple(include), measured, root)


def _vllm_scope(target: str = "vllm") -> Scope:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        from kvprop.targets.vllm.loading import INSTALL_HINT  # kvprop's own advice: how to build a vLLM environment

        raise ConfigError(
            f"target {target!r} needs vLLM importable, but there is no module named 'vllm'; {INSTALL_HINT}"
        )
    core = Path(next(iter(spec.submodule_search_locations))) / "v1" / "core"
    names = VLLM_FILES + (VLLM_SCHEDULER_FILES if target == "vllm-scheduler" else ())
    files = [core / name for name in names]
    missing = [str(f.relative_to(core)) for f in files if not f.is_file()]
    if missing:
        raise ConfigError(f"target {target!r}: this vLLM ({core}) has no {missing}; kvprop measures {list(names)}")
    measured = "vLLM's allocator" + (" and scheduler" if target == "vllm-scheduler" else "")
    measured += ": vllm/v1/core/" + ", ".join(names)
    connector = core.parent.parent / VLLM_CONNECTOR_FILE
    if target == "vllm-scheduler" and connector.is_file():
        files.append(connector)
        measured += f", vllm/{VLLM_CONNECTOR_FILE}"
    return _scope_of(files, [str(f.resolve()) for f in files], measured)


def _path_scope(target: str) -> Scope:
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"target must be {NAMES}, got {target!r}")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # as kvprop.targets.load_factory finds it
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError) as e:
        raise ConfigError(f"target {target!r}: cannot import {module_name!r} ({e})") from e
    except Exception as e:  # noqa: BLE001 - a parent package's own code failed: the user's input
        raise ConfigError(f"target {target!r}: importing {module_name!r} raised {type(e).__name__}: {e}") from e
    if spec is None or not spec.origin or not os.path.isfile(spec.origin):
        raise ConfigError(f"target {target!r}: cannot import {module_name!r} (no such module, or not a .py file)")
    origin = Path(spec.origin).resolve()
    if spec.submodule_search_locations:  # the module is a package: its directory
        directory = origin.parent
    elif "." in module_name:  # its package's directory
        directory = origin.parent
    else:  # a top-level module: its file alone
        return _scope_of([origin], [str(origin)], f"{origin.name} (the target's module; it has no package)")
    files = _py_files(directory)
    return _scope_of(
        files, [str(directory / "*")], f"{origin.name} and its package directory {directory.name}/ ({len(files)} files)"
    )


def scope(target: str | None) -> Scope:
    """The files ``kvprop coverage`` measures for ``target``; a ConfigError if it has none."""
    if target in (None, "kvprop"):
        directory = Path(__file__).resolve().parent / "allocator"
        return _scope_of(_py_files(directory), [str(directory / "*")], "kvprop's own allocator: kvprop/allocator/")
    if target in ("vllm", "vllm-scheduler"):
        return _vllm_scope(target)
    if not isinstance(target, str):
        raise ConfigError(f"target must be {NAMES}, got {target!r}")
    return _path_scope(target)


# Imported untraced before measuring starts, so that the budget goes to walks, not to imports under
# the tracer: what the walks need and nothing measured (none of these imports a measured module; were
# one to, the report would name it under ``imported_before``).
WARM = {"vllm": ("vllm", "vllm.sampling_params", "vllm.v1.kv_cache_interface", "vllm.v1.core.kv_cache_utils")}
WARM["vllm-scheduler"] = (*WARM["vllm"], "vllm.config")


def _warm(target) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in ("torch", *WARM.get(target, ())):
            if name.startswith("vllm"):
                os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # as kvprop.targets.vllm.loading does
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - building the target under measurement says what is wrong
                return


def _imported_before(files) -> list[str]:
    """Measured modules already imported (their import-time lines cannot count as executed)."""
    wanted = set(files)
    found = []
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if path and os.path.realpath(path) in wanted and _has_statements(os.path.realpath(path)):
            found.append(name)
    return sorted(found)


def _has_statements(path: str) -> bool:
    try:
        body = ast.parse(Path(path).read_text(encoding="utf-8")).body
    except (OSError, SyntaxError, ValueError):
        return True
    first = body[0] if body else None
    docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
    return len(body) > int(docstring)


# ---- per class and per function, from the source's syntax tree -------------------------------


@attrs.frozen
class Executed:
    """One file's measured data, as coverage.py's JSON report gives it, plus its arcs."""

    executed: frozenset
    missing: frozenset
    excluded: frozenset
    executed_branches: tuple  # (from, to) pairs
    missing_branches: tuple
    arcs: frozenset  # every measured (from, to) arc; negative numbers are entries and exits

    def figures(self, lo: int = 1, hi: int = 2**31) -> Figures:
        """The figures of lines ``lo``..``hi``: statements there, branches whose source is there."""
        statements = sum(1 for line in self.executed | self.missing if lo <= line <= hi)
        missed = sum(1 for line in self.missing if lo <= line <= hi)
        done = sum(1 for a, _ in self.executed_branches if lo <= a <= hi)
        missed_branches = [a for a, _ in self.missing_branches if lo <= a <= hi]
        partial = sum(1 for a in missed_branches if a not in self.missing)
        return Figures(statements, missed, done + len(missed_branches), len(missed_branches), partial)


def _definitions(tree: ast.AST):
    """(kind, qualified name, node) for every class and function, outermost first."""
    out = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                out.append(("class" if isinstance(child, ast.ClassDef) else "function", name, child))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return out


def _first_line(node) -> int:
    return min([node.lineno, *(d.lineno for d in node.decorator_list)])


def _abstract(node) -> bool:
    return any(ast.unparse(d).split(".")[-1] == "abstractmethod" for d in node.decorator_list)


def _entered(node, data: Executed) -> bool:
    """A line of the body ran, or (a one-line function) the function's code was entered."""
    start = max(node.body[0].lineno, node.lineno + 1)
    if any(start <= line <= node.end_lineno for line in data.executed):
        return True
    first = _first_line(node)  # coverage.py enters a function with the arc (-co_firstlineno, line)
    return any(a < 0 and first <= -a <= node.lineno and node.lineno <= b <= node.end_lineno for a, b in data.arcs)


def analyse(path: str, name: str, data: Executed):
    """(class rows, functions never entered) of one file."""
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return [], []
    classes, never = [], []
    for kind, qualname, node in _definitions(tree):
        if node.lineno in data.excluded:
            continue
        if kind == "class":
            classes.append(ClassRow(name, qualname, node.lineno, data.figures(_first_line(node), node.end_lineno)))
        elif not _entered(node, data):
            never.append(Function(name, qualname, node.lineno, _abstract(node)))
    return classes, never


def _file_data(cov, files) -> dict:
    """Absolute path -> (coverage.py's summary Figures, Executed) for each of ``files``."""
    with tempfile.TemporaryDirectory(prefix="kvprop-coverage-") as tmp:
        out = os.path.join(tmp, "coverage.json")
        cov.json_report(morfs=list(files), outfile=out)
        with open(out, encoding="utf-8") as f:
            report = json.load(f)
    measured = cov.get_data()
    result = {}
    for key, entry in report["files"].items():
        path = os.path.realpath(key)
        s = entry["summary"]
        figures = Figures(
            s["num_statements"],
            s["missing_lines"],
            s.get("num_branches", 0),
            s.get("missing_branches", 0),
            s.get("num_partial_branches", 0),
        )
        arcs = measured.arcs(path) if path in measured.measured_files() else None
        result[path] = (
            figures,
            Executed(
                frozenset(entry["executed_lines"]),
                frozenset(entry["missing_lines"]),
                frozenset(entry.get("excluded_lines", ())),
                tuple(map(tuple, entry.get("executed_branches", ()))),
                tuple(map(tuple, entry.get("missing_branches", ()))),
                frozenset(arcs or ()),
            ),
        )
    return result


def tabulate(cov, sc: Scope):
    """(file rows, class rows, functions never entered, empty files) of what ``cov`` measured."""
    data = _file_data(cov, sc.files)
    files, classes, never, empty = [], [], [], []
    for path in sc.files:
        name = os.path.relpath(path, sc.root)
        figures, executed = data.get(path, (ZERO, None))
        if figures.statements == 0:
            empty.append(name)
            continue
        files.append(FileRow(name, path, figures))
        c, n = analyse(path, name, executed)
        classes += c
        never += n
    return files, classes, never, empty


# ---- the measurement ------------------------------------------------------------------------


VLLM_TARGETS = ("vllm", "vllm-scheduler")


def targets_of(target) -> list:
    """The targets a measurement walks: ``A+B`` alternates walks between vLLM's two targets
    (what the harness reaches of vLLM's KV core, driven both ways); anything else is one."""
    if not isinstance(target, str) or "+" not in target:
        return [target]
    names = target.split("+")
    if len(set(names)) != len(names) or not set(names) <= set(VLLM_TARGETS):
        raise ConfigError(
            f"target {target!r}: several targets must be distinct ones of {list(VLLM_TARGETS)}, joined by '+'"
        )
    return names


def check(target=None, variant=None, seconds: float = 60.0, driver: str = "walk", max_ops: int = 200) -> Scope:
    """The measured files, after checking the arguments that need no import of the target;
    bad input is a ConfigError (an unknown variant is found by ``measure``)."""
    targets = targets_of(target)
    if len(targets) > 1:
        for one in targets:
            check(one, variant, seconds, driver, max_ops)
        return scope("vllm-scheduler" if "vllm-scheduler" in targets else "vllm")
    if driver != "walk":
        raise ConfigError(f"kvprop coverage runs the walk driver only, not {driver!r}")
    if not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(f"seconds must be a finite number > 0, got {seconds!r}")
    if not isinstance(max_ops, int) or not 1 <= max_ops <= MAX_OPS:
        raise ConfigError(f"max_ops must be an integer in [1, {MAX_OPS:,}], got {max_ops!r}")
    if target not in (None, "kvprop") and variant not in (None, "correct"):
        raise ConfigError(f"variant {variant!r} applies to the kvprop target only, not to target {target!r}")
    return scope(target)


PROBE_ATTEMPTS = 64


def measure(
    target=None,
    variant=None,
    seconds: float = 60.0,
    seed: int = 0,
    driver: str = "walk",
    max_ops: int = 200,
    device=None,
    html=None,
    progress=None,
    journal=None,
) -> Report:
    """Walk ``target`` for ``seconds`` under coverage.py and report what of its allocator ran.

    ``html``: a directory for coverage.py's HTML report. ``progress(runs, steps, elapsed)``
    is called about every ``PROGRESS_EVERY`` seconds. Bad input is a ConfigError. ``kvprop
    coverage`` runs it in a supervised worker, whose ``journal`` records each walk."""
    try:
        import coverage
    except ImportError:
        raise ConfigError("kvprop coverage needs coverage.py: pip install 'coverage>=7'") from None

    sc = check(target, variant, seconds, driver, max_ops)
    html_dir = None
    if html is not None:
        html_dir = Path(html)
        if html_dir.exists() and not html_dir.is_dir():
            raise ConfigError(f"--html {str(html)!r} is a file; give a directory")
    targets = targets_of(target)
    for one in targets:
        _warm(one)
    imported_before = _imported_before(sc.files)
    cov = coverage.Coverage(branch=True, include=list(sc.include), data_file=None, config_file=False)
    cov.set_option("run:disable_warnings", ["no-data-collected", "module-not-imported", "module-not-measured"])
    runs = steps = finds = refused = 0
    setup = time.monotonic()
    cov.start()
    try:
        if target in (None, "kvprop"):
            from kvprop.targets.variants import get_variant

            get_variant(variant)
        else:
            from kvprop.search.supervisor import probe_here
            from kvprop.targets import load_factory

            for one in targets:
                load_factory(one)
                refusal = probe_here(journal, one, variant, device, PROBE_ATTEMPTS)
                if refusal is not None:
                    raise ConfigError(
                        f"target {one!r} could not build any of {PROBE_ATTEMPTS} sampled configurations; "
                        f"first refusal: {refusal}"
                    )
        if device is not None:
            from kvprop.sim.memory import pick_device

            pick_device(device)
        from kvprop.search.walk import run_walk, walk_seed

        started = last = time.monotonic()
        while True:
            one = targets[runs % len(targets)]  # walk i's seed on one target, walk i + 1's on the next
            result = run_walk(
                walk_seed(seed, 0, runs), variant, one, device=device, max_ops=max_ops, journal=journal, index=runs
            )
            runs += 1
            steps += result.steps_run
            finds += result.failure is not None
            refused += result.refused is not None
            now = time.monotonic()
            if now - started >= seconds:
                break
            if progress is not None and now - last >= PROGRESS_EVERY:
                last = now
                progress(runs, steps, now - started)
    finally:
        cov.stop()
    elapsed = time.monotonic() - started
    setup = started - setup
    files, classes, never, empty = tabulate(cov, sc)
    if html_dir is not None:
        html_dir.mkdir(parents=True, exist_ok=True)
        cov.html_report(morfs=list(sc.files), directory=str(html_dir), title=f"kvprop coverage: {sc.measured}")
    return Report(
        target=target or "kvprop",
        variant=variant,
        driver=driver,
        seed=seed,
        max_ops=max_ops,
        budget=float(seconds),
        seconds=elapsed,
        setup_seconds=setup,
        runs=runs,
        steps=steps,
        finds=finds,
        refused=refused,
        measured=sc.measured,
        root=sc.root,
        files=tuple(files),
        classes=tuple(classes),
        never_entered=tuple(never),
        empty_files=tuple(empty),
        imported_before=tuple(imported_before),
        html=str(html_dir / "index.html") if html_dir is not None else None,
    )


# ---- the human report -------------------------------------------------------------------------


def _table(head: str, rows, total=None, percent_statements: bool = True) -> list[str]:
    """Aligned columns: a name, then the figures."""
    columns = ["stmts", "miss", "branch", "part", "cover"] + (["stmts%"] if percent_statements else [])

    def cells(f: Figures):
        out = [f"{f.statements:,}", f"{f.missed:,}", f"{f.branches:,}", f"{f.partial:,}", f"{f.percent:.1f}%"]
        return out + ([f"{f.percent_statements:.1f}%"] if percent_statements else [])

    body = [(name, cells(f)) for name, f in rows]
    if total is not None:
        body.append(("TOTAL", cells(total)))
    width = max([len(head), *(len(name) for name, _ in body)])
    widths = [max([len(c), *(len(r[i]) for _, r in body)]) for i, c in enumerate(columns)]

    def line(name, values):
        return f"{name:<{width}}  " + "  ".join(f"{v:>{w}}" for v, w in zip(values, widths))

    lines = [line(head, columns), "-" * len(line(head, columns))]
    for i, (name, values) in enumerate(body):
        if total is not None and i == len(body) - 1:
            lines.append("-" * len(lines[0]))
        lines.append(line(name, values))
    return lines


def render(report: Report) -> str:
    r = report
    variant = f", variant {r.variant}" if r.variant else ""
    lines = [
        f"coverage of target {r.target}{variant}: walk driver, seed {r.seed}, up to {r.max_ops} operations a walk",
        f"measured: {r.measured} (files relative to {r.root})",
        f"ran {r.runs:,} walks, {r.steps:,} steps in {r.seconds:.1f}s (after {r.setup_seconds:.1f}s of set-up; "
        f"{r.finds:,} finds, {r.refused:,} configurations refused)",
    ]
    if r.imported_before:
        lines.append(
            f"note: {', '.join(r.imported_before)} were imported before measuring began: "
            f"their import-time lines (def, class, imports) count as missed"
        )
    lines += ["", *_table("file", [(f.file, f.figures) for f in r.files], r.total)]
    if r.empty_files:
        lines.append(f"no statements (not counted): {', '.join(r.empty_files)}")
    lines += ["", *_table("class", [(f"{c.file}:{c.name}", c.figures) for c in r.classes])]
    if not r.never_entered:
        lines += ["", "functions never entered: none"]
    else:
        lines += ["", f"functions never entered ({len(r.never_entered)}):"]
        width = max(len(f"{f.file}:{f.line}") for f in r.never_entered)
        lines += [
            f"  {f'{f.file}:{f.line}':<{width}}  {f.name}{' (abstract)' if f.abstract else ''}" for f in r.never_entered
        ]
    if r.html:
        lines += ["", f"wrote coverage.py's HTML report: {r.html}"]
    return "\n".join(lines)
