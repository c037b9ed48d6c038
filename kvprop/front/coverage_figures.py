"""The figures of ``kvprop coverage``, read from coverage.py's data: per file, per class and the
functions never entered, and their tables (``kvprop.front.coverage`` measures; this reads).
"""

from __future__ import annotations

import ast
import json
import os
import tempfile
from pathlib import Path

import attrs


@attrs.frozen
class Scope:
    """What ``kvprop coverage`` measures for a target: its files, as coverage.py includes them."""

    files: tuple  # absolute paths of every file reported
    include: tuple  # coverage.py include patterns
    measured: str
    root: str  # the common directory of the files


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
class DefinitionRow:
    """A class's or a function's figures: the statements of the function bodies inside it."""

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
    classes: tuple  # DefinitionRow of each class
    never_entered: tuple  # Function
    functions: tuple = ()  # DefinitionRow of each function: the statements of its body (--json only)
    empty_files: tuple = ()  # measured files without a single statement (a docstring alone)
    imported_before: tuple = ()  # measured modules imported before measuring began
    html: str | None = None
    # for an engine that registers KV cache specs (vLLM): each registered spec as a dict
    # (spec, manager, driven, reason), kvprop.targets.vllm.specs.census
    specs: tuple = ()

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
            "functions": [
                {"file": f.file, "function": f.name, "line": f.line, **f.figures.as_dict()} for f in self.functions
            ],
            "empty_files": list(self.empty_files),
            "imported_before": list(self.imported_before),
            "html": self.html,
            "specs": [dict(row) for row in self.specs],
        }


@attrs.frozen
class Executed:
    """One file's measured data, as coverage.py's JSON report gives it, plus its arcs."""

    executed: frozenset
    missing: frozenset
    excluded: frozenset
    executed_branches: tuple  # (from, to) pairs
    missing_branches: tuple
    arcs: frozenset  # every measured (from, to) arc; negative numbers are entries and exits

    def figures_of(self, lines) -> Figures:
        """The figures of the statements on ``lines``, and of the branches whose source is there."""
        statements = sum(1 for line in self.executed | self.missing if line in lines)
        missed = sum(1 for line in self.missing if line in lines)
        done = sum(1 for a, _ in self.executed_branches if a in lines)
        missed_branches = [a for a, _ in self.missing_branches if a in lines]
        partial = sum(1 for a in missed_branches if a not in self.missing)
        return Figures(statements, missed, done + len(missed_branches), len(missed_branches), partial)


def function_lines(node) -> frozenset:
    """The lines of the bodies of the functions defined in ``node`` (a class, or a function and
    those inside it): what runs when a method is called, not what runs as the class is defined
    (its ``def`` lines, decorators and attributes run at import, walks or none). A body on its
    ``def`` line runs both ways and is left out."""
    lines: set = set()
    for child in ast.walk(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for statement in child.body:
                lines.update(range(statement.lineno, (statement.end_lineno or statement.lineno) + 1))
            lines.discard(child.lineno)
    return frozenset(lines)


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
    """(class rows, functions never entered, function rows) of one file."""
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return [], [], []
    classes, never, functions = [], [], []
    for kind, qualname, node in _definitions(tree):
        if node.lineno in data.excluded:
            continue
        row = DefinitionRow(name, qualname, node.lineno, data.figures_of(function_lines(node)))
        if kind == "class":
            classes.append(row)
            continue
        functions.append(row)
        if not _entered(node, data):
            never.append(Function(name, qualname, node.lineno, _abstract(node)))
    return classes, never, functions


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
    """(file rows, class rows, functions never entered, empty files, function rows) of what
    ``cov`` measured."""
    data = _file_data(cov, sc.files)
    files, classes, never, empty, functions = [], [], [], [], []
    for path in sc.files:
        name = os.path.relpath(path, sc.root)
        figures, executed = data.get(path, (ZERO, None))
        if figures.statements == 0:
            empty.append(name)
            continue
        files.append(FileRow(name, path, figures))
        c, n, f = analyse(path, name, executed)
        classes += c
        never += n
        functions += f
    return files, classes, never, empty, functions


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
    if r.specs:
        driven = [row for row in r.specs if row["driven"]]
        lines.append(f"specs driven: {len(driven)} of {len(r.specs)} the release registers")
        width = max(len(row["spec"]) for row in r.specs)
        lines += [
            f"  refused: {row['spec']:<{width}}  {row['reason'] or 'kvprop records no reason'}"
            for row in r.specs
            if not row["driven"]
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
