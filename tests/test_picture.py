"""The picture of a find (``kvprop.repro.picture``): a snapshot reads what the allocator holds,
and the SVG draws it so that the marks, the block states and the tables can be read back."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from kvprop.allocator.specs import AllocatorConfig, EngineConfig, FullAttention
from kvprop.repro.picture import MAX_BLOCKS, MAX_REQUESTS, BlockState, RequestTables, Snapshot, snapshot, svg
from kvprop.search.alphabet import AddRequest, Step
from kvprop.search.harness import Harness

NS = {"s": "http://www.w3.org/2000/svg"}


def snap(label, num_blocks=8, tables=(("r0", ((1, 2, 3),)),), free=(5, 6, 7)):
    """A hand-built snapshot: block 0 null, ``free`` in the free queue, every other block held once."""
    blocks = tuple(
        BlockState(
            block_id=b,
            ref_cnt=0 if b == 0 or b in free else 1,
            label=None if b == 0 or b in free else f"{b:06x}/0",
            is_null=b == 0,
            is_free=b in free,
        )
        for b in range(num_blocks)
    )
    return Snapshot(label, blocks, tuple(RequestTables(rid, groups) for rid, groups in tables))


def parse(text: str) -> ET.Element:
    return ET.fromstring(text)


def panel(root: ET.Element, name: str) -> ET.Element:
    return root.find(f"s:g[@data-panel='{name}']", NS)


def test_the_picture_parses_as_xml_with_hostile_ids_and_labels():
    tables = (('<r&0">', ((1, 0, 2),)),)
    root = parse(svg(snap("before <op 7>", tables=tables), snap("after & then", tables=tables), {2}, "find \x01<x>"))
    assert root.tag == "{http://www.w3.org/2000/svg}svg"


def test_a_broken_block_is_marked_in_the_pool_and_the_tables_of_both_panels():
    root = parse(svg(snap("before"), snap("after"), {2}, "t"))
    marked = sorted(
        (name, cell.get("class"), cell.get("data-block"))
        for name in ("before", "after")
        for cell in panel(root, name).iter("{http://www.w3.org/2000/svg}g")
        if cell.find("s:rect[@class='broken']", NS) is not None
    )
    assert marked == [
        ("after", "block", "2"),
        ("after", "entry", "2"),
        ("before", "block", "2"),
        ("before", "entry", "2"),
    ]


def test_the_null_block_a_free_block_and_a_held_block_are_drawn_distinctly():
    root = parse(svg(snap("before"), snap("after"), set(), "t"))
    styles = {}
    for block in ("0", "5", "1"):
        rect = panel(root, "before").find(f"s:g[@data-block='{block}']/s:rect", NS)
        styles[block] = (rect.get("class"), rect.get("fill"), rect.get("stroke-dasharray"))
    assert styles == {
        "0": ("null", "#6b6b6b", None),
        "5": ("free", "#ffffff", "4 3"),
        "1": ("in-use", "#cfe3f7", None),
    }


def test_a_requests_table_cells_carry_its_block_ids_in_order():
    tables = (("r0", ((3, 0, 1, 4),)), ("r1", ((4, 2),)))
    root = parse(svg(snap("before", tables=tables), snap("after", tables=tables), set(), "t"))
    table = panel(root, "after").find("s:g[@data-request='r0']", NS)
    cells = [entry.find("s:text", NS).text for entry in table.findall("s:g[@class='entry']", NS)]
    assert cells == ["3", "0", "1", "4"]


def test_the_same_snapshots_draw_the_same_bytes():
    first = svg(snap("before"), snap("after", free=(4, 5, 6, 7)), {3, 1}, "t")
    again = svg(snap("before"), snap("after", free=(4, 5, 6, 7)), {1, 3}, "t")
    assert first == again


def test_a_pool_beyond_the_drawing_limit_says_how_many_blocks_were_left_out():
    big = snap("before", num_blocks=MAX_BLOCKS + 36)
    root = parse(svg(big, big, {MAX_BLOCKS + 3}, "t"))
    notes = [t.text for t in panel(root, "before").findall("s:text[@class='left-out']", NS)]
    assert notes == [f"36 more blocks not drawn (ids 64-99, among them marked block(s) {MAX_BLOCKS + 3})"]


def test_requests_beyond_the_drawing_limit_are_named_as_left_out():
    tables = tuple((f"r{i}", ((1,),)) for i in range(MAX_REQUESTS + 2))
    root = parse(svg(snap("before", tables=tables), snap("after"), set(), "t"))
    drawn = [t.get("data-request") for t in panel(root, "before").findall("s:g[@class='table']", NS)]
    notes = [t.text for t in panel(root, "before").findall("s:text[@class='left-out']", NS)]
    assert (drawn, notes) == ([f"r{i}" for i in range(MAX_REQUESTS)], ["2 more requests not drawn (r10, r11)"])


def test_a_snapshot_of_kvprops_allocator_holds_its_ref_cnts_and_tables():
    config = EngineConfig(AllocatorConfig((FullAttention(4),), 16))
    harness = Harness(config, device="cpu")
    for op in (
        AddRequest(parent=0, cut=0, extra=9, seed=0, max_new_tokens=3),
        Step(times=1),
        AddRequest(parent=0, cut=1, extra=3, seed=1, max_new_tokens=3),  # shares r0's first two blocks
        Step(times=1),
    ):
        harness.apply(op)
    manager = harness.engine.allocator
    taken = snapshot(harness.engine, "after operation 3 (Step)")
    actual = (
        [b.ref_cnt for b in taken.blocks],
        {t.request_id: t.groups for t in taken.tables},
    )
    expected = (
        [b.ref_cnt for b in manager.pool.blocks],
        {rid: tuple(tuple(t) for t in manager.get_block_ids(rid)) for rid in ("r0", "r1")},
    )
    assert (actual, taken.table("r0")[0][:2] == taken.table("r1")[0][:2]) == (expected, True)


def test_a_snapshot_marks_the_null_block_and_the_free_queue():
    harness = Harness(EngineConfig(AllocatorConfig((FullAttention(4),), 8)), device="cpu")
    harness.apply(AddRequest(parent=0, cut=0, extra=9, seed=0, max_new_tokens=3))
    harness.apply(Step(times=1))
    taken = snapshot(harness.engine, "now")
    actual = ([b.block_id for b in taken.blocks if b.is_null], [b.block_id for b in taken.blocks if b.is_free])
    assert actual == ([0], [4, 5, 6, 7])  # r0's 9 tokens hold blocks 1-3
