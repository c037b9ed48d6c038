"""Runs the invariants: inside a step (as engine hooks) and between steps.

Corruption can be transient — a duplicated block can be written and freed again inside
one engine step — so structural checks also run right after every allocation, where
blocks change hands, not only between operations.
"""

from __future__ import annotations

from kvprop import invariants as inv
from kvprop.engine import Hooks
from kvprop.errors import Violation


class Checker(Hooks):
    """Every invariant, after every allocation and every operation; ``enabled=False`` is the
    bare engine (benchmarks measure what the checks cost)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled

    def before_allocation(self, engine, request):
        if not self.enabled:
            return None
        return inv.snapshot(engine.view, request.request_id)

    def after_allocation(self, engine, request, token, result, computed: int) -> None:
        if not self.enabled:
            return
        if result is None:
            inv.check_refusal(engine.view, request.request_id, token)
        else:
            self.check_structure(engine, {request.request_id: computed}, frozenset([request.request_id]))

    def check_structure(self, engine, pending=None, admitted_now=frozenset()) -> None:
        view = engine.view
        tables = inv.gather_tables(view)
        ref_cnts = view.ref_cnts()
        keys = view.cache_keys()
        inv.check_ref_counts(view, tables, ref_cnts)
        inv.check_free_queue(view, ref_cnts)
        inv.check_group_exclusive(view, tables, keys)
        inv.check_cache_map(view, keys)
        inv.check_conservation(view, ref_cnts)
        inv.check_tables(engine, view, tables, keys, pending or {}, admitted_now)
        return tables, keys

    def check_all(self, engine) -> None:
        if not self.enabled:
            return
        tables, keys = self.check_structure(engine)
        inv.check_data(engine, engine.view, tables, keys)


def drain(engine, checker: Checker, max_steps: int | None = None) -> int:
    """Stop arrivals and run to completion: loads resolve, every request ends, every block returns.

    The bound is generous (each step advances some request by a token unless it preempts),
    so exceeding it means the engine or the allocator stopped making progress.
    """
    if max_steps is None:
        work = sum(r.num_tokens + r.max_new_tokens for r in engine.requests.values())
        max_steps = 50 + 4 * work * max(1, len(engine.requests))
    steps = 0
    while engine.requests:
        for rid in list(engine.loading):
            engine.finish_load(rid, ok=True)
            checker.check_all(engine)
        if not engine.requests:
            break
        if steps >= max_steps:
            raise Violation("liveness", f"{len(engine.requests)} requests still live after {steps} drain steps",
                            requests=sorted(engine.requests))
        engine.step()
        steps += 1
        checker.check_all(engine)
    if checker.enabled:
        inv.check_drained(engine, engine.view)
    return steps
