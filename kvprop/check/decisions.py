"""Oracles for the allocator's decisions, computed from the view alone: may this allocation be
refused, must it be; how long a cache hit the prefix cache allows.

A wrong refusal leaves state untouched and a too-short hit only wastes work, so no state
check sees either; these judge the answer itself. They state the contract loosely enough
for every target: an allocation must be accepted when it fits under the most
conservative count (every evictable hit block counted as taken, no window-skipped block
counted as freed), and must be refused when it does not fit under the most generous one
(hit blocks the window skips need nothing, skipped blocks the request alone holds are
freed first). Between the two bounds either answer is the target's to choose.
"""

from __future__ import annotations

import attrs

from kvprop.allocator.checkpoint import chunk_checkpoint
from kvprop.allocator.specs import ChunkedLocal, FullAttention, Mamba, SlidingWindow, cdiv
from kvprop.check.invariants import keys_of
from kvprop.errors import Violation


def capacity_bounds(
    engine, request, num_new_tokens: int, kwargs, tables, same_step_keys=frozenset()
) -> tuple[int, int, int, int]:
    """(generous need, conservative need, free blocks now, blocks the window's skipping frees);
    ``tables`` are the request's block ids per group (None where it has none);
    ``same_step_keys`` the keys cached in the current step where a hit on them may wait
    (``Checker.same_step_groups``)."""
    view = engine.view
    bs, null = view.block_size, view.null_block_id
    hits = kwargs.get("new_computed_blocks")
    computed = (
        request.num_computed_tokens
        + kwargs.get("num_new_computed_tokens", 0)
        + kwargs.get("num_external_computed_tokens", 0)
    )
    local = request.num_computed_tokens + kwargs.get("num_new_computed_tokens", 0)
    main = computed + num_new_tokens
    slots = main + kwargs.get("num_lookahead_tokens", 0)
    generous = conservative = freed = 0
    for g, spec in enumerate(engine.specs):
        skipped = spec.skipped_tokens(max(0, computed - request.num_in_flight)) // bs  # settled basis
        table = tables[g]
        if isinstance(spec, Mamba) and spec.mode == "align":
            group_hits = hits[g] if hits is not None else ()
            checkpoint = _possible_checkpoint(engine, request, spec, computed, main)
            need, frees = _state_group_need(
                view, table, group_hits, main, computed, same_step_keys, spec.speculative_blocks, checkpoint
            )
            if engine.config.allocator.partial_hits:
                # a copy of the shared state block: certain when the hit ends inside it; possible
                # for an admitted request that keyed its running block at a boundary inside it
                copy = _copy_of_tail([b.block_id for b in group_hits], local, bs)
                possible = int(table is not None)
                need = (need[0] + copy, need[1] + copy + possible)
            generous, conservative, freed = generous + need[0], conservative + need[1], freed + frees
            continue
        if table is not None:
            grow = max(0, cdiv(slots, bs) - len(table))
            generous, conservative = generous + grow, conservative + grow
            for i in range(min(skipped, len(table)) - 1, -1, -1):
                if table[i] == null:
                    break  # everything before was skipped by an earlier call
                freed += view.ref_cnt(table[i]) == 1
            continue
        group_hits = [b.block_id for b in hits[g]] if hits is not None else []
        evictable = [i for i, b in enumerate(group_hits) if b != null and view.ref_cnt(b) == 0]
        copy = _copy_of_tail(group_hits, local, bs)
        if copy and any(key in same_step_keys for key in keys_of(view, group_hits[-1])):
            conservative = view.num_blocks + 1  # the copy's source is keyed this step: may wait
        generous += max(0, cdiv(slots, bs) - max(skipped, len(group_hits))) + sum(i >= skipped for i in evictable)
        generous += copy
        conservative += max(0, cdiv(slots, bs) - len(group_hits)) + len(evictable) + copy
    if kwargs.get("full_sequence_must_fit") and request.num_tokens > main:
        # vLLM's admission gate (its scheduler's, 0.24.0 on): the whole sequence must fit too
        whole = {**kwargs, "full_sequence_must_fit": False, "num_lookahead_tokens": 0}
        gate = capacity_bounds(engine, request, request.num_tokens - computed, whole, tables, same_step_keys)
        conservative = max(conservative, gate[1])
    # blocks vLLM's scheduler keeps back for loads and prefills in flight (0.24.0 on)
    conservative += kwargs.get("reserved_blocks", 0)
    return generous, conservative, view.num_free_blocks, freed


def _copy_of_tail(hit_ids, num_local: int, bs: int) -> int:
    """1 when an admission's hit ends inside its last block: the request gets a copy of that
    shared block (vLLM's ``_has_partial_local_hit``), else 0."""
    return int(bool(hit_ids) and num_local % bs != 0)


def _possible_checkpoint(engine, request, spec, computed: int, main: int) -> int:
    """1 if the chunk [computed, main) may save a prefill checkpoint into a column of its own
    (kvprop.allocator.checkpoint; whether the column is free is the allocator's to see), else 0."""
    allocator = engine.config.allocator
    if allocator.retention_interval == 0 and main < request.prefill_end and not spec.speculative_blocks:
        return 0  # only the chunk reaching the prefill's end saves one (or one over a scratch column)
    return int(chunk_checkpoint(computed, main, allocator.unit, spec.block_size, spec.checkpoint) > 0)


def _state_group_need(
    view, table, hits, main: int, computed: int, same_step, k: int, checkpoint: int = 0
) -> tuple[tuple[int, int], int]:
    """((generous, conservative) blocks, blocks its retirement frees) for a state group in align
    mode with ``k`` scratch columns: at most one new block per allocation (the next running
    state), ``k`` more on the first, one more for a ``checkpoint`` column (conservative only:
    whether the column is free is not seen here), plus a hit block still in the free queue;
    every real entry below the running state is released first. A hit whose state the current
    step is still computing may be refused whatever the pool holds (its conservative need is
    unbounded)."""
    bs, null = view.block_size, view.null_block_id
    ids = [b.block_id for b in hits]
    have = len(table) if table is not None else len(ids)
    cap = 1 if table is not None else 1 + k
    grow = min(cap, max(0, cdiv(main, bs) + k - have))
    evictable = sum(1 for b in ids if b != null and view.ref_cnt(b) == 0)
    running = cdiv(computed, bs) - 1
    frees = sum(1 for b in (table or ())[: max(running, 0)] if b != null and view.ref_cnt(b) == 1)
    conservative = min(cap + checkpoint, max(0, cdiv(main, bs) + k - have)) + evictable
    if ids and ids[-1] != null and view.cache_key(ids[-1]) in same_step:
        conservative = view.num_blocks + 1
    return (grow + evictable, conservative), frees


def allocation_decision(request, bounds, accepted: bool) -> None:
    """10. An allocation that fits under every count is granted; one that fits under none is refused."""
    generous, conservative, free, freed = bounds
    if not accepted and conservative <= free:
        raise Violation(
            "spurious-refusal",
            f"allocate_slots refused {request.request_id!r}, which needs at most {conservative} blocks "
            f"with {free} free",
            requests=[request.request_id],
        )
    if accepted and generous > free + freed:
        raise Violation(
            "accepted-beyond-capacity",
            f"allocate_slots granted {request.request_id!r}, which needs at least {generous} blocks "
            f"with {free} free and {freed} freed by its window",
            requests=[request.request_id],
        )


def crash_beyond_capacity(bounds) -> str | None:
    """What an allocation that raised broke, where the pool could not hold it (invariant 10's
    rule: refused, by returning None), or None where it could."""
    generous, _, free, freed = bounds
    if generous <= free + freed:
        return None
    return (
        f"it needed at least {generous} blocks with {free} free and {freed} freed by its window: "
        "an allocation the pool cannot hold is refused (allocate_slots returns None), not raised"
    )


def _group_hit(spec, cached, group: int, hashes, max_length: int, units=None, unit: int = 0, drop=False) -> int:
    """Hit tokens group ``group`` allows within ``max_length`` tokens (kvprop's spec rules).
    ``units``/``unit``: the request's per-unit hashes and the unit, when hits may end inside a
    block: a state is then restored at any unit boundary whose key is cached, and full
    attention's run of cached blocks extends into the next block as far as a key there reaches.
    ``drop``: the EAGLE drop (full attention and windows): one more block must be cached
    past the hit."""
    bs = spec.block_size
    if drop:  # a window's run one block wider (full attention's: as it is), less its last block
        wider = attrs.evolve(spec, window=spec.window + bs) if isinstance(spec, SlidingWindow) else spec
        return max(_group_hit(wider, cached, group, hashes, max_length) - bs, 0)
    n = min(max_length // bs, len(hashes))
    if isinstance(spec, Mamba) and units is not None:
        m = min(max_length // unit, len(units))
        return next(((j + 1) * unit for j in range(m - 1, -1, -1) if (units[j], group) in cached), 0)
    if isinstance(spec, Mamba):  # the rightmost cached state at a block boundary
        return next(((i + 1) * bs for i in range(n - 1, -1, -1) if (hashes[i], group) in cached), 0)
    if isinstance(spec, SlidingWindow):
        need, run = spec.hit_blocks_needed, 0
        for i in range(n - 1, -1, -1):
            run = run + 1 if (hashes[i], group) in cached else 0
            if run >= max(need, 1) or (run and i == 0):
                return (i + run) * bs
        return 0
    start = (max_length // spec.chunk) * spec.chunk // bs if isinstance(spec, ChunkedLocal) else 0
    if start > len(hashes):
        return 0
    i = start
    while i < n and (hashes[i], group) in cached:
        i += 1
    if units is not None and not isinstance(spec, ChunkedLocal):
        scale = bs // unit
        top = min((i + 1) * scale - 1, max_length // unit, len(units))
        return next(((j + 1) * unit for j in range(top - 1, i * scale - 1, -1) if (units[j], group) in cached), i * bs)
    return i * bs


class _KeySet:
    """``key in cached`` answered by the view, without listing the whole map."""

    def __init__(self, has_key):
        self.has_key = has_key

    def __contains__(self, key) -> bool:
        return self.has_key(key)


def longest_hit(engine, request) -> int:
    """The hit length the cache map allows: each group shrinks the candidate to what it can
    serve until none shrinks it further; never the last token."""
    if not engine.config.allocator.enable_caching:
        return 0
    view = engine.view
    has_key = view.has_cache_key if engine.capabilities.key_lookup else None  # O(1) where the view offers it
    cached = _KeySet(has_key) if has_key is not None else {key for key, _ in view.cache_map_items()}
    length = request.num_tokens - 1
    allocator = engine.config.allocator
    units, unit = (request.unit_hashes, allocator.unit) if allocator.partial_hits else (None, 0)
    if allocator.eagle:
        return _eagle_hit(engine.specs, cached, request.block_hashes, length)
    # Full attention's hit is downward-closed: whatever it covers at the limit, it covers below.
    full = {
        g: _group_hit(spec, cached, g, request.block_hashes, length, units, unit)
        for g, spec in enumerate(engine.specs)
        if isinstance(spec, FullAttention)
    }
    while True:
        candidate = length
        for g, spec in enumerate(engine.specs):
            if g in full:
                candidate = min(candidate, full[g])
            else:
                candidate = _group_hit(spec, cached, g, request.block_hashes, candidate, units, unit)
        if candidate == length:
            return length
        length = candidate


def _eagle_hit(specs, cached, hashes, limit: int) -> int:
    """The hit with the EAGLE drop (vLLM 0.33.0's coordinators; docs/design.md §2 "The EAGLE
    drop"). One group: its hit within ``limit``, dropped. Two: full attention first, each group
    that has not dropped at this candidate looks one block further (within what is hashed) and
    drops; a length that shrinks without a drop asks again; with full attention first, one pass."""
    if len(specs) == 1:
        return _group_hit(specs[0], cached, 0, hashes, limit, drop=True)
    bs, hashed = specs[0].block_size, len(hashes) * specs[0].block_size
    order = sorted(range(len(specs)), key=lambda g: not isinstance(specs[g], FullAttention))
    one_pass = isinstance(specs[order[0]], FullAttention)
    full: dict[int, int] = {}  # group -> its hit, for a full-attention group once it is looked up
    length, dropped = limit, set()
    while True:
        candidate = length
        for g in order:
            if g in full:
                candidate = min(candidate, full[g])
                continue
            drop = g not in dropped
            hit = _group_hit(specs[g], cached, g, hashes, min(candidate + bs, hashed) if drop else candidate, drop=drop)
            if isinstance(specs[g], FullAttention):
                full[g] = hit
            if drop:
                dropped.add(g)
            elif hit < candidate:
                dropped.clear()
            candidate = hit
        if candidate == length or one_pass:
            return candidate
        length = candidate


def hit_length(engine, request, num_hit: int) -> None:
    """10. get_computed_blocks reports the longest hit the cache allows: shorter wastes work,
    longer claims data that is not cached."""
    expected = longest_hit(engine, request)
    said = f"get_computed_blocks gave {request.request_id!r} a hit of {num_hit} tokens"
    if num_hit < expected:
        raise Violation("hit-too-short", f"{said}; the cache map holds {expected}", requests=[request.request_id])
    if num_hit > expected:
        why = _why_shorter(engine, request, num_hit, expected)
        raise Violation("hit-too-long", f"{said}; {why}", requests=[request.request_id])


def _why_shorter(engine, request, num_hit: int, expected: int) -> str:
    """The rule a hit of ``num_hit`` tokens, longer than ``expected``, breaks, in words."""
    if not engine.config.allocator.enable_caching:
        return "prefix caching is off, so nothing is a hit"
    if num_hit >= request.num_tokens:
        return (
            f"a hit covers at most {request.num_tokens - 1} of the request's {request.num_tokens} tokens: "
            "its last token is always computed, to sample the next one"
        )
    return f"the cache map holds only {expected}"
