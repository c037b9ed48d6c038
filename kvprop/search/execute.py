"""Executing a trace: the configuration, then each operation on a fresh harness, then the drain.

The walker executes the traces it plans, the minimiser its candidates, ``kvprop replay`` a
file. Kept apart from the trace format (``kvprop.search.trace``) so that reading and
validating a trace loads neither torch nor the engine.
"""

from __future__ import annotations

from kvprop.allocator import guards
from kvprop.errors import TargetCrash, Violation
from kvprop.search.harness import Harness
from kvprop.search.trace import Failure, Trace, failure_from


def execute(
    trace: Trace,
    variant: str | None = None,
    target: str | None = None,
    device: str | None = None,
    on_step=None,
    checks: bool = True,
    events: set | None = None,
    canary: bool = False,
    full_sweeps: bool = False,
    journal=None,
) -> Failure | None:
    """Replay ``trace`` step by step without Hypothesis; the first exception is the failure.

    ``events``, when given, collects the names of the engine events the replay reached;
    ``full_sweeps`` makes every check a full sweep instead of an incremental one; ``journal``
    (in a supervised worker) records the run as it goes. kvprop's allocator runs with the
    guards the trace ran with."""
    if journal is not None:
        journal.begin(trace)
    with guards.held(trace.guards):
        harness = Harness(
            trace.config,
            variant=variant,
            target=target,
            device=device,
            checks=checks,
            canary=canary,
            full_sweeps=full_sweeps,
            journal=journal,
        )
        try:
            return run(harness, trace.steps, trace.drain, on_step)
        finally:
            if events is not None:
                events.update(harness.engine.events)


def run(harness, operations, drain: bool, on_step=None) -> Failure | None:
    """Apply ``operations`` in order, then drain; the first finding is the failure. The walker
    passes a generator that draws each operation from the harness as it stands."""
    applied = 0
    for op in operations:
        try:
            outcome = harness.apply(op)
        except (Violation, TargetCrash) as e:  # a finding; anything else is kvprop's own error
            return failure_from(e, applied)
        if on_step is not None:
            on_step(applied, op, outcome)
        applied += 1
    if drain:
        try:
            steps = harness.drain()
        except (Violation, TargetCrash) as e:
            return failure_from(e, applied)
        if on_step is not None:
            on_step(applied, "drain", f"drained in {steps} engine steps")
    return None
