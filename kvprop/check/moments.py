"""What is judged at the moments blocks change hands or calls are made, rather than of the
state between operations: writes and loads (6, 7), the connector hand-off (7), malformed
calls (11) and what a free must leave behind (12). Each kind is raised by one function here.
"""

from __future__ import annotations

from kvprop.allocator.hashing import state_fingerprint
from kvprop.allocator.specs import cdiv
from kvprop.check.invariants import keys_of, own_cache_key
from kvprop.errors import Violation

# ---- 11. the caller's contract ----------------------------------------------------------------


def whole_state(view) -> tuple:
    """Everything a call could change, for comparing before and after a malformed one."""
    tables = {
        (rid, g): (view.request_block_ids(g, rid), view.num_cached_blocks(g, rid))
        for g in range(view.num_groups)
        for rid in list(view.request_ids(g))
    }
    return view.ref_cnts(), view.cache_keys(), view.free_queue_ids(), tables


def foreign_hits(view, request, hits) -> bool:
    """Whether some real block of ``hits`` is not ``request``'s own cached block at its index: cached
    under none of the keys of the request's prefixes that end inside it (the block's own, or a
    hash unit's when hits may end inside a block)."""
    for g, group_hits in enumerate(hits):
        for i, block in enumerate(group_hits):
            if block.block_id == view.null_block_id:
                continue
            if not request.keys_in_block(i, g).intersection(keys_of(view, block.block_id)):
                return True
    return False


def misuse_outcome(view, call: str, request, before, raised, contract: str) -> None:
    """11. A malformed call the target's contract says it refuses raises and changes nothing; one
    it tolerates may pass (the checks after the operation judge the state)."""
    rid = request.request_id
    if raised is None and contract == "refuses":
        raise Violation(
            "misuse-accepted",
            f"the target accepted a {call} call for {rid!r}, which its caller contract says it refuses",
            requests=[rid],
        )
    if raised is not None:
        after = whole_state(view)
        changed = [
            name for name, x, y in zip(("ref_cnts", "cache keys", "free queue", "tables"), before, after) if x != y
        ]
        if changed:
            raise Violation(
                "misuse-changed-state",
                f"the target refused a {call} call for {rid!r} ({type(raised).__name__}: {raised}) "
                f"but changed its {', '.join(changed)}",
                requests=[rid],
            )


# ---- 12. idle bookkeeping --------------------------------------------------------------------


def freed_request_gone(engine, view, request) -> None:
    """12. Once a request is freed (finish, abort, preemption, failed load) no group keeps a table,
    a cached-block count or any other per-request record for it (vLLM's ``pop_blocks_for_free``
    drops them all), and no load is pending for it."""
    rid = request.request_id
    for g in range(view.num_groups):
        table, count = view.request_block_ids(g, rid), view.num_cached_blocks(g, rid)
        if table is not None or count is not None:
            raise Violation(
                "freed-request-remains",
                f"freed {rid!r} still has {'a table ' + str(table) if table is not None else ''}"
                f"{' and ' if table is not None and count is not None else ''}"
                f"{'a cached-block count ' + str(count) if count is not None else ''} in group {g}",
                requests=[rid],
                groups=[g],
            )
    if engine.connector is not None and rid in engine.connector.pending:
        raise Violation("freed-request-remains", f"freed {rid!r} still has a load pending", requests=[rid])
    records = view.records_of(rid)
    if records:
        raise Violation("freed-request-remains", f"freed {rid!r} is still recorded in {records}", requests=[rid])


# ---- 6 and 7 at the moments blocks change hands ---------------------------------------------


def handoff_exclusive(view, request, tables, num_local: int, num_external: int) -> None:
    """7. Every block allocated for external tokens is the request's alone and uncached when the
    connector takes it: the load writes it without looking at anyone else."""
    bs = view.block_size
    for g, table in enumerate(tables):
        for index in range(num_local // bs, cdiv(num_local + num_external, bs)):
            block_id = table[index]
            if block_id == view.null_block_id:
                continue
            ref_cnt, key = view.ref_cnt(block_id), view.cache_key(block_id)
            if ref_cnt != 1 or key is not None:
                raise Violation(
                    "connector-handoff",
                    f"block {block_id} handed to the connector for {request.request_id!r} group {g} is not "
                    f"exclusively owned (ref_cnt={ref_cnt}, cached as {key})",
                    blocks=[block_id],
                    requests=[request.request_id],
                    groups=[g],
                )


def load_write_owned(view, request, tables, block_ids) -> None:
    """7. A completing load writes only blocks that are still its request's own, and only its own."""
    for group, block_id in block_ids:
        table = tables[group] if group < len(tables) else []
        ref_cnt = view.ref_cnt(block_id)
        if block_id not in table or ref_cnt != 1:
            raise Violation(
                "connector-write-unowned",
                f"block {block_id} is written for {request.request_id!r} group {group} but "
                f"{'is not in its table' if block_id not in table else f'has ref_cnt {ref_cnt}'}",
                blocks=[block_id],
                requests=[request.request_id],
                groups=[group],
            )


def tables_extended(view, request_id: str, before, after) -> None:
    """14. An allocation only extends an admitted request's tables: each entry it held keeps its
    block or becomes the null block (a skipped or relocated block), and none is cut off. The
    worker's copy of a table is append-only, sent as the new blocks of each step (vLLM's
    ``Scheduler._make_cached_request_data``; the comment on ``MambaManager``'s copy-on-write
    for a running request), so any other change leaves it computing into blocks the allocator
    has given to someone else."""
    null = view.null_block_id
    for g, (old, new) in enumerate(zip(before, after)):
        if not old or new is None:
            continue
        cut = len(new) < len(old)
        moved = [i for i, (a, b) in enumerate(zip(old, new)) if a != b and b != null]
        if cut or moved:
            what = (
                f"was cut from {len(old)} to {len(new)} blocks"
                if cut
                else f"has block {new[moved[0]]} at index {moved[0]} where it held block {old[moved[0]]}"
            )
            raise Violation(
                "table-rewritten",
                f"{request_id!r} group {g} {what}; an allocation may only append blocks or null skipped ones",
                blocks=[old[i] for i in moved[:1]] or old[len(new) :],
                requests=[request_id],
                groups=[g],
            )


def write_targets(view, request, group: int, table, start: int, num_tokens: int) -> None:
    """6 and 7. Positions [start, start + num_tokens) have blocks; none is the null block; each is
    the writer's alone, unless it is a cached full block of the same prefix (another request may
    hit it in the same step, before it is written)."""
    bs, null, rid = view.block_size, view.null_block_id, request.request_id
    if start + num_tokens > len(table) * bs:
        raise Violation(
            "table-too-short",
            f"{rid!r} group {group} computes positions [{start}, {start + num_tokens}) with only {len(table)} blocks",
            requests=[rid],
            groups=[group],
        )
    hashes = request.block_hashes
    for index in range(start // bs, cdiv(start + num_tokens, bs)):
        block_id = table[index]
        if block_id == null:
            raise Violation(
                "write-to-null-block",
                f"{rid!r} group {group} computes into block index {index}, which is the null block",
                blocks=[null],
                requests=[rid],
                groups=[group],
            )
        own = own_cache_key(hashes[index], group) if index < len(hashes) else None
        if not writable(view, block_id, own):
            raise Violation(
                "write-to-shared-block",
                f"{rid!r} group {group} computes into block {block_id} (index {index}) with ref_cnt "
                f"{view.ref_cnt(block_id)} and cache key {view.cache_key(block_id)}, expected its own key {own}",
                blocks=[block_id],
                requests=[rid],
                groups=[group],
            )


def writable(view, block_id: int, own) -> bool:
    """A block a request may compute into: held by it alone, or cached under ``own``, the key
    of exactly what it computes there (another request may hit it in the same step)."""
    ref_cnt = view.ref_cnt(block_id)
    return ref_cnt == 1 or (ref_cnt >= 1 and own is not None and view.cache_key(block_id) == own)


def state_write(engine, view, request, group: int, source, start: int, targets) -> None:
    """7, for a state group: the step continues from the state after exactly ``start`` tokens of
    this request's own prefix (a state of another prefix, or one token ahead, is the wrong
    state: vLLM #51100), and writes each state into a block the request owns alone (or that
    already carries its own key for exactly that many tokens)."""
    null, rid = view.null_block_id, request.request_id
    hashes, unit = request.unit_hashes, engine.config.allocator.unit
    for target, index, end in targets:
        # the key of the state after ``end`` tokens (a block's end, or a checkpoint inside a block)
        own = own_cache_key(hashes[end // unit - 1], group) if end % unit == 0 and end // unit <= len(hashes) else None
        if target == null or not writable(view, target, own):
            raise Violation(
                "state-write-unowned",
                f"{rid!r} state group {group} writes the state after {end} tokens into block {target} "
                f"(index {index}, ref_cnt {view.ref_cnt(target)}, key {view.cache_key(target)})",
                blocks=[target],
                requests=[rid],
                groups=[group],
            )
    if start == 0:
        return
    got = engine.memory.read([source * view.block_size])[0] if source not in (None, null) else None
    if got != state_fingerprint(group, start, request.prefix_at(start - 1)):
        raise Violation(
            "state-source-mismatch",
            f"{rid!r} state group {group} continues from block {source}, which does not hold its state "
            f"after {start} tokens",
            blocks=[source] if source is not None else [],
            requests=[rid],
            groups=[group],
        )
