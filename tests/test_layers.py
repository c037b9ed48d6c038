"""The package's layers: imports flow allocator -> sim -> check -> targets -> search -> repro -> front, never back."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kvprop"
LAYERS = ("allocator", "sim", "check", "targets", "search", "repro", "front", "top")
FOUNDATION = {
    "kvprop",
    "kvprop.__version__",
    "kvprop.errors",
    "kvprop.interrupt",
    "kvprop.capabilities",
    "kvprop.exits",
}  # the version string, the shared exceptions, the interrupt flag and what a target declares, below every layer


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else "top"


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        yield name, path


def imports_of(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def backward_imports():
    found = []
    for name, path in modules():
        here = LAYERS.index(layer_of(name))
        for imported in imports_of(path):
            if not imported.startswith("kvprop") or imported in FOUNDATION:
                continue
            there = layer_of(imported)
            if there in LAYERS and LAYERS.index(there) > here:
                found.append(f"{name} imports {imported}")
    return found


def test_the_top_level_shows_the_layers_one_door_and_the_foundation():
    entries = sorted(p.name for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file())
    foundation = [f"{name[len('kvprop.') :]}.py" for name in FOUNDATION if name.count(".") == 1]
    foundation = [f for f in foundation if f != "__version__.py"]  # a name in kvprop/__init__.py
    layers = [layer for layer in LAYERS if layer != "top"]
    assert entries == sorted(["__init__.py", "__main__.py", *foundation, *layers])


def test_no_module_imports_a_higher_layer():
    assert backward_imports() == []


@pytest.mark.parametrize("layer", ["allocator", "sim", "check", "targets", "search", "repro", "front"])
def test_every_layer_says_what_it_holds(layer):
    doc = ast.get_docstring(ast.parse((PACKAGE / layer / "__init__.py").read_text()))
    assert doc and len(doc) > 80


@pytest.mark.parametrize("module", ["kvprop.search.trace", "kvprop.allocator.kv_cache_manager"])
def test_reading_a_trace_or_building_the_allocator_needs_neither_torch_nor_the_engine(module):
    probe = (
        f"import sys, {module}; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('kvprop.sim', 'kvprop.check'))))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def import_graph() -> dict[str, set[str]]:
    """Module -> the kvprop modules it imports, wherever in it the import stands."""
    names = {name for name, _ in modules()}

    def module_of(imported: str) -> str | None:
        while imported and imported not in names:
            imported = imported.rpartition(".")[0]
        return imported or None

    return {
        name: {m for i in imports_of(path) if (m := module_of(i)) is not None and m != name} for name, path in modules()
    }


def test_no_modules_import_each_other_in_a_circle():
    graph, circles = import_graph(), []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append(
                    " -> ".join(path[path.index(nxt) :] + [node, nxt]) if nxt in path else f"{node} -> {nxt}"
                )
            elif nxt not in state:
                visit(nxt, [*path, node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert circles == []


def test_a_module_past_500_lines_says_why_at_its_top():
    long = [name for name, path in modules() if len(path.read_text().splitlines()) > 500]
    unexplained = [
        name
        for name, path in modules()
        if name in long and "500 lines" not in (ast.get_docstring(ast.parse(path.read_text())) or "")
    ]
    assert unexplained == []
