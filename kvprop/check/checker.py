"""Runs the invariants: inside a step (as engine hooks) and between steps.

Corruption can be transient — a duplicated block can be written and freed again inside
one engine step — so structural checks also run right after every allocation, where
blocks change hands, not only between operations. Where the view reports which blocks
changed, checks are incremental (see ``kvprop.check.mirror``) with a full sweep every
``full_every`` checks (more apart in a larger pool, see ``sweep_interval``) and at the end of
every run; otherwise every check is a full sweep.
"""

from __future__ import annotations

from kvprop.allocator.events import GPU
from kvprop.allocator.specs import FullAttention
from kvprop.check import admission, data, decisions, moments, outcomes, saves, sglang, sglang_data
from kvprop.check import invariants as inv
from kvprop.check.events import EventLedger
from kvprop.check.mirror import Mirror
from kvprop.check.router import RouterView
from kvprop.check.stall import StallWatch
from kvprop.sim.engine import Hooks


class Checker(Hooks):
    """Every invariant, after every allocation and every operation; ``enabled=False`` is the
    bare engine (benchmarks measure what the checks cost)."""

    FULL_EVERY = 64  # checks between full sweeps, when the view reports what changed

    def __init__(self, enabled: bool = True, full_every: int = FULL_EVERY):
        self.enabled = enabled
        self.full_every = full_every
        self.mirror: Mirror | None = None
        self.signatures: dict = {}
        self.dirty: set = set()
        self.pending_changes: set = set()
        self.num_checks = 0
        self.expected_rows: dict = {}  # cache key -> what a block cached under it must hold
        self.outputs_checked: dict = {}  # request id -> its tokens judged continuations (invariant 18)
        self.ledger = EventLedger()
        self.router = RouterView()
        # (block, key) of every cached state block when the step began; None where the mirror
        # notes keys at the step's start instead (step_starts)
        self.states_at_step_start: frozenset | None = frozenset()
        self.cached_by_allocations: set = set()  # keys of state blocks an allocation cached in this step
        # blocks the in-step structural checks judged since the last check_all: their data is
        # judged there, once the step's writes and copies have run
        self.judged_in_step: set = set()
        # request id -> tokens computed before its load failed, while the request holds its blocks
        self.failed_loads: dict = {}

    def sweep_interval(self, engine) -> int:
        """Checks between full sweeps: ``full_every``, and in a pool of more than
        ``4 * full_every`` blocks one sweep per ``num_blocks / 4`` checks, so that a sweep,
        which costs O(pool), adds about the same per check at any pool size."""
        return max(self.full_every, engine.view.num_blocks // 4) if self.full_every > 1 else 1

    def incremental(self, engine) -> bool:
        return self.full_every > 1 and engine.capabilities.change_log

    # ---- in-step hooks ----------------------------------------------------------------

    def step_starts(self, engine) -> None:
        """Marks where the step begins for the same-step state rule. Incrementally, the mirror
        notes each block's key at the step's start the first time the block moves
        (``Mirror.first_keys``); otherwise every cached state block is listed."""
        if not (self.enabled and engine.state_groups):
            return
        self.cached_by_allocations = set()
        if self.incremental(engine) and self.mirror is not None:
            view = engine.view
            self.pending_changes |= view.take_changes()  # moved, not yet judged: their key now is the start's
            self.mirror.first_keys = {block_id: inv.keys_of(view, block_id) for block_id in self.pending_changes}
            self.states_at_step_start = None
        else:
            self.states_at_step_start = frozenset(self._cached_states(engine))

    @staticmethod
    def same_step_groups(engine) -> frozenset:
        """The groups where a hit on a block keyed in the current step may wait for the next
        step: state groups (the state is computed by this step's forward pass), and full
        attention when hits may end inside a block (a copy of a block keyed inside it this step
        would run before the forward pass writes it; kvprop's ``guard_same_step_copy``)."""
        groups = engine.state_groups
        if engine.config.allocator.partial_hits:
            groups = groups | {g for g, spec in enumerate(engine.specs) if isinstance(spec, FullAttention)}
        return groups

    @classmethod
    def _cached_states(cls, engine):
        """(block, key) of every key in the same-step groups, a key inside a block included."""
        view, groups = engine.view, cls.same_step_groups(engine)
        for block_id in range(view.num_blocks):
            for key in inv.keys_of(view, block_id):
                if key[1] in groups:
                    yield block_id, key

    def _same_step_keys(self, engine) -> set:
        """Keys cached since the step began in the same-step groups, by an allocation (a block
        evicted and cached again under its old key included) or by the caching that follows a
        load (vLLM's scheduler completes loads inside ``schedule()``), and the keys of every
        state block a queued copy fills (its state exists once the copy has run, before this
        step's forward pass; vLLM 0.33.0 ``MambaManager.allocate_new_blocks``, "defer same-step
        hits on it"): a hit on one may be refused until the next step
        (``MambaManager.cached_blocks_this_step``, kvprop's ``keyed_this_step``)."""
        groups = self.same_step_groups(engine)
        if not groups:
            return set()
        filled = self._filled_by_copies(engine)
        start = self.states_at_step_start
        if start is not None:
            since = {key for block_id, key in self._cached_states(engine) if (block_id, key) not in start}
            return since | self.cached_by_allocations | filled
        # Only blocks that moved since the step began can hold a state key they did not hold then
        # (a key inside a block included: caching one at a boundary inside a keyed block adds it).
        view, mirror = engine.view, self.mirror
        first = mirror.first_keys if mirror is not None else None
        # step_starts leaves no start list only with a mirror, whose first_keys it set; a full
        # sweep replaces the mirror only between operations, never inside the step
        assert mirror is not None and first is not None
        moved = view.take_changes()
        self.pending_changes |= moved
        for block_id in moved:  # not judged since the start: the mirror's keys are the start's
            first.setdefault(block_id, (mirror.keys[block_id], *mirror.further.get(block_id, ())))
        since = set()
        for block_id, keys_at_start in first.items():
            for key in inv.keys_of(view, block_id):
                if key[1] in groups and key not in keys_at_start:
                    since.add(key)
        return since | self.cached_by_allocations | filled

    @staticmethod
    def _filled_by_copies(engine) -> set:
        """The state keys of the blocks a queued copy fills."""
        view = engine.view
        return {
            key
            for _, copy in inv.pending_copies(view)
            for key in inv.keys_of(view, copy)
            if key[1] in engine.state_groups
        }

    def _note_cached_states(self, engine, request_id: str, cached_before: dict) -> None:
        """The state blocks this allocation cached: those its cached count passed over, and, when
        hits may end inside a block, any keyed entry after them (the running block keyed at a
        boundary inside it is left out of the count)."""
        view, null = engine.view, engine.view.null_block_id
        partial = engine.config.allocator.partial_hits
        for g, before in cached_before.items():
            table = view.request_block_ids(g, request_id) or []
            for block_id in table[before : None if partial else view.num_cached_blocks(g, request_id) or 0]:
                if block_id != null and view.cache_key(block_id) is not None:
                    self.cached_by_allocations.add(view.cache_key(block_id))

    def before_allocation(self, engine, request, num_new_tokens: int, kwargs: dict):
        if not self.enabled:
            return None
        view = engine.view
        rid, same_step = request.request_id, self._same_step_keys(engine)
        cached = {g: view.num_cached_blocks(g, rid) or 0 for g in engine.state_groups}
        if not self.incremental(engine):
            before = outcomes.snapshot(view, rid)
            bounds = decisions.capacity_bounds(engine, request, num_new_tokens, kwargs, before[3], same_step)
            return bounds, before, cached
        # Set aside what changed before this allocation, so that afterwards the pool reports
        # only what the allocation itself changed; both are judged after it.
        self.pending_changes |= view.take_changes()
        tables = [view.request_block_ids(g, rid) for g in range(view.num_groups)]
        return decisions.capacity_bounds(engine, request, num_new_tokens, kwargs, tables, same_step), tables, cached

    def after_allocation(self, engine, request, token, result, computed: int) -> None:
        if not self.enabled:
            return
        bounds, before, cached_before = token
        if result is not None:
            self._note_cached_states(engine, request.request_id, cached_before)
            view, rid = engine.view, request.request_id
            tables_after = [view.request_block_ids(g, rid) for g in range(view.num_groups)]
            moments.tables_extended(view, rid, before if self.incremental(engine) else before[3], tables_after)
        if not self.incremental(engine):
            if result is None:
                outcomes.check_refusal(engine.view, request.request_id, before)
            else:
                self.check_structure(engine, {request.request_id: computed}, frozenset([request.request_id]))
        else:
            self.dirty.add(request.request_id)
            if result is None:
                self._check_refusal_changes(engine, request.request_id, before)
                self.check_structure(engine, in_step=True)
            else:
                admitted = frozenset([request.request_id])
                self.check_structure(engine, {request.request_id: computed}, admitted, in_step=True)
        decisions.allocation_decision(request, bounds, result is not None)

    def allocation_crashed(self, engine, request, token) -> str | None:
        """The raise stays the target's crash, with its exception; where the pool could not hold
        the allocation, the crash says so: such an allocation is refused, not attempted until the
        pool runs out."""
        if not self.enabled:
            return None
        return decisions.crash_beyond_capacity(token[0])

    def after_hit(self, engine, request, hits, num_hit: int) -> None:
        if self.enabled:
            decisions.hit_length(engine, request, num_hit)

    def after_free(self, engine, request) -> None:
        self.dirty.add(request.request_id)
        self.failed_loads.pop(request.request_id, None)
        if self.enabled:
            moments.freed_request_gone(engine, engine.view, request)

    def before_misuse(self, engine, call: str, request):
        if not self.enabled:
            return None
        # Stale hits that happen to be the request's own cached blocks make a well-formed call.
        foreign = call != "stale-hits" or moments.foreign_hits(engine.view, request, engine.last_hits[1])
        return moments.whole_state(engine.view), foreign

    def after_misuse(self, engine, call: str, request, token, raised, contract: str) -> None:
        if self.enabled:
            before, malformed = token
            moments.misuse_outcome(engine.view, call, request, before, raised, contract if malformed else "tolerates")

    def at_handoff(self, engine, request, tables, num_local: int, num_external: int) -> None:
        if self.enabled:
            moments.handoff_exclusive(engine.view, request, tables, num_local, num_external)
            if engine.connector is not None and engine.connector.mode == "async":  # kvprop's own connector
                admission.load_room(engine, request)
            elif engine.connector is not None:  # kvprop's sync load writes the blocks now
                written = [tables[g][i] for i, g in saves.offered_blocks(engine, num_local, num_external)]
                null = engine.view.null_block_id
                saves.write_during_save(engine, [b for b in written if b != null], "a sync load", request.request_id)

    def after_offer(self, engine, request, num_local: int, num_external: int) -> None:
        if self.enabled:
            saves.offer_held(engine, request, num_local, num_external, self.expected_rows)

    def load_resolved(self, engine, request, ok: bool, num_local: int) -> None:
        if not ok and engine.view.request_block_ids(0, request.request_id) is not None:
            self.failed_loads[request.request_id] = num_local  # kept its blocks: judged when scheduled
        if self.enabled:
            admission.load_resolved(request, ok, num_local)

    def before_execute(self, engine, report) -> None:
        if self.enabled:
            admission.scheduled_after_loads(engine, report.scheduled, self.failed_loads)
            saves.write_during_save(engine, [dest for _, dest in report.copies], "a block copy")

    def before_load_write(self, engine, request, block_ids) -> None:
        if self.enabled:
            saves.write_during_save(engine, [b for _, b in block_ids], "a load", request.request_id)
            moments.load_write_owned(
                engine.view, request, engine.target_calls.get_block_ids(request.request_id), block_ids
            )

    def before_state_write(self, engine, request, group: int, source, start: int, targets) -> None:
        if self.enabled:
            moments.state_write(engine, engine.view, request, group, source, start, targets)
            saves.write_during_save(engine, [t[0] for t in targets], "a state write", request.request_id)

    def before_write(self, engine, request, group: int, table, start: int, num_tokens: int) -> None:
        if self.enabled:
            moments.write_targets(engine.view, request, group, table, start, num_tokens)
            bs = engine.block_size
            written = table[start // bs : -(-(start + num_tokens) // bs)]
            saves.write_during_save(engine, written, "a forward pass", request.request_id)

    def before_read(self, engine, request_id: str, layer: str, positions, slots, expected) -> None:
        if self.enabled and slots:
            values = engine.read(layer, slots)
            sglang_data.check_read(request_id, layer, positions, slots, values, [expected[p] for p in positions])

    def _check_refusal_changes(self, engine, request_id, before) -> None:
        """8, incrementally: a refused allocation touched only the blocks its window skipping freed."""
        view = engine.view
        after = [view.request_block_ids(g, request_id) for g in range(view.num_groups)]
        freed = outcomes.refusal_tables(view, request_id, before, after)
        changed = view.take_changes()
        self.pending_changes |= changed  # the structural check after this still judges them
        outcomes.refusal_blocks(request_id, changed, freed)

    # ---- checks -------------------------------------------------------------------------

    def check_structure(self, engine, pending=None, admitted_now=frozenset(), in_step: bool = False):
        """Invariants 1-6; returns what the data check needs.

        Inside a step (``in_step``) the incremental check compares only the tables of requests
        the engine allocated for or freed since the last check; between operations it compares
        every table, so a change to anyone else's table is still caught at the step's end."""
        view = engine.view
        if not self.incremental(engine):
            tables, keys = self._sweep_structure(engine, pending, admitted_now)
            return tables, keys, None
        if self.mirror is None:
            self.mirror = Mirror(view, engine.capabilities, engine.fenced_blocks)
        changed = view.take_changes() | self.pending_changes
        changed.add(view.null_block_id)  # the null block's own state, at every check
        self.pending_changes = set()
        changed_tables = self.mirror.sync(changed, requests=self.dirty if in_step else None)
        if in_step:
            self.judged_in_step |= changed
        self.dirty = set()
        only = {rid for rid, _ in changed_tables} | set(pending or ()) | set(admitted_now)
        if not in_step:
            # Progress changes between operations; waiting requests hold no table, and one that
            # gains or loses a table shows in changed_tables.
            for request in [*engine.running, *engine.loading.values(), *engine.loaded]:
                sig = (request.status, request.num_computed_tokens, request.num_tokens, request.pending_external)
                if self.signatures.get(request.request_id) != sig:
                    self.signatures[request.request_id] = sig
                    only.add(request.request_id)
        mirror = self.mirror
        inv.check_tables(engine, view, mirror.ids, mirror.keys, pending or {}, admitted_now, only, mirror.verified)
        return None, self.mirror.keys, changed

    @staticmethod
    def _sweep_structure(engine, pending=None, admitted_now=frozenset()):
        """Invariants 1-6 over every block and every table."""
        view = engine.view
        tables = inv.gather_tables(view)
        ref_cnts, keys = view.ref_cnts(), view.cache_keys()
        inv.check_free_queue_links(view)
        inv.check_blocks(view, tables, ref_cnts, keys, engine.capabilities.null_count_fixed, engine.fenced_blocks())
        inv.check_conservation(view, ref_cnts)
        inv.check_tables(engine, view, tables, keys, pending or {}, admitted_now)
        return tables, keys

    def check_events(self, engine, incremental: bool = False) -> None:
        """13 and 17, at every drain of the event queue: after each operation (vLLM's scheduler
        drains it once per step), once the cache map itself has been judged. Incrementally, only
        the keys the events named or the mirror saw move are compared."""
        events = engine.take_kv_events()
        moved = set()
        if self.mirror is not None:  # taken even without events, so that it never piles up
            moved, self.mirror.moved_keys = self.mirror.moved_keys, set()
        if events is None:
            return
        named = self.ledger.apply(events)
        believed = self.router.apply(events)
        if incremental and engine.capabilities.change_log:
            self.ledger.compare_keys(engine.view, named | moved)
            believed[GPU] = believed.get(GPU, set()) | moved
            self.router.judge(engine.view, engine.offload_tier(), believed)
        else:
            self.ledger.compare(engine.view)
            self.router.judge(engine.view, engine.offload_tier())

    def check_all(self, engine) -> None:
        if not self.enabled:
            engine.take_kv_events()  # drained all the same, as a scheduler would: never piles up
            return
        self.num_checks += 1
        if engine.terms == "sglang":
            sglang.check_all(engine.scheduler)
            if self.num_checks % self.full_every == 0:
                self._sglang_tree_data(engine)
            return
        outcomes.continuations(engine, self.outputs_checked)
        if self.incremental(engine) and self.num_checks % self.sweep_interval(engine):
            _, keys, changed = self.check_structure(engine)
            changed |= self.judged_in_step
            self.judged_in_step = set()
            cached = [(b, keys[b]) for b in changed if keys[b] is not None]
            data.check_recent_data(engine, engine.view, cached, self.expected_rows)
            self.check_events(engine, incremental=True)
            return
        self.check_full(engine)

    def check_full(self, engine) -> None:
        """The full sweep of every invariant; resynchronises the incremental mirror."""
        if not self.enabled:
            return
        if engine.terms == "sglang":
            sglang.check_all(engine.scheduler)
            self._sglang_tree_data(engine)
            return
        view = engine.view
        tables, keys = self._sweep_structure(engine)
        # the writes since the last check first, as the incremental check judges them: two
        # writers of one slot in a step cannot both read back
        data.check_recent_data(engine, view, [], self.expected_rows, copies=False)
        data.check_data(engine, view, tables, keys, self.expected_rows)
        self.check_events(engine)
        if self.incremental(engine):
            self.mirror = Mirror(view, engine.capabilities, engine.fenced_blocks)
            self.signatures.clear()
            self.pending_changes = set()
            self.judged_in_step = set()

    @staticmethod
    def _sglang_tree_data(engine) -> None:
        """Every cached node of SGLang's tree holds its path's KV (a tree Python can walk)."""
        tree = engine.scheduler.tree_cache
        root = sglang.tree_root(tree)
        if root is not None:
            sglang_data.check_tree_data(
                root, lambda node: sglang.node_value(tree, node), lambda slots: engine.read("full-attention", slots)
            )


STALLED_STEPS = 2  # steps in a row that left the engine's stall signature as it was


def drain(engine, checker: Checker, max_steps: int | None = None, on_step=None) -> int:
    """Stop arrivals and run to completion: loads resolve, every request ends, every block returns.
    ``on_step()`` is called after each engine step (a supervised worker's heartbeat: a long
    drain is progress, not a hang).

    The bound is generous (each step advances some request by a token unless it preempts),
    so exceeding it means the engine or the allocator stopped making progress; so does a run
    of steps that change nothing (``Engine.stall_signature``), judged without waiting for it.
    """
    if max_steps is None:
        work = sum(r.num_tokens + r.max_new_tokens for r in engine.requests.values())
        max_steps = 50 + 4 * work * max(1, len(engine.requests))
    steps = repeats = 0
    last = None
    watch = StallWatch.for_bound(max_steps)
    while engine.requests or engine.in_flight() or (engine.connector is not None and engine.connector.saves):
        for rid in list(engine.loading):
            engine.finish_load(rid, ok=True)
            checker.check_all(engine)
        for job_id in list(engine.connector.saves if engine.connector is not None else ()):
            engine.finish_save(job_id, ok=True)
        if not engine.requests and not engine.in_flight():
            break
        if steps >= max_steps or repeats >= STALLED_STEPS:
            outcomes.liveness(engine, steps, watch.cause(engine.requests.values()))
        report = engine.step()
        steps += 1
        watch.record(report, engine.loading)
        checker.check_all(engine)
        if on_step is not None:
            on_step()
        signature = engine.stall_signature(report)
        repeats = repeats + 1 if signature is not None and signature == last else 0
        last = signature
    checker.check_full(engine)
    if checker.enabled:
        outcomes.liveness(engine)
    return steps
