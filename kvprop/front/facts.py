"""``kvprop facts``: the parts of docs/design.md the code knows, rendered from the registries.

A generated block sits between ``<!-- facts:NAME -->`` and ``<!-- /facts -->``; ``RENDERERS``
maps each NAME to a function returning its markdown, so a new block is one function added
there. ``--write`` rewrites every block in place, ``--check`` names the blocks that differ
from what the code says now (exit 1). A block whose name has no renderer is left as it is.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from pathlib import Path

import attrs

from kvprop.errors import ConfigError

PACKAGE = Path(__file__).resolve().parent.parent
DESIGN = PACKAGE.parent / "docs" / "design.md"
BLOCK = re.compile(r"<!-- facts:([a-z_]+) -->\n(.*?)<!-- /facts -->", re.DOTALL)
EXIT_STALE = 1


def kinds() -> str:
    from kvprop.check.kinds import KINDS

    ordered = sorted(KINDS.values(), key=lambda k: k.invariant)
    rows = [f"| `{k.name}` | {k.invariant} | {k.sentence} |" for k in ordered]
    return "\n".join(["| kind | invariant | the sentence it breaks |", "| --- | --- | --- |", *rows])


def invariants() -> str:
    from kvprop.check.kinds import INVARIANTS, KINDS

    lines = []
    for n, inv in sorted(INVARIANTS.items()):
        names = ", ".join(f"`{k.name}`" for k in KINDS.values() if k.invariant == n)
        lines.append(f"{n}. {inv.statement[0].upper()}{inv.statement[1:]}. Kinds: {names}.")
    return "\n".join(lines)


def variants() -> str:
    from kvprop.targets.variants import VARIANTS

    rows = [f"| `{v.name}` | {v.bug} | `{v.caught_as}` | {_replaced(v)} |" for v in VARIANTS.values()]
    head = "| variant | the bug | caught without guards as | what it replaces |"
    return "\n".join([head, "| --- | --- | --- | --- |", *rows])


def targets() -> str:
    from kvprop.capabilities import EVERY, Capabilities, Shapes
    from kvprop.targets.protocol import REGISTRY

    def declared(caps: Capabilities | None) -> str:
        if caps is None:
            return "declared by what its factory returns"
        missing = [name for name in EVERY.declared() if name not in caps.declared()]
        if not caps.declared():
            return "none"
        return "every one" if not missing else "every one but " + ", ".join(f"`{n}`" for n in missing)

    def shapes(s: Shapes | str) -> str:
        if isinstance(s, str):
            return f"the installed release's (`{s}`)"
        return "; ".join(s.limits()) or "every shape"

    rows = [
        f"| `{t.name}` | {t.summary} | {declared(t.capabilities)} | {shapes(t.shapes)} | "
        f"{'its own' if t.own_scheduler else 'kvprop'} |"
        for t in REGISTRY.values()
    ]
    caps = [
        f"| `{f.name}` | {f.metadata['side']} | {', '.join(f'`{c}`' for c in f.metadata['calls'])} | "
        f"{f.metadata['meaning']} |"
        for f in attrs.fields(Capabilities)
    ]
    return "\n".join(
        [
            "| target | what it drives | capabilities declared | shapes it builds | scheduler |",
            "| --- | --- | --- | --- | --- |",
            *rows,
            "",
            "| capability | side | calls it promises | meaning |",
            "| --- | --- | --- | --- |",
            *caps,
        ]
    )


def layout(package: Path = PACKAGE) -> str:
    """Read from disk, not from imports: a module moved or added shows at once."""
    folders: dict[Path, list[Path]] = {}
    for path in sorted(package.rglob("*.py")):
        if "__pycache__" not in path.parts:
            folders.setdefault(path.parent, []).append(path)
    chunks = []
    for folder, paths in sorted(folders.items(), key=lambda item: item[0].relative_to(package).parts):
        rel = folder.relative_to(package.parent).as_posix()
        init = folder / "__init__.py"
        head = f"**`{rel}/`**" + (f": {_summary(init)}" if init in paths else "")
        modules = [f"- `{p.name}`: {_summary(p)}" for p in paths if p.name != "__init__.py"]
        chunks.append("\n".join([head, "", *modules]) if modules else head)
    return "\n\n".join(chunks)


def options() -> str:
    """Every declared option (``kvprop.allocator.specs.OPTIONS``): the trace, the minimiser and
    the sampler read these declarations, so the table is what they do."""
    from kvprop.allocator.options import REQUIRED
    from kvprop.allocator.specs import OPTIONS

    def tries(option) -> str:
        if callable(option.simpler):
            return "smaller values"
        return ", ".join(f"`{_json(v)}`" for v in option.simpler) or "—"

    rows = [
        f"| `{d.name}` | {d.level} | `{_json(d.default) if d.default is not attrs.NOTHING else '—'}` | "
        f"{'required' if d.option.absent is REQUIRED else f'`{_json(d.option.absent)}`'} | {tries(d.option)} | "
        f"{'its own' if d.option.draw else 'the shape code'} | {d.option.doc} |"
        for d in OPTIONS
    ]
    head = "| option | level | default | a trace without it | the minimiser tries | drawn by | meaning |"
    return "\n".join([head, "| --- | --- | --- | --- | --- | --- | --- |", *rows])


def _json(value) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


RENDERERS: dict[str, Callable[[], str]] = {
    "kinds": kinds,
    "invariants": invariants,
    "variants": variants,
    "targets": targets,
    "layout": layout,
    "options": options,
}


def _replaced(variant) -> str:
    """The parts a variant builds the allocator or the engine from that differ from the correct one's."""
    from kvprop.targets.variants import CORRECT

    default, parts = CORRECT.parts, variant.parts
    pairs = (
        ("the manager facade", variant.allocator, CORRECT.allocator),
        ("the engine", variant.engine, CORRECT.engine),
        ("the block pool", parts.pool, default.pool),
    )
    said = [f"{what} (`{mine.__name__}`)" for what, mine, theirs in pairs if mine is not theirs]
    if (parts.unitary, parts.hybrid) != (default.unitary, default.hybrid):
        said.append("the coordinators")
    managers = [spec.__name__ for spec, cls in parts.managers.items() if cls is not default.managers[spec]]
    if managers:
        said.append("every manager" if len(managers) == len(default.managers) else f"the {managers[0]} manager")
    return ", ".join(said)


def _summary(path: Path) -> str:
    """The first sentence of a module's docstring, read from the file (nothing is imported)."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    if not doc:
        return "(no docstring)"
    paragraph = " ".join(doc.split("\n\n")[0].split())
    sentence = re.match(r"(.+?[^\d][.!?])(?:\s|$)", paragraph)  # "13. Replaying" is no sentence
    return sentence.group(1) if sentence else paragraph


def render(name: str) -> str:
    return RENDERERS[name]().strip() + "\n"


def refresh(text: str) -> tuple[str, list[str]]:
    """``text`` with every block that has a renderer rendered anew, and the names of those that
    changed, then of the renderers with no block in ``text``."""
    stale: list[str] = []

    def one(match: re.Match) -> str:
        name, body = match.group(1), match.group(2)
        if name not in RENDERERS:
            return match.group(0)
        fresh = render(name)
        if body != fresh:
            stale.append(name)
        return f"<!-- facts:{name} -->\n{fresh}<!-- /facts -->"

    updated = BLOCK.sub(one, text)
    present = {m.group(1) for m in BLOCK.finditer(text)}
    stale += [f"{name} (no block)" for name in RENDERERS if name not in present]
    return updated, stale


def cmd_facts(args) -> int:
    from kvprop.front.output_paths import unwritable_is_usage

    path = Path(args.file) if args.file else DESIGN
    if not path.is_file():
        raise ConfigError(f"{path} is not a file (--file names the document whose fact blocks to {args.mode})")
    text = path.read_text(encoding="utf-8")
    updated, stale = refresh(text)
    if args.mode == "check":
        if stale:
            print(f"{path}: stale fact blocks: {', '.join(stale)} (run `kvprop facts --write`)")
            return EXIT_STALE
        print(f"{path}: every fact block is current")
        return 0
    if updated != text:
        with unwritable_is_usage(path, "--file" if args.file else "the design document"):
            path.write_text(updated, encoding="utf-8")
    rewritten = [name for name in stale if not name.endswith("(no block)")]
    print(f"{path}: rewrote {', '.join(rewritten) or 'nothing'}")
    missing = [name for name in stale if name.endswith("(no block)")]
    if missing:
        print(f"{path}: no block for {', '.join(missing)}: add <!-- facts:NAME --> ... <!-- /facts --> where it goes")
        return EXIT_STALE
    return 0
