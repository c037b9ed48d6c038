"""The structure of the block pool and the tables (invariants 1-6), each a readable check that
raises a naming ``Violation``.

Reference counts, the free queue, groups and sharing, the cache map against the blocks' keys,
conservation, and each request's tables against its tokens and hashes. The rest of what is
verified lives beside it: the data the blocks hold (7, ``kvprop.check.data``), what a refused
allocation and a drain leave (8-9, ``kvprop.check.outcomes``), the allocator's decisions (10,
``kvprop.check.decisions``) and the moments inside a step (``kvprop.check.moments``).

They read the allocator only through its view and the engine's own records, never through
a target's internals, so the same sentences judge kvprop's allocator, its variants and an
external allocator. They state what correct state is, never what one bug looks like.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import attrs

from kvprop.allocator.specs import Mamba, cdiv
from kvprop.check.retention import retained_indices
from kvprop.errors import Violation


def gather_tables(view) -> dict[tuple[str, int], list[int]]:
    return {
        (rid, g): view.request_block_ids(g, rid) for g in range(view.num_groups) for rid in list(view.request_ids(g))
    }


# ---- what a view may report beyond its required calls (docs/targets.md) ------------------
# Every view kvprop holds answers these: a view that does not declare them is completed with
# empty reports when its target is built (kvprop.targets.protocol.complete_view).


def extra_keys(view) -> dict:
    """Block id -> its keys beyond ``cache_key`` (hits inside a block); {} for a view without them."""
    return view.extra_keys()


def further_keys(view, block_id: int) -> list:
    return view.further_keys(block_id)


def keys_of(view, block_id: int) -> tuple:
    """Every key ``block_id`` is cached under: its own, then those inside it."""
    key = view.cache_key(block_id)
    return () if key is None else (key, *further_keys(view, block_id))


def pending_copies(view) -> list:
    """(source id, copy id) of the block copies a view reports queued; none for a view without copies."""
    return view.pending_copies()


NO_COPIES: dict = {}  # read-only: what pending_copy_refs returns while no copy is queued


def pending_copy_refs(view) -> dict:
    """Block id -> references held for queued block copies (each holds its source and its copy
    once); empty for a view without copies. Every check asks, and copies are rare: the empty
    answer builds nothing."""
    pairs = pending_copies(view)
    return Counter(block_id for pair in pairs for block_id in pair) if pairs else NO_COPIES


def refs_outside_tables(view, fenced: dict) -> dict:
    """Block id -> the references no table holds: those of queued block copies, and those of
    deferred frees (``fenced``, the engine's fence: a freed request's blocks while its last
    batch is in flight, kvprop.sim.fence)."""
    copies = pending_copy_refs(view)
    if not fenced:
        return copies
    return Counter(copies) + Counter(fenced)


# ---- per-block sentences, shared by the full sweep and the incremental checker -----------


def block_ref_cnt(block_id: int, ref_cnt: int, holders: int, who=(), copies: int = 0) -> None:
    """1. ref_cnt(b) is never negative and equals the number of (request, group) table entries
    holding b, plus the queued block copies that name b (a copy holds its source and its
    destination until the scheduler takes it; vLLM's ``_apply_cow``) and the deferred frees that
    hold it (``refs_outside_tables``)."""
    if ref_cnt < 0:
        raise Violation("negative-ref-cnt", f"block {block_id} has ref_cnt {ref_cnt}", blocks=[block_id])
    if ref_cnt != holders + copies:
        queued = f" and {copies} queued copies or deferred frees" if copies else ""
        raise Violation(
            "ref-cnt-mismatch",
            f"block {block_id} has ref_cnt {ref_cnt} but {holders} table entries{queued} hold it",
            blocks=[block_id],
            requests=sorted(who),
        )


def block_queue_membership(block_id: int, ref_cnt: int, in_queue: bool) -> None:
    """2. b is in the free queue iff ref_cnt(b) == 0 (b is not the null block)."""
    if (ref_cnt == 0) != in_queue:
        where = "in" if in_queue else "not in"
        raise Violation(
            "free-queue-membership",
            f"block {block_id} has ref_cnt {ref_cnt} and is {where} the free queue",
            blocks=[block_id],
        )


def block_single_group(block_id: int, groups, who=()) -> None:
    """3. A live block belongs to exactly one group."""
    if len(groups) > 1:
        raise Violation(
            "block-in-two-groups",
            f"block {block_id} is live in groups {sorted(groups)}",
            blocks=[block_id],
            requests=sorted(who),
            groups=sorted(groups),
        )


def block_shared_only_if_cached(block_id: int, holders: int, key, who=()) -> None:
    """3. Only cached blocks are shared: a share can only come from a cache hit."""
    if holders > 1 and key is None:
        raise Violation(
            "shared-uncached-block",
            f"block {block_id} is held by {holders} tables but not cached",
            blocks=[block_id],
            requests=sorted(who),
        )


def table_without_repeats(rid: str, group: int, table, null_block_id: int) -> None:
    """3. No table holds a block twice."""
    seen = set()
    for block_id in table:
        if block_id == null_block_id:
            continue
        if block_id in seen:
            raise Violation(
                "duplicate-in-table",
                f"{rid!r} group {group} holds block {block_id} twice",
                blocks=[block_id],
                requests=[rid],
                groups=[group],
            )
        seen.add(block_id)


def block_cache_entry(block_id: int, key, in_map: bool, num_groups: int, is_null: bool) -> None:
    """4. A cached block is in the map under each of its keys; the null block is never cached."""
    if key is None:
        return
    if is_null:
        raise Violation("null-block-cached", f"the null block is cached as {key}", blocks=[block_id])
    if not in_map:
        raise Violation(
            "cache-map-missing", f"block {block_id} says it is cached as {key} but the map lacks it", blocks=[block_id]
        )
    if not 0 <= key[1] < num_groups:
        raise Violation("cache-key-group", f"block {block_id} is cached for group {key[1]}", blocks=[block_id])


def null_block_not_free(block_id: int, in_queue: bool) -> None:
    """2. The null block is never in the free queue (it is never handed out)."""
    if in_queue:
        raise Violation("null-block-free", "the null block is in the free queue", blocks=[block_id])


def null_block_count(block_id: int, ref_cnt: int) -> None:
    """2. The null block is never handed out, touched or freed, so its reference count stays 0,
    the count it is built with. vLLM's pool keeps it so from 0.33.0 (``BlockPool.touch`` and
    ``free_blocks`` skip it); before, both counted it and its count drifted, "not maintained",
    so a target declares this (``Capabilities.null_count_fixed``) only where it holds."""
    if ref_cnt != 0:
        raise Violation("null-block-count", f"the null block has ref_cnt {ref_cnt}, not 0", blocks=[block_id])


def free_queue_links(consistent: bool, detail: str, blocks=()) -> None:
    """2. The free queue's links agree: a walk forwards is a walk backwards reversed."""
    if not consistent:
        raise Violation("free-queue-links", detail, blocks=blocks)


def free_count(linked: int, reported: int) -> None:
    """2. The free count the allocator reports is the number of blocks linked into the queue."""
    if linked != reported:
        raise Violation("free-count", f"{linked} blocks are linked into the free queue but it reports {reported}")


def map_entry(block_id: int, map_key, block_key, further=()) -> None:
    """4. The map holds a block only under a key the block carries."""
    if map_key != block_key and map_key not in further:
        also = f" (and {list(further)})" if further else ""
        raise Violation(
            "cache-map-stale",
            f"cache map holds block {block_id} under {map_key} but the block says {block_key}{also}",
            blocks=[block_id],
        )


# ---- the full sweep ------------------------------------------------------------------------


def check_blocks(view, tables, ref_cnts, keys, null_count_fixed: bool = False, fenced=NO_COPIES) -> None:
    """1-4 for every block, from every table; with ``null_count_fixed`` the null block's count
    too; ``fenced``: the references deferred frees hold (``refs_outside_tables``)."""
    holders: Counter[int] = Counter()
    groups_of: defaultdict[int, set[int]] = defaultdict(set)
    who: defaultdict[int, set[str]] = defaultdict(set)
    for (rid, g), table in tables.items():
        table_without_repeats(rid, g, table, view.null_block_id)
        for block_id in table:
            if block_id != view.null_block_id:
                holders[block_id] += 1
                groups_of[block_id].add(g)
                who[block_id].add(rid)
    in_queue = set(view.free_queue_ids())
    further = extra_keys(view)
    copies = refs_outside_tables(view, fenced)
    mapped = defaultdict(set)
    for key, block_id in sorted(view.cache_map_items(), key=lambda item: item[1]):  # the lowest block first
        map_entry(block_id, key, keys[block_id], further.get(block_id, ()))
        mapped[block_id].add(key)
    for block_id, extra in further.items():
        for key in extra:
            block_cache_entry(block_id, key, key in mapped[block_id], view.num_groups, block_id == view.null_block_id)
    for block_id, ref_cnt in enumerate(ref_cnts):
        is_null = block_id == view.null_block_id
        block_cache_entry(block_id, keys[block_id], keys[block_id] in mapped[block_id], view.num_groups, is_null)
        if is_null:
            null_block_not_free(block_id, block_id in in_queue)
            if null_count_fixed:
                null_block_count(block_id, ref_cnt)
            continue
        block_ref_cnt(block_id, ref_cnt, holders.get(block_id, 0), who.get(block_id, ()), copies.get(block_id, 0))
        block_queue_membership(block_id, ref_cnt, block_id in in_queue)
        block_single_group(block_id, groups_of.get(block_id, ()), who.get(block_id, ()))
        block_shared_only_if_cached(block_id, holders.get(block_id, 0), keys[block_id], who.get(block_id, ()))


def check_free_queue_links(view) -> None:
    """2. The queue's links are consistent, it has no repeats, its length is the free count."""
    forward = view.free_queue_ids()
    backward = view.free_queue_ids_backward()
    free_queue_links(forward == backward[::-1], f"forward walk {forward} and backward walk {backward[::-1]} disagree")
    repeats = [b for b, n in Counter(forward).items() if n > 1]
    if repeats:
        raise Violation("free-queue-repeat", "blocks appear more than once in the free queue", blocks=repeats)
    free_count(len(forward), view.num_free_blocks)


# ---- 5. conservation ----------------------------------------------------------------------


def check_conservation(view, ref_cnts) -> None:
    """5. in-use + free + null = total."""
    check_conservation_counts(view, sum(1 for b, r in enumerate(ref_cnts) if r > 0 and b != view.null_block_id))


def check_conservation_counts(view, in_use: int) -> None:
    if in_use + view.num_free_blocks + 1 != view.num_blocks:
        raise Violation(
            "conservation", f"{in_use} in use + {view.num_free_blocks} free + 1 null != {view.num_blocks} blocks"
        )


# ---- 6. tables against requests -----------------------------------------------------------


def own_cache_key(block_hash: int, group: int):
    """The cache key a request's block with kvprop hash ``block_hash`` carries in ``group`` once
    cached (every target's view reports its keys in these terms)."""
    return (block_hash, group)


def cached_count_covers(rid, group: int, table, hashes, keys, num_cached: int, null: int, start=None) -> None:
    """6. Caching resumes at the cached count, so the first real block there is not already
    cached under the request's own hash: only this request could have cached it, or it was a
    hit, and either way the count should have covered it. ``start``: judge from there on (the
    indices before it held when last judged)."""
    for i in range(num_cached if start is None else max(start, num_cached), min(len(table), len(hashes))):
        block_id = table[i]
        if block_id == null:
            continue
        if keys[block_id] == own_cache_key(hashes[i], group):
            raise Violation(
                "cached-count-behind",
                f"{rid!r} group {group} counts {num_cached} cached blocks but block {block_id} (index {i}) is "
                f"cached under its own hash already: caching resumes too early and would cache it twice",
                blocks=[block_id],
                requests=[rid],
                groups=[group],
            )
        return


def computed_tokens(request, pending: dict) -> int:
    """Tokens whose KV the request's table must cover, counting an in-flight load."""
    if request.request_id in pending:
        return pending[request.request_id]
    return request.num_computed_tokens + request.pending_external


@attrs.define
class TableVerdict:
    """What a check found true of one table, so that the next check of the same table (the
    same list: the mirror replaces a table that changes) judges only what its progress added.
    Facts of the table, the keys of its blocks and the request's hashes, never of its
    progress; the mirror drops the verdict when a block of the table changes key
    (``Mirror.verified``), and hashes only grow."""

    table: list
    request: object
    num_cached: int
    boundary: int  # the request's shared_prefix_boundary (retention reads it)
    nulls_from: int  # no null block from this index on
    covered: int  # cached_count_covers held below this index


def check_tables(
    engine,
    view,
    tables,
    keys,
    pending: dict,
    admitted_now: frozenset = frozenset(),
    only: set | None = None,
    verified: dict | None = None,
) -> None:
    """6. Each admitted request has a table per group whose length fits its tokens, nulls only
    where its window skipped, real blocks where it attends, and whose cached prefix still
    carries the request's own hashes; nobody else has a table or a cached count.

    ``only`` restricts the per-table part to those request ids (the incremental checker
    passes the requests whose tables or progress changed); ``verified`` (the incremental
    checker's ``TableVerdict`` per table) lets a table judged before, unchanged but for its
    request's progress, be judged on what the progress reaches."""
    bs, null, lookahead = view.block_size, view.null_block_id, engine.config.lookahead
    speculative = engine.config.speculative_tokens
    interval, eagle = engine.config.allocator.retention_interval, engine.config.allocator.eagle
    requests = engine.requests

    def admitted(rid):
        return rid in admitted_now or (rid in requests and engine.is_admitted(requests[rid]))

    table_keys = tables if only is None else [(rid, g) for rid in only for g in range(view.num_groups)]
    for rid, g in table_keys:
        if tables.get((rid, g)) is not None and not admitted(rid):
            raise Violation(
                "table-without-admission",
                f"{rid!r} has a table in group {g} but is not admitted",
                requests=[rid],
                groups=[g],
            )
    specs = engine.specs
    scratch = [spec.speculative_blocks if isinstance(spec, Mamba) else 0 for spec in specs]  # a state group's scratch
    for rid in requests if only is None else only:
        if not admitted(rid):
            continue
        request = engine.requests[rid]
        computed = computed_tokens(request, pending)
        hashes, boundary = request.block_hashes, request.shared_prefix_boundary
        # rejected drafts keep their slots: a table may reach the drafts of an earlier step, and
        # the positions of outputs still in flight (kvprop.sim.pipeline)
        ahead = speculative + lookahead + request.num_output_placeholders
        lo, reach = cdiv(computed, bs), cdiv(request.num_tokens + ahead, bs)
        for g, spec in enumerate(specs):
            table = tables.get((rid, g))
            num_cached = view.num_cached_blocks(g, rid)
            if table is None or num_cached is None:
                raise Violation(
                    "admitted-without-table",
                    f"admitted {rid!r} lacks its table or cached count in group {g}",
                    requests=[rid],
                    groups=[g],
                )
            hi = reach + scratch[g]
            if not lo <= len(table) <= hi:
                raise Violation(
                    "table-length",
                    f"{rid!r} group {g} has {len(table)} blocks for {computed} computed of "
                    f"{request.num_tokens} tokens (allowed {lo}..{hi})",
                    requests=[rid],
                    groups=[g],
                )
            skipped_blocks = spec.skipped_tokens(computed) // bs
            verdict = verified.get((rid, g)) if verified is not None else None
            if verdict is not None and not (
                verdict.table is table
                and verdict.request is request
                and verdict.num_cached == num_cached
                and verdict.boundary == boundary
            ):
                verdict = None
            state = isinstance(spec, Mamba)
            if not state and verdict is not None and skipped_blocks >= verdict.nulls_from:
                needed = None  # judged free of nulls from an earlier index on
            else:
                needed = _needed_entries(spec, table, skipped_blocks, computed)
                # a slice searched in C decides; the generator names the first offending index
                held = table[needed.start :] if not state else [table[i] for i in needed]
                if null in held:
                    i = next(i for i in needed if table[i] == null)
                    raise Violation(
                        "null-in-attended-range",
                        f"{rid!r} group {g} has the null block at index {i}, but with {computed} computed tokens "
                        + (
                            f"index {i} must hold the running state or the block the step computes into"
                            if state
                            else f"only the first {skipped_blocks} blocks may be skipped"
                        ),
                        requests=[rid],
                        groups=[g],
                    )
            if num_cached > len(table) or num_cached > len(hashes):
                raise Violation(
                    "cached-count",
                    f"{rid!r} group {g} counts {num_cached} cached blocks with {len(table)} "
                    f"blocks and {len(hashes)} full blocks",
                    requests=[rid],
                    groups=[g],
                )
            covered = min(len(table), len(hashes))
            if verdict is None:
                cached_count_covers(rid, g, table, hashes, keys, num_cached, null)
                cached_prefix_keys(rid, g, spec, interval, request, table, keys, num_cached, null, eagle)
                if verified is not None:
                    nulls_from = len(table) if state else skipped_blocks  # the start of ``needed``
                    verified[(rid, g)] = TableVerdict(table, request, num_cached, boundary, nulls_from, covered)
                continue
            # the prefix and what was covered stand: only indices the hashes reached since
            if covered > verdict.covered:
                cached_count_covers(rid, g, table, hashes, keys, num_cached, null, verdict.covered)
                verdict.covered = covered
            if needed is not None and not state:
                verdict.nulls_from = min(verdict.nulls_from, needed.start)


def cached_prefix_keys(
    rid, g: int, spec, interval, request, table, keys, num_cached: int, null: int, eagle: bool = False
) -> None:
    """6. Every real block a table counts as cached carries the request's own hash there.

    Retention lets a block no served hit can use be counted as cached without a hash
    (kvprop.check.retention), and a state group's checkpoint column carries the key of the
    checkpoint or none (``checkpoint_column_key``); every other key is wrong. The first comparison only decides,
    at C speed, that every key is its own (``own_cache_key``); the loop is the sentence."""
    prefix = table[:num_cached]
    if [keys[b] for b in prefix] == [None if b == null else (h, g) for b, h in zip(prefix, request.block_hashes)]:
        return
    retained = retained_indices(spec, interval, request, num_cached, eagle)
    for i, (block_id, block_hash) in enumerate(zip(prefix, request.block_hashes)):
        if block_id == null:
            continue
        own = own_cache_key(block_hash, g)
        key = keys[block_id]
        if key == own or checkpoint_column_key(spec, request, i, g, key):
            continue
        if not (key is None and retained is not None and i not in retained):
            why = "" if retained is None else " (retention keeps that index)"
            raise Violation(
                "cached-block-lost-hash",
                f"{rid!r} group {g} counts block {block_id} (index {i}) as cached with its own hash "
                f"{own}, but the block is cached as {key}{why}",
                blocks=[block_id],
                requests=[rid],
                groups=[g],
            )


def checkpoint_column_key(spec, request, index: int, group: int, key) -> bool:
    """Whether ``key`` is one a state group's prefill-checkpoint column at ``index`` may have
    (kvprop.allocator.checkpoint): counted as cached like its neighbours, the column holds the
    state at a unit boundary in the next block and is keyed there, or, a checkpoint no later
    request resumes at, has no key (vLLM 0.33.0's ``_cache_partial_tail_block``)."""
    if not isinstance(spec, Mamba) or spec.checkpoint is None:
        return False
    if key is None:
        return True
    unit, bs, hashes = request.unit, spec.block_size, request.unit_hashes
    last = min((index + 2) * bs - 1, len(hashes) * unit)
    return any(key == own_cache_key(hashes[c // unit - 1], group) for c in range((index + 1) * bs, last + 1, unit))


def _needed_entries(spec, table, skipped_blocks: int, computed: int):
    """Table indices that must hold a real block: every one the attention type does not skip;
    for a state group only the running state (after ``computed`` tokens) and the last entry,
    the block the scheduled chunk computes into (the entries between are null until then)."""
    if not isinstance(spec, Mamba):
        return range(skipped_blocks, len(table))
    # With drafts the state may sit in a scratch column, or one moved to the end: the data
    # check finds it where the worker does and requires the table to hold it.
    running = [cdiv(computed, spec.block_size) - 1] if computed > 0 and not spec.speculative_blocks else []
    return sorted({i for i in [*running, len(table) - 1] if 0 <= i < len(table)})
