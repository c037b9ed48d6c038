"""A picture of a find: the block pool and the block tables before and after the failing
operation, side by side, with the blocks the find names marked.

``snapshot`` reads an engine's allocator state through the view every target offers (the
same calls the invariants read), so one picture serves kvprop's own allocator, its variants
and vLLM's. ``svg`` draws two snapshots as one self-contained SVG for a report: no external
fonts, scripts or style sheets, every piece of text escaped, the same bytes for the same
snapshots. A pool or a set of tables beyond what stays readable is drawn in part, and the
picture says how much it left out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol
from xml.sax.saxutils import escape

import attrs

# What stays readable: beyond these the picture draws the first ones and says how many it left out.
MAX_BLOCKS = 64
MAX_REQUESTS = 10
MAX_TABLE_ENTRIES = 48
MAX_REQUEST_CHARS = 10  # a longer request id is shortened on the picture, whole in its tooltip

POOL_COLUMNS = 8
CELL_W, CELL_H = 60, 44
TABLE_COLUMNS = 12
ENTRY_W, ENTRY_H = 30, 20
TABLE_LABEL_W = 96
GAP = 4
MARGIN = 16
PANEL_GAP = 32
PANEL_W = max(POOL_COLUMNS * (CELL_W + GAP), TABLE_LABEL_W + TABLE_COLUMNS * (ENTRY_W + GAP))
LINE = 16

# (fill, stroke, dash, text colour) of each state a block can be in.
STYLES: dict[str, tuple[str, str, str | None, str]] = {
    "null": ("#6b6b6b", "#333333", None, "#ffffff"),
    "free": ("#ffffff", "#888888", "4 3", "#555555"),
    "in-use": ("#cfe3f7", "#4a6f94", None, "#1b2a3a"),
}
BROKEN = "#d00000"


class PoolView(Protocol):
    """What a snapshot reads of an allocator: the view's calls (``kvprop.targets.protocol.View``)."""

    num_blocks: int
    num_groups: int
    null_block_id: int

    def ref_cnt(self, block_id: int) -> int: ...

    def cache_key(self, block_id: int) -> Any: ...

    def free_queue_ids(self) -> list[int]: ...

    def request_ids(self, group: int) -> Iterable[str]: ...

    def request_block_ids(self, group: int, request_id: str) -> list[int] | None: ...


class Engine(Protocol):
    """What a snapshot reads of an engine: its allocator's view and its live requests."""

    @property
    def view(self) -> PoolView: ...

    @property
    def requests(self) -> Mapping[str, Any]: ...


@attrs.frozen
class BlockState:
    """One block of the pool: its count, a short label of its cache key (None while uncached),
    whether it is the null block and whether it is in the free queue."""

    block_id: int
    ref_cnt: int
    label: str | None
    is_null: bool
    is_free: bool

    @property
    def style(self) -> str:
        return "null" if self.is_null else "free" if self.is_free else "in-use"


@attrs.frozen
class RequestTables:
    """A request's block tables, one per KV cache group (the null block's id at a null entry)."""

    request_id: str
    groups: tuple[tuple[int, ...], ...]


@attrs.frozen
class Snapshot:
    """The allocator's state at one moment, in terms every target shares."""

    label: str
    blocks: tuple[BlockState, ...]
    tables: tuple[RequestTables, ...]

    def table(self, request_id: str) -> tuple[tuple[int, ...], ...]:
        """``request_id``'s tables, one per group; KeyError if the snapshot holds none for it."""
        for t in self.tables:
            if t.request_id == request_id:
                return t.groups
        raise KeyError(request_id)


def key_label(key: Any) -> str | None:
    """A cache key as a few characters: six hex digits of its hash, then its group.

    Enough to see on a picture which blocks share a key; the key itself is in the trace."""
    if key is None:
        return None
    part, group = key if isinstance(key, tuple) and len(key) == 2 else (key, None)
    if isinstance(part, int):
        text = f"{part & 0xFFFFFF:06x}"
    elif isinstance(part, str):
        text = part.removeprefix("vllm:")[:6]
    else:
        text = repr(part)[:6]
    return text if group is None else f"{text}/{group}"


def snapshot(engine: Engine, label: str) -> Snapshot:
    """The allocator's blocks and the live requests' tables, read through ``engine.view``.

    The requests are the engine's live ones in arrival order, then any request the allocator
    still holds a table for though the engine no longer tracks it (a leak worth seeing)."""
    view = engine.view
    free = set(view.free_queue_ids())
    blocks = tuple(
        BlockState(
            block_id=b,
            ref_cnt=view.ref_cnt(b),
            label=key_label(view.cache_key(b)),
            is_null=b == view.null_block_id,
            is_free=b in free,
        )
        for b in range(view.num_blocks)
    )
    live = list(engine.requests)
    held = {rid for g in range(view.num_groups) for rid in list(view.request_ids(g))}
    order = live + sorted(held.difference(live))
    tables = tuple(
        RequestTables(
            request_id=rid,
            groups=tuple(tuple(view.request_block_ids(g, rid) or ()) for g in range(view.num_groups)),
        )
        for rid in order
    )
    return Snapshot(label=label, blocks=blocks, tables=tables)


# ---- drawing ------------------------------------------------------------------------------


def _clean(text: str) -> str:
    """``text`` without the control characters XML 1.0 cannot carry even escaped."""
    return "".join(c if c >= " " or c in "\t\n\r" else "?" for c in text)


def _text(text: str) -> str:
    return escape(_clean(text))


def _attr(text: str) -> str:
    return escape(_clean(text), {'"': "&quot;"})


def _rect(x: int, y: int, w: int, h: int, style: str) -> str:
    fill, stroke, dash, _ = STYLES[style]
    dashed = f' stroke-dasharray="{dash}"' if dash else ""
    return (
        f'<rect class="{style}" x="{x}" y="{y}" width="{w}" height="{h}" rx="3" '
        f'fill="{fill}" stroke="{stroke}" stroke-width="1"{dashed}/>'
    )


def _broken_mark(x: int, y: int, w: int, h: int) -> str:
    return (
        f'<rect class="broken" x="{x - 2}" y="{y - 2}" width="{w + 4}" height="{h + 4}" rx="4" '
        f'fill="none" stroke="{BROKEN}" stroke-width="3"/>'
    )


def _label(x: int, y: int, text: str, extra: str = "") -> str:
    return f'<text x="{x}" y="{y}"{extra}>{_text(text)}</text>'


def _pool(snap: Snapshot, broken: set[int], y: int) -> tuple[list[str], int]:
    """The pool's cells from ``y`` down, wrapped at ``POOL_COLUMNS``; the elements and the next free y."""
    out = [_label(0, y + 12, f"block pool ({_count(len(snap.blocks), 'block')})", ' font-weight="bold"')]
    y += LINE + 4
    drawn = snap.blocks[:MAX_BLOCKS]
    for i, block in enumerate(drawn):
        x = (i % POOL_COLUMNS) * (CELL_W + GAP) + 2
        top = y + (i // POOL_COLUMNS) * (CELL_H + GAP) + 2
        colour = STYLES[block.style][3]
        head = f"#{block.block_id} null" if block.is_null else f"#{block.block_id}"
        cell = [
            f'<g class="block" data-block="{block.block_id}">',
            _rect(x, top, CELL_W, CELL_H, block.style),
            _label(x + 4, top + 12, head, f' fill="{colour}" font-size="10" font-weight="bold"'),
            _label(x + 4, top + 25, f"ref {block.ref_cnt}", f' fill="{colour}" font-size="10"'),
            _label(x + 4, top + 38, block.label or "-", f' fill="{colour}" font-size="10"'),
        ]
        if block.block_id in broken:
            cell.append(_broken_mark(x, top, CELL_W, CELL_H))
        out.extend([*cell, "</g>"])
    rows = -(-len(drawn) // POOL_COLUMNS)
    y += rows * (CELL_H + GAP) + 4
    left = snap.blocks[MAX_BLOCKS:]
    if left:
        missing = sorted(b.block_id for b in left if b.block_id in broken)
        also = f", among them marked block(s) {', '.join(map(str, missing))}" if missing else ""
        out.append(
            _label(
                0,
                y + 12,
                f"{len(left)} more blocks not drawn (ids {left[0].block_id}-{left[-1].block_id}{also})",
                ' class="left-out"',
            )
        )
        y += LINE
    return out, y


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _short(request_id: str) -> str:
    if len(request_id) <= MAX_REQUEST_CHARS:
        return request_id
    return request_id[: MAX_REQUEST_CHARS - 1] + "\u2026"


def _table_row(
    snap: Snapshot, broken: set[int], rid: str, group: int, table: tuple[int, ...], y: int, many: bool
) -> tuple[list[str], int]:
    """One group's table of one request from ``y`` down: its cells wrapped at ``TABLE_COLUMNS``."""
    styles = {b.block_id: b.style for b in snap.blocks}
    name = f"{_short(rid)} g{group}" if many else _short(rid)
    out = [
        f'<g class="table" data-request="{_attr(rid)}" data-group="{group}">',
        f'<text x="0" y="{y + 14}"><title>{_text(rid)}</title>{_text(name)}</text>',
    ]
    drawn = table[:MAX_TABLE_ENTRIES]
    if not drawn:
        out.append(_label(TABLE_LABEL_W, y + 14, "(no blocks)", ' fill="#777777"'))
    for i, block_id in enumerate(drawn):
        x = TABLE_LABEL_W + (i % TABLE_COLUMNS) * (ENTRY_W + GAP) + 2
        top = y + (i // TABLE_COLUMNS) * (ENTRY_H + GAP) + 2
        style = styles.get(block_id, "in-use")
        entry = [
            f'<g class="entry" data-block="{block_id}">',
            _rect(x, top, ENTRY_W, ENTRY_H, style),
            _label(x + 4, top + 14, str(block_id), f' fill="{STYLES[style][3]}"'),
        ]
        if block_id in broken:
            entry.append(_broken_mark(x, top, ENTRY_W, ENTRY_H))
        out.extend([*entry, "</g>"])
    rows = max(1, -(-len(drawn) // TABLE_COLUMNS))
    y += rows * (ENTRY_H + GAP)
    if len(table) > len(drawn):
        out.append(
            _label(TABLE_LABEL_W, y + 12, f"{len(table) - len(drawn)} more entries not drawn", ' class="left-out"')
        )
        y += LINE
    out.append("</g>")
    return out, y + 2


def _tables(snap: Snapshot, broken: set[int], y: int) -> tuple[list[str], int]:
    """Every drawn request's tables, group by group, from ``y`` down."""
    out = [_label(0, y + 12, f"block tables ({_count(len(snap.tables), 'live request')})", ' font-weight="bold"')]
    y += LINE + 4
    if not snap.tables:
        out.append(_label(0, y + 12, "(no live request)", ' fill="#777777"'))
        y += LINE
    for request in snap.tables[:MAX_REQUESTS]:
        many = len(request.groups) > 1
        for group, table in enumerate(request.groups):
            rows, y = _table_row(snap, broken, request.request_id, group, table, y, many)
            out.extend(rows)
    left = len(snap.tables) - MAX_REQUESTS
    if left > 0:
        rest = [t.request_id for t in snap.tables[MAX_REQUESTS:]]
        names = ", ".join(rest[:8]) + (", ..." if len(rest) > 8 else "")
        out.append(_label(0, y + 12, f"{left} more requests not drawn ({names})", ' class="left-out"'))
        y += LINE
    return out, y


def _panel(snap: Snapshot, broken: set[int], name: str, x: int, y: int) -> tuple[list[str], int]:
    """One snapshot's panel at (x, y); its elements and its height."""
    body = [_label(0, 14, snap.label, ' font-size="13" font-weight="bold"')]
    pool, bottom = _pool(snap, broken, 26)
    tables, bottom = _tables(snap, broken, bottom + 8)
    out = [f'<g class="panel" data-panel="{name}" transform="translate({x},{y})">', *body, *pool, *tables, "</g>"]
    return out, bottom


def _legend(y: int) -> tuple[list[str], int]:
    """What the fills and the marks mean, in one row."""
    items = [
        ("null", "null block"),
        ("free", "free (in the free queue)"),
        ("in-use", "in use (out of the free queue)"),
    ]
    out = ['<g class="legend">']
    x = MARGIN
    for style, text in items:
        out.append(_rect(x, y, 16, 12, style))
        out.append(_label(x + 22, y + 10, text))
        x += 22 + 7 * len(text) + 18
    out.append(_rect(x, y, 16, 12, "in-use"))
    out.append(_broken_mark(x, y, 16, 12))
    out.append(_label(x + 22, y + 10, "broken: a block the find names"))
    out.append(
        _label(
            MARGIN,
            y + 28,
            "a pool cell shows #id, ref_cnt and its cache key (hash/group, - when uncached); "
            "a table cell shows the block id at that entry",
        )
    )
    out.append("</g>")
    return out, y + 36


def svg(before: Snapshot, after: Snapshot, broken_blocks: set[int], title: str) -> str:
    """``before`` and ``after`` side by side as one self-contained SVG, the ``broken_blocks``
    outlined in red wherever they appear (pool and tables, both panels)."""
    broken = set(broken_blocks)
    head = [_label(MARGIN, MARGIN + 14, title, ' font-size="15" font-weight="bold"')]
    legend, top = _legend(MARGIN + 28)
    left, left_h = _panel(before, broken, "before", MARGIN, top + 8)
    right, right_h = _panel(after, broken, "after", MARGIN + PANEL_W + PANEL_GAP, top + 8)
    width = 2 * MARGIN + 2 * PANEL_W + PANEL_GAP
    height = top + 8 + max(left_h, right_h) + MARGIN
    divider = MARGIN + PANEL_W + PANEL_GAP // 2
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="monospace" font-size="11">',
        f"<title>{_text(title)}</title>",
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>',
        *head,
        *legend,
        f'<line x1="{divider}" y1="{top}" x2="{divider}" y2="{height - MARGIN}" stroke="#cccccc"/>',
        *left,
        *right,
        "</svg>",
    ]
    return "\n".join(parts) + "\n"
