"""docs/design.md's generated blocks say what the code says: the kinds, invariants, bug
variants, targets and module layout come from the registries and the package on disk
(``kvprop facts``), and a block left stale after a change to any of them fails here."""

from __future__ import annotations

import re

import attrs

from kvprop.capabilities import Capabilities
from kvprop.check.kinds import INVARIANTS, KINDS
from kvprop.front import facts
from kvprop.front.cli import main
from kvprop.targets.protocol import REGISTRY
from kvprop.targets.variants import VARIANTS


def first_column(table: str) -> list[str]:
    """The backticked names in a markdown table's first column, in order."""
    return re.findall(r"^\| `([^`]+)` \|", table, re.MULTILINE)


def test_every_block_of_the_design_document_is_what_the_code_renders():
    assert facts.refresh(facts.DESIGN.read_text(encoding="utf-8"))[1] == []


def test_the_kinds_block_names_every_kind_once():
    assert sorted(first_column(facts.kinds())) == sorted(KINDS)


def test_the_kinds_block_gives_each_kind_its_invariant():
    rows = re.findall(r"^\| `([^`]+)` \| (\d+) \|", facts.kinds(), re.MULTILINE)
    assert {name: int(n) for name, n in rows} == {k.name: k.invariant for k in KINDS.values()}


def test_the_invariants_block_numbers_every_invariant_in_order():
    assert re.findall(r"^(\d+)\. ", facts.invariants(), re.MULTILINE) == [str(n) for n in sorted(INVARIANTS)]


def test_every_kind_names_an_invariant_the_registry_states():
    assert {k.invariant for k in KINDS.values()} == set(INVARIANTS)


def test_the_invariants_block_lists_each_kind_under_its_invariant():
    lines = dict(re.findall(r"^(\d+)\. (.*)$", facts.invariants(), re.MULTILINE))
    listed = {name: int(n) for n, line in lines.items() for name in re.findall(r"`([^`]+)`", line)}
    assert listed == {k.name: k.invariant for k in KINDS.values()}


def test_the_variants_block_names_every_variant_in_registry_order():
    assert first_column(facts.variants()) == list(VARIANTS)


def test_the_variants_block_names_the_part_a_variant_replaces():
    row = next(line for line in facts.variants().splitlines() if line.startswith("| `evict-keeps-hash`"))
    assert row.rsplit("|", 2)[1].strip() == "the block pool (`EvictKeepsHashPool`)"


def test_the_targets_block_names_every_target_then_every_capability():
    assert first_column(facts.targets()) == [*REGISTRY, *(f.name for f in attrs.fields(Capabilities))]


def test_the_layout_block_names_every_module_on_disk_under_its_folder():
    listed, folder = set(), None
    for line in facts.layout().splitlines():
        if heading := re.match(r"^\*\*`([^`]+)`\*\*", line):
            folder = heading.group(1)
        elif module := re.match(r"^- `([^`]+)`", line):
            listed.add((folder, module.group(1)))
    on_disk = {
        (p.parent.relative_to(facts.PACKAGE.parent).as_posix() + "/", p.name)
        for p in facts.PACKAGE.rglob("*.py")
        if p.name != "__init__.py"
    }
    assert listed == on_disk


def test_a_module_added_on_disk_appears_in_the_layout_under_its_folder(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text('"""The package. More."""\n')
    (package / "sub" / "__init__.py").write_text('"""A folder of parts."""\n')
    (package / "sub" / "new.py").write_text('"""A new part: it does one thing.\n\nDetails."""\n')
    assert facts.layout(package) == (
        "**`pkg/`**: The package.\n\n**`pkg/sub/`**: A folder of parts.\n\n- `new.py`: A new part: it does one thing."
    )


def test_a_renderer_added_to_the_dict_fills_its_block_and_others_stay(monkeypatch):
    monkeypatch.setattr(facts, "RENDERERS", {"extra": lambda: "fresh"})
    text = "<!-- facts:extra -->\nold\n<!-- /facts -->\n<!-- facts:options -->\nmine\n<!-- /facts -->\n"
    expected = "<!-- facts:extra -->\nfresh\n<!-- /facts -->\n<!-- facts:options -->\nmine\n<!-- /facts -->\n"
    assert facts.refresh(text) == (expected, ["extra"])


def test_a_renderer_without_a_block_is_named(monkeypatch):
    monkeypatch.setattr(facts, "RENDERERS", {"extra": lambda: "fresh"})
    assert facts.refresh("no blocks here\n") == ("no blocks here\n", ["extra (no block)"])


def test_check_exits_1_naming_the_stale_block(tmp_path, capsys):
    doc = tmp_path / "design.md"
    current = facts.DESIGN.read_text(encoding="utf-8")
    doc.write_text(current.replace("| `conservation` |", "| `conserved` |"), encoding="utf-8")
    assert main(["facts", "--check", "--file", str(doc)]) == 1
    assert capsys.readouterr().out == f"{doc}: stale fact blocks: kinds (run `kvprop facts --write`)\n"


def test_write_makes_a_stale_document_current(tmp_path):
    doc = tmp_path / "design.md"
    current = facts.DESIGN.read_text(encoding="utf-8")
    doc.write_text(current.replace("| `conservation` |", "| `conserved` |"), encoding="utf-8")
    main(["facts", "--write", "--file", str(doc)])
    assert doc.read_text(encoding="utf-8") == current


def test_a_missing_document_is_unusable_input(tmp_path, capsys):
    assert main(["facts", "--check", "--file", str(tmp_path / "absent.md")]) == 2
