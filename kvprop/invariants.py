"""The invariants of DESIGN.md, each a readable check that raises a naming ``Violation``.

They read the allocator only through its view and the engine's own records, never through
a target's internals, so the same sentences judge kvprop's allocator, its variants and an
external allocator. They state what correct state is, never what one bug looks like.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from kvprop.errors import Violation
from kvprop.hashing import fingerprint
from kvprop.paged_memory import UNWRITTEN
from kvprop.request import Status
from kvprop.specs import cdiv


def gather_tables(view) -> dict[tuple[str, int], list[int]]:
    return {
        (rid, g): view.request_block_ids(g, rid) for g in range(view.num_groups) for rid in list(view.request_ids(g))
    }


# ---- 1. ref counts ------------------------------------------------------------------------


def check_ref_counts(view, tables, ref_cnts) -> None:
    """ref_cnt(b) equals the number of (request, group) table entries holding b."""
    holders = Counter(b for table in tables.values() for b in table if b != view.null_block_id)
    for block_id, ref_cnt in enumerate(ref_cnts):
        if block_id == view.null_block_id:
            continue
        if ref_cnt != holders.get(block_id, 0):
            who = sorted({rid for (rid, _), t in tables.items() if block_id in t})
            raise Violation(
                "ref-cnt-mismatch",
                f"block {block_id} has ref_cnt {ref_cnt} but {holders.get(block_id, 0)} table entries hold it",
                blocks=[block_id], requests=who,
            )


# ---- 2. free queue ------------------------------------------------------------------------


def check_free_queue(view, ref_cnts) -> None:
    """b is in the free queue iff ref_cnt(b) == 0 and b is not the null block; links agree."""
    forward = view.free_queue_ids()
    backward = view.free_queue_ids_backward()
    if forward != backward[::-1]:
        raise Violation("free-queue-links", f"forward walk {forward} and backward walk {backward[::-1]} disagree")
    repeats = [b for b, n in Counter(forward).items() if n > 1]
    if repeats:
        raise Violation("free-queue-repeat", "blocks appear more than once in the free queue", blocks=repeats)
    if len(forward) != view.num_free_blocks:
        raise Violation("free-count", f"free queue holds {len(forward)} blocks but reports {view.num_free_blocks}")
    in_queue = set(forward)
    if view.null_block_id in in_queue:
        raise Violation("null-block-free", "the null block is in the free queue", blocks=[view.null_block_id])
    for block_id, ref_cnt in enumerate(ref_cnts):
        if block_id == view.null_block_id:
            continue
        if ref_cnt < 0:
            raise Violation("negative-ref-cnt", f"block {block_id} has ref_cnt {ref_cnt}", blocks=[block_id])
        if (ref_cnt == 0) != (block_id in in_queue):
            where = "in" if block_id in in_queue else "not in"
            raise Violation("free-queue-membership", f"block {block_id} has ref_cnt {ref_cnt} and is {where} the free queue",
                            blocks=[block_id])


# ---- 3. group exclusivity -----------------------------------------------------------------


def check_group_exclusive(view, tables, keys) -> None:
    """A live block belongs to exactly one group; no table holds a block twice; only cached
    blocks are shared (a share can only come from a cache hit)."""
    groups_of = defaultdict(set)
    tables_of = defaultdict(list)
    for (rid, g), table in tables.items():
        seen = set()
        for block_id in table:
            if block_id == view.null_block_id:
                continue
            if block_id in seen:
                raise Violation("duplicate-in-table", f"{rid!r} group {g} holds block {block_id} twice",
                                blocks=[block_id], requests=[rid], groups=[g])
            seen.add(block_id)
            groups_of[block_id].add(g)
            tables_of[block_id].append(rid)
    for block_id, groups in groups_of.items():
        if len(groups) > 1:
            raise Violation("block-in-two-groups", f"block {block_id} is live in groups {sorted(groups)}",
                            blocks=[block_id], requests=sorted(set(tables_of[block_id])), groups=sorted(groups))
        if len(tables_of[block_id]) > 1 and keys[block_id] is None:
            raise Violation("shared-uncached-block", f"block {block_id} is shared but not cached",
                            blocks=[block_id], requests=sorted(tables_of[block_id]), groups=sorted(groups))


# ---- 4. cache map -------------------------------------------------------------------------


def check_cache_map(view, keys) -> None:
    """The cache map and the blocks' hashes agree both ways; the null block is never cached."""
    mapped = {}
    for key, block_id in view.cache_map_items():
        if keys[block_id] != key:
            raise Violation("cache-map-stale", f"cache map holds block {block_id} under {key} but the block says {keys[block_id]}",
                            blocks=[block_id])
        mapped[block_id] = key
    for block_id, key in enumerate(keys):
        if key is None:
            continue
        if block_id == view.null_block_id:
            raise Violation("null-block-cached", f"the null block is cached as {key}", blocks=[block_id])
        if mapped.get(block_id) != key:
            raise Violation("cache-map-missing", f"block {block_id} says it is cached as {key} but the map lacks it",
                            blocks=[block_id])
        if not 0 <= key[1] < view.num_groups:
            raise Violation("cache-key-group", f"block {block_id} is cached for group {key[1]}", blocks=[block_id])


# ---- 5. conservation ----------------------------------------------------------------------


def check_conservation(view, ref_cnts) -> None:
    """in-use + free + null = total."""
    in_use = sum(1 for b, r in enumerate(ref_cnts) if r > 0 and b != view.null_block_id)
    if in_use + view.num_free_blocks + 1 != view.num_blocks:
        raise Violation("conservation", f"{in_use} in use + {view.num_free_blocks} free + 1 null != {view.num_blocks} blocks")


# ---- 6. tables against requests -----------------------------------------------------------


def computed_tokens(request, pending: dict) -> int:
    """Tokens whose KV the request's table must cover, counting an in-flight load."""
    if request.request_id in pending:
        return pending[request.request_id]
    return request.num_computed_tokens + request.pending_external


def check_tables(engine, view, tables, keys, pending: dict, admitted_now: frozenset = frozenset()) -> None:
    """Each admitted request has a table per group whose length fits its tokens, nulls only
    where its window skipped, real blocks where it attends, and whose cached prefix still
    carries the request's own hashes; nobody else has a table or a cached count."""
    bs, null, lookahead = view.block_size, view.null_block_id, engine.config.lookahead
    admitted = {rid for rid, r in engine.requests.items() if engine.is_admitted(r)} | admitted_now
    for (rid, g) in tables:
        if rid not in admitted:
            raise Violation("table-without-admission", f"{rid!r} has a table in group {g} but is not admitted",
                            requests=[rid], groups=[g])
    for rid in admitted:
        request = engine.requests[rid]
        computed = computed_tokens(request, pending)
        for g, spec in enumerate(engine.specs):
            table = tables.get((rid, g))
            num_cached = view.num_cached_blocks(g, rid)
            if table is None or num_cached is None:
                raise Violation("admitted-without-table", f"admitted {rid!r} lacks its table or cached count in group {g}",
                                requests=[rid], groups=[g])
            lo, hi = cdiv(computed, bs), cdiv(request.num_tokens + lookahead, bs)
            if not lo <= len(table) <= hi:
                raise Violation("table-length", f"{rid!r} group {g} has {len(table)} blocks for {computed} computed of "
                                f"{request.num_tokens} tokens (allowed {lo}..{hi})", requests=[rid], groups=[g])
            skipped_blocks = spec.skipped_tokens(computed) // bs
            attended_from = spec.skipped_tokens(computed) // bs
            for i, block_id in enumerate(table):
                if block_id == null and i >= skipped_blocks:
                    raise Violation("null-in-attended-range",
                                    f"{rid!r} group {g} has the null block at index {i}, but with {computed} computed tokens "
                                    f"only the first {skipped_blocks} blocks may be skipped (attended from block {attended_from})",
                                    requests=[rid], groups=[g])
            if num_cached > len(table) or num_cached > len(request.block_hashes):
                raise Violation("cached-count", f"{rid!r} group {g} counts {num_cached} cached blocks with {len(table)} "
                                f"blocks and {len(request.block_hashes)} full blocks", requests=[rid], groups=[g])
            for i in range(num_cached):
                block_id = table[i]
                if block_id == null:
                    continue
                own = engine.own_cache_key(request, i, g)
                if keys[block_id] != own:
                    raise Violation("cached-block-lost-hash",
                                    f"{rid!r} group {g} counts block {block_id} (index {i}) as cached with its own hash "
                                    f"{own}, but the block is cached as {keys[block_id]}",
                                    blocks=[block_id], requests=[rid], groups=[g])


# ---- 7. data ------------------------------------------------------------------------------


def check_data(engine, view, tables, keys) -> None:
    """Every computed position of a running request reads back its fingerprint; every cached
    block holds the data of the prefix its hash names; the null block is never written."""
    bs, null, memory = view.block_size, view.null_block_id, engine.memory
    slots, expected, origin = [], [], []
    for rid, request in engine.requests.items():
        if request.status is not Status.RUNNING:
            continue
        computed, prefix = request.num_computed_tokens, request.prefix
        for g in range(view.num_groups):
            table = tables[(rid, g)]
            for p in range(computed):
                block_id = table[p // bs]
                if block_id == null:
                    continue
                slots.append(block_id * bs + p % bs)
                expected.append(fingerprint(g, p, prefix[p]))
                origin.append((rid, g, p, block_id))
    for block_id, key in enumerate(keys):
        if key is None:
            continue
        rows = engine.expected_cached_row(key)
        if rows is None:
            continue
        start, row = rows
        slots.extend(range(block_id * bs, block_id * bs + bs))
        expected.extend(row)
        origin.extend((f"cached{key}", key[1], start + j, block_id) for j in range(bs))
    slots.extend(range(null * bs, null * bs + bs))
    expected.extend([UNWRITTEN] * bs)
    origin.extend(("null block", -1, j, null) for j in range(bs))
    bad = memory.mismatches(slots, expected)
    if bad:
        who, g, p, block_id = origin[bad[0]]
        got = memory.read([slots[bad[0]]])[0]
        raise Violation("data-mismatch", f"{who} group {g} position {p} in block {block_id} reads {got}, expected "
                        f"{expected[bad[0]]} ({len(bad)} positions wrong)",
                        blocks=sorted({origin[i][3] for i in bad}), requests=[who] if isinstance(who, str) else [],
                        groups=[g] if g >= 0 else [])


# ---- 8. refusals --------------------------------------------------------------------------


def snapshot(view, request_id: str):
    return (
        view.ref_cnts(),
        view.cache_keys(),
        view.free_queue_ids(),
        [view.request_block_ids(g, request_id) for g in range(view.num_groups)],
    )


def check_refusal(view, request_id: str, before) -> None:
    """A refused allocation changes nothing but the skipped blocks it freed."""
    ref_before, keys_before, queue_before, tables_before = before
    ref_after, keys_after, queue_after, tables_after = snapshot(view, request_id)
    freed = Counter()
    for g, (old, new) in enumerate(zip(tables_before, tables_after)):
        if old is None and new is None:
            continue
        if old is None or new is None or len(old) != len(new):
            raise Violation("refusal-changed-table", f"a refused allocation changed {request_id!r}'s group {g} table "
                            f"from {old} to {new}", requests=[request_id], groups=[g])
        for a, b in zip(old, new):
            if a != b:
                if b != view.null_block_id:
                    raise Violation("refusal-changed-table", f"a refused allocation replaced block {a} by {b} in "
                                    f"{request_id!r} group {g}", blocks=[a, b], requests=[request_id], groups=[g])
                freed[a] += 1
    for block_id, (old, new) in enumerate(zip(ref_before, ref_after)):
        if block_id != view.null_block_id and new != old - freed.get(block_id, 0):
            raise Violation("refusal-changed-ref-cnt", f"a refused allocation for {request_id!r} moved block {block_id}'s "
                            f"ref_cnt from {old} to {new}", blocks=[block_id], requests=[request_id])
    if keys_before != keys_after:
        changed = [b for b, (x, y) in enumerate(zip(keys_before, keys_after)) if x != y]
        raise Violation("refusal-changed-cache", f"a refused allocation for {request_id!r} changed cache keys",
                        blocks=changed, requests=[request_id])
    newly_free = set(queue_after) - set(queue_before)
    if [b for b in queue_after if b not in newly_free] != queue_before:
        raise Violation("refusal-changed-queue", f"a refused allocation for {request_id!r} reordered or took from the "
                        f"free queue: {queue_before} -> {queue_after}", requests=[request_id])


# ---- 9. liveness --------------------------------------------------------------------------


def check_drained(engine, view) -> None:
    """After a drain every request is gone and every block is back in the free queue."""
    if engine.requests:
        raise Violation("liveness", f"requests still live after the drain: {sorted(engine.requests)}",
                        requests=sorted(engine.requests))
    if view.num_free_blocks != view.num_blocks - 1:
        held = [b for b, r in enumerate(view.ref_cnts()) if r > 0 and b != view.null_block_id]
        raise Violation("liveness", f"{len(held)} blocks still held after every request ended", blocks=held)
