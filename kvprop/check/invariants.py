"""The invariants of docs/design.md, each a readable check that raises a naming ``Violation``.

They read the allocator only through its view and the engine's own records, never through
a target's internals, so the same sentences judge kvprop's allocator, its variants and an
external allocator. They state what correct state is, never what one bug looks like.
Each kind of ``kvprop.check.kinds`` is raised by exactly one function here.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import attrs

from kvprop.allocator.hashing import fingerprint, state_fingerprint
from kvprop.allocator.specs import Mamba, cdiv
from kvprop.check.retention import retained_indices
from kvprop.errors import Violation
from kvprop.sim.memory import UNWRITTEN
from kvprop.sim.request import Status


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


# ---- per-block sentences, shared by the full sweep and the incremental checker -----------


def block_ref_cnt(block_id: int, ref_cnt: int, holders: int, who=(), copies: int = 0) -> None:
    """1. ref_cnt(b) is never negative and equals the number of (request, group) table entries
    holding b, plus the queued block copies that name b (a copy holds its source and its
    destination until the scheduler takes it; vLLM's ``_apply_cow``)."""
    if ref_cnt < 0:
        raise Violation("negative-ref-cnt", f"block {block_id} has ref_cnt {ref_cnt}", blocks=[block_id])
    if ref_cnt != holders + copies:
        queued = f" and {copies} queued copies" if copies else ""
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


def check_blocks(view, tables, ref_cnts, keys) -> None:
    """1-4 for every block, from every table."""
    holders, groups_of, who = Counter(), defaultdict(set), defaultdict(set)
    for (rid, g), table in tables.items():
        table_without_repeats(rid, g, table, view.null_block_id)
        for block_id in table:
            if block_id != view.null_block_id:
                holders[block_id] += 1
                groups_of[block_id].add(g)
                who[block_id].add(rid)
    in_queue = set(view.free_queue_ids())
    further = extra_keys(view)
    copies = pending_copy_refs(view)
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
        # rejected drafts keep their slots: a table may reach the drafts of an earlier step
        lo, reach = cdiv(computed, bs), cdiv(request.num_tokens + speculative + lookahead, bs)
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
                    nulls_from = len(table) if state else needed.start
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


# ---- 7. data ------------------------------------------------------------------------------


def check_data(engine, view, tables, keys, memo: dict) -> None:
    """Every computed position of a running request reads back its fingerprint; every cached
    block holds the data of the prefix its hash names; the null block is never written."""
    slots, expected, origin = [], [], Origins()
    _expect_computed(engine, view, lambda rid, g: tables[(rid, g)], slots, expected, origin)
    cached = [(b, k) for b, k in enumerate(keys) if k is not None]
    cached += [(b, k) for b, extra in extra_keys(view).items() for k in extra]
    _expect_cached_and_null(engine, view, cached, slots, expected, origin, memo)
    report_mismatch(engine.memory, slots, expected, origin)


def check_recent_data(engine, view, changed_cached, memo: dict, copies: bool = True) -> None:
    """7, incrementally: every write since the last check reads back (two writers of one
    slot in a step cannot both), every position a block copy filled holds what the request
    computing there expects (``copies``; a full sweep's ``check_data`` judges those with every
    other position), every block that changed and is cached holds its hash's data, and the
    null block is unwritten."""
    bs, memory = view.block_size, engine.memory
    slots, expected, copied = memory.take_recent_writes()
    if not slots and not changed_cached and not copied:
        return
    changed_cached = [*changed_cached, *((b, k) for b, _ in changed_cached for k in further_keys(view, b))]
    origin = Origins()
    origin.run(len(slots), lambda j: ("a write this step", -1, slots[j] % bs, slots[j] // bs))
    if copied and copies:

        def table_of(rid, g):
            return view.request_block_ids(g, rid) or ()

        _expect_computed(engine, view, table_of, slots, expected, origin, only=set(copied))
    _expect_cached_and_null(engine, view, changed_cached, slots, expected, origin, memo)
    report_mismatch(memory, slots, expected, origin)


def _expect_computed(engine, view, table_of, slots, expected, origin, only: set | None = None) -> None:
    """Add the fingerprint of every position a running request has computed, through its
    table ``table_of(request id, group)`` (in a state group: the running state, after exactly
    those tokens). ``only``: just these slots, the positions a block copy filled. A copy brings
    whatever its source held, so the value it wrote proves nothing: it must read back as the
    request computing there expects (a copy that ran before its source was computed, vLLM
    0.33.0; docs/findings.md)."""
    bs, null = view.block_size, view.null_block_id
    blocks = None if only is None else {slot // bs for slot in only}
    for rid, request in engine.requests.items():
        if request.status not in (Status.RUNNING, Status.LOADED):
            continue
        computed, prefix = request.num_computed_tokens, request.prefix
        for g, spec in enumerate(engine.specs):
            table = table_of(rid, g)
            if isinstance(spec, Mamba):
                if computed > 0:  # the running state: after exactly the computed tokens
                    block_id = engine.state_block(request, g)
                    if only is None and block_id not in table:
                        raise Violation(
                            "state-not-held",
                            f"{rid!r} state group {g} keeps its state after {computed} tokens in block "
                            f"{block_id}, which its table no longer holds",
                            blocks=[block_id],
                            requests=[rid],
                            groups=[g],
                        )
                    if only is None or block_id * bs in only:
                        slots.append(block_id * bs)
                        expected.append(state_fingerprint(g, computed, prefix[computed - 1]))
                        origin.append((rid, g, computed, block_id))
                continue
            for index in range(cdiv(computed, bs)):
                block_id = table[index]
                if block_id == null or (blocks is not None and block_id not in blocks):
                    continue
                for p in range(index * bs, min(computed, (index + 1) * bs)):
                    slot = block_id * bs + p % bs
                    if only is None or slot in only:
                        slots.append(slot)
                        expected.append(fingerprint(g, p, prefix[p]))
                        origin.append((rid, g, p, block_id))


def expected_cached_row(engine, key, memo: dict):
    """(first position, fingerprints) a block cached under ``key`` must hold, if the hash is known
    (the engine records what every block hash it has seen names)."""
    row = memo.get(key)
    if row is None:
        known = engine.registry.get(key[0])
        if known is None:
            return None
        index, prefix = known
        start = index * engine.block_size
        if isinstance(engine.specs[key[1]], Mamba):  # the state after the block's last token, in slot 0
            row = memo[key] = (start, [state_fingerprint(key[1], start + len(prefix), prefix[-1])])
        else:
            row = memo[key] = (start, [fingerprint(key[1], start + j, h) for j, h in enumerate(prefix)])
    return row


def _expect_cached_and_null(engine, view, cached, slots, expected, origin, memo) -> None:
    """Add what each (block, key) in ``cached`` must hold (its hash's prefix data, where the
    hash is known) and what the null block must hold (nothing ever written)."""
    bs, null = view.block_size, view.null_block_id
    for block_id, key in cached:
        rows = expected_cached_row(engine, key, memo)
        if rows is None:
            continue
        start, row = rows
        slots.extend(range(block_id * bs, block_id * bs + len(row)))
        expected.extend(row)
        origin.run(len(row), lambda j, k=key, p=start, b=block_id: (f"cached{k}", k[1], p + j, b))
    slots.extend(range(null * bs, null * bs + bs))
    expected.extend([UNWRITTEN] * bs)
    origin.run(bs, lambda j: ("null block", -1, j, null))


class Origins:
    """What each expected slot is ((who, group, position, block)), kept as runs and spelled
    out only when a report needs one: most checks find nothing wrong."""

    def __init__(self):
        self.runs: list = []  # (length, function of the offset in the run)

    def append(self, entry: tuple) -> None:
        self.runs.append((1, lambda j, entry=entry: entry))

    def run(self, length: int, at) -> None:
        self.runs.append((length, at))

    def __getitem__(self, i: int) -> tuple:
        for length, at in self.runs:
            if i < length:
                return at(i)
            i -= length
        raise IndexError(i)


def report_mismatch(memory, slots, expected, origin) -> None:
    bad = memory.mismatches(slots, expected)
    if bad:
        who, g, p, block_id = origin[bad[0]]
        got = memory.read([slots[bad[0]]])[0]
        raise Violation(
            "data-mismatch",
            f"{who} group {g} position {p} in block {block_id} reads {got}, expected "
            f"{expected[bad[0]]} ({len(bad)} positions wrong)",
            blocks=sorted({origin[i][3] for i in bad}),
            requests=[who] if isinstance(who, str) else [],
            groups=[g] if g >= 0 else [],
        )


# ---- 8. refusals --------------------------------------------------------------------------


def snapshot(view, request_id: str):
    return (
        view.ref_cnts(),
        view.cache_keys(),
        view.free_queue_ids(),
        [view.request_block_ids(g, request_id) for g in range(view.num_groups)],
    )


def refusal_tables(view, request_id: str, tables_before, tables_after) -> Counter:
    """8. A refused allocation leaves the request's tables as they were, but for skipped blocks
    its window freed (now the null block). Returns how often each block was freed that way."""
    freed = Counter()
    for g, (old, new) in enumerate(zip(tables_before, tables_after)):
        if old is None and new is None:
            continue
        replaced = [] if old is None or new is None else [(a, b) for a, b in zip(old, new) if a != b]
        if old is None or new is None or len(old) != len(new) or any(b != view.null_block_id for _, b in replaced):
            raise Violation(
                "refusal-changed-table",
                f"a refused allocation changed {request_id!r}'s group {g} table from {old} to {new}",
                requests=[request_id],
                groups=[g],
            )
        freed.update(a for a, _ in replaced)
    return freed


def refusal_blocks(request_id: str, changed: set, freed) -> None:
    """8, incrementally: the blocks a refused allocation changed are the skipped blocks it freed."""
    stray = sorted(set(changed) - set(freed))
    if stray:
        raise Violation(
            "refusal-changed-state",
            f"a refused allocation for {request_id!r} changed blocks {stray}, which its window skipping did not free",
            blocks=stray,
            requests=[request_id],
        )


def check_refusal(view, request_id: str, before) -> None:
    """8. A refused allocation changes nothing but the skipped blocks it freed."""
    ref_before, keys_before, queue_before, tables_before = before
    ref_after, keys_after, queue_after, tables_after = snapshot(view, request_id)
    freed = refusal_tables(view, request_id, tables_before, tables_after)
    for block_id, (old, new) in enumerate(zip(ref_before, ref_after)):
        if block_id != view.null_block_id and new != old - freed.get(block_id, 0):
            raise Violation(
                "refusal-changed-ref-cnt",
                f"a refused allocation for {request_id!r} moved block {block_id}'s ref_cnt from {old} to {new}",
                blocks=[block_id],
                requests=[request_id],
            )
    if keys_before != keys_after:
        changed = [b for b, (x, y) in enumerate(zip(keys_before, keys_after)) if x != y]
        raise Violation(
            "refusal-changed-cache",
            f"a refused allocation for {request_id!r} changed cache keys",
            blocks=changed,
            requests=[request_id],
        )
    newly_free = set(queue_after) - set(queue_before)
    if [b for b in queue_after if b not in newly_free] != queue_before:
        raise Violation(
            "refusal-changed-queue",
            f"a refused allocation for {request_id!r} reordered or took from the "
            f"free queue: {queue_before} -> {queue_after}",
            requests=[request_id],
        )


# ---- 9. liveness --------------------------------------------------------------------------


def liveness(engine, steps: int | None = None) -> None:
    """9. With arrivals stopped, every request ends: called during a drain when ``steps`` exceeded
    its bound, and after it (``steps`` None). That every block returns then follows from the
    full sweep the drain ends with: a block held by no table is a ref-cnt-mismatch."""
    if steps is not None or engine.requests:
        after = f"after {steps} drain steps" if steps is not None else "after the drain"
        raise Violation(
            "liveness",
            f"{len(engine.requests)} requests still live {after}: {sorted(engine.requests)}",
            requests=sorted(engine.requests),
        )
