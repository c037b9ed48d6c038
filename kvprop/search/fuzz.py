"""``kvprop fuzz``: worker processes searching until the budget ends or a failure.

Each worker runs one driver — the seeded walker (fast) or the Hypothesis state machine
(its heuristics, saving to the example database) — over disjoint seeds. The parent prints
a status line at least every 2 s; on a failure it stops the workers and returns the find
(the caller minimises and writes it, see ``kvprop.repro``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import sys
import time
from pathlib import Path

import attrs

from kvprop.search import trace as tr
from kvprop.search.execute import execute
from kvprop.search.trace import Trace
from kvprop.sim.engine import EVENTS

DRIVERS = ("walk", "hypothesis")
REPORT_EVERY = 0.5
STATUS_EVERY = 2.0


@attrs.frozen
class FuzzOptions:
    seconds: float = 60.0
    workers: int = 1
    seed: int = 0
    driver: str = "walk"
    variant: str | None = None
    target: str | None = None
    device: str | None = None
    out: Path = Path("counterexamples")
    max_ops: int = 200
    max_runs: int | None = None  # a deterministic budget: stop after this many runs (walk) / examples
    redis: str | None = None  # share failures with other machines through this Redis URL


@attrs.frozen
class FuzzResult:
    found: Trace | None
    runs: int
    steps: int
    seconds: float
    events: frozenset
    seconds_to_find: float | None = None
    shared: bool = False  # found by another machine, through the shared store


# ---- workers ------------------------------------------------------------------------------


def _walk_worker(index: int, opts: FuzzOptions, out, stop) -> None:
    from kvprop.search.walk import run_walk

    seed, runs, steps, events, last = opts.seed + index, 0, 0, set(), time.monotonic()
    total = 0
    while not stop.is_set() and (opts.max_runs is None or total < opts.max_runs):
        total += 1
        result = run_walk(seed, opts.variant, opts.target, opts.device, opts.max_ops)
        runs, steps = runs + 1, steps + result.steps_run
        events |= result.events
        if result.failure is not None:
            out.put(("progress", runs, steps, events))
            out.put(("failure", tr.to_dict(attrs.evolve(result.trace, failure=result.failure))))
            return
        if time.monotonic() - last >= REPORT_EVERY:
            out.put(("progress", runs, steps, events))
            runs, steps, events, last = 0, 0, set(), time.monotonic()
        seed += opts.workers
    out.put(("progress", runs, steps, events))


def _hypothesis_worker(index: int, opts: FuzzOptions, out, stop) -> None:
    from hypothesis import seed as hseed
    from hypothesis import settings
    from hypothesis.stateful import run_state_machine_as_test

    from kvprop.search import profiles
    from kvprop.search.machine import failure_trace, machine_for

    profiles.load("fuzz")
    machine = machine_for(opts.variant, opts.target, opts.device)
    chunk = settings(settings.default, max_examples=200)  # Hypothesis starts each run simple: keep runs long
    if opts.redis:
        from kvprop.search.store import hypothesis_database

        chunk = settings(chunk, database=hypothesis_database(opts.redis))
    s = opts.seed + index
    while not stop.is_set() and (opts.max_runs is None or machine.counters["examples"] < opts.max_runs):
        before = dict(machine.counters)
        try:
            run_state_machine_as_test(hseed(s)(machine), settings=chunk)
        except BaseException as e:  # noqa: BLE001 - any failure of the machine is a finding
            _progress(out, machine, before)
            if not machine.failures:
                out.put(("crash", f"{type(e).__name__}: {e}"))
                return
            out.put(("failure", tr.to_dict(attrs.evolve(failure_trace(machine), seed=s))))
            return
        _progress(out, machine, before)
        s += opts.workers


def _progress(out, machine, before) -> None:
    out.put(
        (
            "progress",
            machine.counters["examples"] - before["examples"],
            machine.counters["steps"] - before["steps"],
            set(machine.events_seen),
        )
    )


def _worker(index, opts, out, stop):
    try:
        (_walk_worker if opts.driver == "walk" else _hypothesis_worker)(index, opts, out, stop)
    except KeyboardInterrupt:
        pass
    except BaseException as e:  # noqa: BLE001 - report, never hang the parent
        out.put(("crash", f"worker {index}: {type(e).__name__}: {e}"))


# ---- the parent ---------------------------------------------------------------------------


def _from_store(opts: FuzzOptions, store, status) -> Trace | None:
    """A trace another machine stored that still fails here, if any."""
    for trace in store.traces():
        if execute(trace, variant=opts.variant, target=opts.target, device=opts.device) is not None:
            if status:
                status(f"a trace from the shared store still fails ({trace.failure.kind if trace.failure else '?'})")
            return trace
    return None


def search(opts: FuzzOptions, status=None) -> FuzzResult:
    """Run workers until the budget ends or one finds a failure (``status`` gets status lines).

    With ``opts.redis``, stored traces for this target are replayed first, a find is pushed
    for the other machines, and a find pushed by another machine ends this search too."""
    store = None
    if opts.redis:
        from kvprop.search.store import TraceStore

        store = TraceStore(opts.redis, opts.target, opts.variant)
        known = _from_store(opts, store, status)
        if known is not None:
            return FuzzResult(known, 0, 0, 0.0, frozenset(), 0.0, shared=True)
        seen = len(store)
    ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    out, stop = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_worker, args=(i, opts, out, stop), daemon=True) for i in range(opts.workers)]
    start = time.monotonic()
    for p in procs:
        p.start()
    tally = _Tally()
    shared = False
    last_status = start
    crash = None
    try:
        while True:
            elapsed = time.monotonic() - start
            if elapsed >= opts.seconds or tally.found is not None or crash is not None:
                break
            if not any(p.is_alive() for p in procs) and out.empty():
                break
            try:
                msg = out.get(timeout=min(0.25, max(0.01, opts.seconds - elapsed)))
            except queue_mod.Empty:
                msg = None
            if msg is not None:
                crash = tally.absorb(msg, time.monotonic() - start) or crash
            if time.monotonic() - last_status >= STATUS_EVERY:
                last_status = time.monotonic()
                if status:
                    status(tally.status_line(time.monotonic() - start))
                if store is not None and tally.found is None and len(store) > seen:
                    tally.found, tally.found_at, shared = store.traces(seen)[0], time.monotonic() - start, True
    finally:
        stop.set()
        deadline = time.monotonic() + 5
        for p in procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.terminate()
        while True:
            try:
                msg = out.get_nowait()
            except (queue_mod.Empty, OSError, ValueError):
                break
            tally.absorb(msg, time.monotonic() - start)  # a late crash report no longer matters
    found = tally.found
    if crash is not None and found is None:
        raise RuntimeError(f"a fuzz worker crashed: {crash}")
    elapsed = time.monotonic() - start
    if status:
        status(tally.status_line(elapsed))
    if found is not None and store is not None and not shared:
        store.push(found)
    return FuzzResult(
        found,
        tally.runs,
        tally.steps,
        elapsed,
        frozenset(tally.events),
        tally.found_at,
        shared,
    )


@attrs.define
class _Tally:
    """What the workers have reported: progress adds up, the first failure wins."""

    runs: int = 0
    steps: int = 0
    events: set = attrs.field(factory=set)
    found: Trace | None = None
    found_at: float | None = None

    def absorb(self, msg, elapsed: float) -> str | None:
        """Fold in one worker message; returns a crash report, if that is what it was."""
        if msg[0] == "progress":
            self.runs, self.steps = self.runs + msg[1], self.steps + msg[2]
            self.events |= msg[3]
        elif msg[0] == "failure" and self.found is None:
            self.found, self.found_at = tr.from_dict(msg[1]), elapsed
        elif msg[0] == "crash":
            return msg[1]
        return None

    def status_line(self, elapsed: float) -> str:
        rate = self.steps / elapsed if elapsed > 0 else 0.0
        return (
            f"[{elapsed:7.1f}s] runs {self.runs:,} | steps {self.steps:,} | {rate:,.0f} steps/s | "
            f"failures {int(self.found is not None)} | events {len(self.events & set(EVENTS))}/{len(EVENTS)}"
        )


def default_workers() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))
