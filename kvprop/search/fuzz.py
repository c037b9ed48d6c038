"""``kvprop fuzz``: worker processes searching until the budget ends or a failure.

Each worker runs one driver — the seeded walker (fast) or the Hypothesis state machine
(its heuristics, saving to the example database). The parent prints a status line at
least every 2 s, hands every find to ``on_find`` the moment it arrives (the caller puts it
on disk before anything else happens to it), and returns the find it reports.

A campaign is a seed and a run budget. Runs are numbered across the workers: worker ``w``
of ``N`` runs ``first_run + w``, then every ``N``-th run after it, and run ``i`` walks
``walk_seed(seed, i)`` whichever worker runs it. With the walker the reported find therefore
depends on neither timing nor the number of workers: after a first find the other workers
finish every run numbered below it, so the reported find is the failing run with the lowest
number, and with ``--max-runs`` the runs (and, going on past triaged finds, every find) are
the same for one worker or many.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import shutil
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

import attrs

from kvprop import interrupt
from kvprop.errors import ConfigError, TargetError
from kvprop.search import CALL_TIMEOUT, MAX_MEMORY_MIB, worker_setup
from kvprop.search import journal as jn
from kvprop.search import supervisor as sv
from kvprop.search import trace as tr
from kvprop.search.descendants import end_group, resident_mib
from kvprop.search.isolation import in_fresh_fork, isolates
from kvprop.search.signature import signature_of
from kvprop.search.tally import Tally
from kvprop.search.trace import Trace
from kvprop.targets.protocol import reachable_events

REPORT_EVERY = 0.5
STATUS_EVERY = 2.0
NO_LIMIT = 2**62
MIN_EXECUTED = 0.1  # below this fraction of sampled configurations the target built, a run is not "clean"


@attrs.frozen
class FuzzOptions:
    seconds: float = 60.0
    workers: int = 1
    seed: int = 0
    driver: str = "walk"
    variant: str | None = None
    target: str | None = None
    device: str | None = None
    max_ops: int = 200
    # walk driver: the campaign's runs in all, numbered first_run up to max_runs (run i is the same
    # run on any number of workers); hypothesis driver: the examples each worker runs
    max_runs: int | None = None
    first_run: int = 0  # walk driver: the number of the campaign's first run (a batch of a larger campaign)
    redis: str | None = None  # share failures with other machines through this Redis URL
    canary: bool = False  # search with the canary fault on (kvprop.targets.canary)
    fresh: bool = False  # the Hypothesis driver neither reads nor writes its example database
    known: frozenset = frozenset()  # walk driver: finds of these kinds are kept and the search goes on
    triaged: frozenset = frozenset()  # walk driver: so are finds of these signatures (kvprop.search.signature)
    call_timeout: float = CALL_TIMEOUT  # seconds a worker may go without progress before it is a target-hang
    max_memory: float = MAX_MEMORY_MIB  # MiB a worker may hold before it is a target-oom
    build_timeout: float | None = None  # the same while it imports or builds the target (None: call_timeout)


@attrs.frozen
class FuzzResult:
    found: Trace | None
    runs: int
    steps: int
    seconds: float
    events: frozenset
    seconds_to_find: float | None = None
    shared: bool = False  # found by another machine, through the shared store
    refused: dict = attrs.field(factory=dict)  # why the target refused configurations: reason -> count
    interrupted: bool = False
    deterministic: bool = True  # the reported find is the lowest-numbered failing run, whatever the timing
    known: dict = attrs.field(factory=dict)  # finds already triaged, which did not end the search: signature -> count
    depths: dict = attrs.field(factory=dict)  # built configurations by pipeline depth (batches in flight) -> runs

    @property
    def executed_runs(self) -> int:
        return self.runs - sum(self.refused.values())


class WorkerCrash(Exception):
    """A worker hit an error of kvprop itself (never a find); the message has its traceback."""


class Unusable(Exception):
    """The search could not test anything (e.g. the target refused everything the driver drew)."""


# ---- workers ------------------------------------------------------------------------------


def _orphaned(parent: int) -> bool:
    return os.getppid() != parent


def _walk_worker(index: int, opts: FuzzOptions, out, stop, limit, parent: int, first: int, files: Path) -> None:
    from kvprop.search.walk import run_walk, walk_seed

    journal = jn.Journal(files / f"w{index}.journal")
    sv.load_target_here(journal, opts.target, opts.variant)
    events: set[str] = set()
    refused: Counter[str] = Counter()
    depths: Counter[int] = Counter()
    runs, steps, last = 0, 0, time.monotonic()
    i = first
    while not stop.is_set() and i <= limit.value and (opts.max_runs is None or i < opts.max_runs):
        if _orphaned(parent):
            return
        seed = walk_seed(opts.seed, i)
        worker_setup.restart_log()

        def walk(seed=seed, i=i):
            return run_walk(
                seed, opts.variant, opts.target, opts.device, opts.max_ops, canary=opts.canary, journal=journal, index=i
            )

        result = in_fresh_fork(walk) if isolates(opts.target) else walk()
        runs, steps = runs + 1, steps + result.steps_run
        events |= result.events
        if result.refused is not None:
            refused[result.refused] += 1
        else:
            depths[result.trace.config.pipeline_depth] += 1
        if result.failure is not None or time.monotonic() - last >= REPORT_EVERY:
            out.put(("progress", runs, steps, events, refused, depths))  # before any find, so it is counted
            runs, steps, events, refused, depths, last = 0, 0, set(), Counter(), Counter(), time.monotonic()
        if result.failure is not None:
            trace = attrs.evolve(result.trace, failure=result.failure)
            found = tr.to_dict(trace)
            log = _copy_log(files, index, i)
            if not is_known(opts, trace):
                out.put(("failure", i, index, found, log))
                return
            out.put(("known", found, log))
        i += opts.workers
    out.put(("progress", runs, steps, events, refused, depths))


def is_known(opts: FuzzOptions, trace: Trace) -> bool:
    """Whether a find is one already triaged: of a kind ``--known`` names, or of a signature
    ``--triaged`` lists (a new bug of a triaged kind still ends the search)."""
    assert trace.failure is not None  # a find is a trace with its failure
    return trace.failure.kind in opts.known or signature_of(trace).key in opts.triaged


def _copy_log(files: Path, index: int, i: int) -> str | None:
    """A copy of what the target printed in this run, before the next run's output replaces it."""
    kept = worker_setup.copy_log(files / f"w{index}.log", files, f"find-w{index}-{i}")
    return str(kept) if kept else None


class _Stop(BaseException):
    """Ends a Hypothesis run from inside (Hypothesis lets BaseExceptions through)."""


def _hypothesis_worker(index: int, opts: FuzzOptions, out, stop, limit, parent: int, first: int, files: Path) -> None:
    from hypothesis import seed as hseed
    from hypothesis import settings
    from hypothesis.errors import Unsatisfiable
    from hypothesis.stateful import run_state_machine_as_test

    from kvprop.search import profiles
    from kvprop.search.machine import failure_trace, machine_for
    from kvprop.search.walk import walk_seed

    profiles.load("fuzz")
    journal = jn.Journal(files / f"w{index}.journal")
    sv.load_target_here(journal, opts.target, opts.variant)
    machine = machine_for(opts.variant, opts.target, opts.device)
    machine.journal = journal
    chunk = settings(settings.default, max_examples=200)  # Hypothesis starts each run simple: keep runs long
    if opts.fresh:
        chunk = settings(chunk, database=None)
    elif opts.redis:
        from kvprop.search.store import hypothesis_database

        chunk = settings(chunk, database=hypothesis_database(opts.redis))
    reported = dict(machine.counters)
    last = [time.monotonic()]

    stopping = [False]

    def on_example():
        if (
            stop.is_set()
            or _orphaned(parent)
            or (opts.max_runs is not None and machine.counters["examples"] >= opts.max_runs)
        ):
            stopping[0] = True
            raise _Stop
        if time.monotonic() - last[0] >= REPORT_EVERY:
            _progress(out, machine, reported)
            last[0] = time.monotonic()

    machine.on_example = staticmethod(on_example)
    i = first
    while not stop.is_set() and (opts.max_runs is None or machine.counters["examples"] < opts.max_runs):
        s = walk_seed(opts.seed, i)
        machine.run_seed = s
        try:
            run_state_machine_as_test(hseed(s)(machine), settings=chunk)
        except _Stop:
            break
        except Unsatisfiable:
            _progress(out, machine, reported)
            out.put(("unusable", _unsatisfiable(opts, machine)))
            return
        except BaseException as e:  # noqa: BLE001 - a finding, or an error of kvprop itself
            _progress(out, machine, reported)
            if not machine.failures:
                if stop.is_set() or _orphaned(parent) or stopping[0]:
                    break  # Hypothesis may wrap the _Stop that ended the run
                if not isinstance(e, Exception):
                    raise  # the target's own BaseException, escaped from building it: its crash (_worker)
                out.put(("crash", f"worker {index}: {type(e).__name__}: {e}\n{traceback.format_exc()}"))
                return
            log = _copy_log(files, index, i)
            out.put(("failure", i, index, tr.to_dict(attrs.evolve(failure_trace(machine), seed=s)), log))
            return
        i += opts.workers
    _progress(out, machine, reported)


def _unsatisfiable(opts: FuzzOptions, machine) -> str:
    reasons = machine.counters.get("refused") or Counter()
    first = next(iter(reasons), "no reason recorded")
    return (
        f"target {opts.target or 'kvprop'} refused every configuration the state machine drew "
        f"({sum(reasons.values())} refused; first: {first})"
    )


def _progress(out, machine, reported: dict) -> None:
    c = machine.counters
    tallies = {name: Counter(c.get(name, Counter())) for name in ("refused", "depths")}
    since = {name: tally - reported.get(name, Counter()) for name, tally in tallies.items()}
    out.put(
        (
            "progress",
            c["examples"] - reported["examples"],
            c["steps"] - reported["steps"],
            set(machine.events_seen),
            since["refused"],
            since["depths"],
        )
    )
    reported.update(examples=c["examples"], steps=c["steps"], **tallies)


def _worker(index, opts, out, stop, limit, parent, first, files):
    """A supervised worker (``kvprop.search.supervisor``): its last message is ``exit``; a
    worker that ends without it died, and the parent judges the death."""
    try:
        worker_setup.enter_worker(files / f"w{index}.log", parent)
        worker = _walk_worker if opts.driver == "walk" else _hypothesis_worker
        worker(index, opts, out, stop, limit, parent, first, files)
        out.put(("exit", index))
    except (TargetError, ConfigError) as e:  # the target cannot be used (or a value of it is wrong)
        out.put(("target-error", str(e)))
        out.put(("exit", index))
    except Exception as e:  # noqa: BLE001 - an error of kvprop itself: report, never hang the parent
        out.put(("crash", f"worker {index}: {type(e).__name__}: {e}\n{traceback.format_exc()}"))
        out.put(("exit", index))
    except BaseException as e:  # noqa: BLE001 - escaped target code (kvprop's own _Stop never leaves its loop)
        worker_setup.escaped(e)


# ---- the parent ---------------------------------------------------------------------------


def _from_store(opts: FuzzOptions, store, status) -> Trace | None:
    """A trace another machine stored that still fails here and is not triaged here, if any."""
    with sv.Supervisor(
        opts.target, opts.variant, opts.device, opts.call_timeout, build_timeout=opts.build_timeout
    ) as supervisor:
        return _first_failing(_untriaged(opts, store.news()), supervisor, status)


def _untriaged(opts: FuzzOptions, traces: list[Trace]) -> list[Trace]:
    """The traces from the shared store that would end this search: a find another machine
    pushed that this campaign has triaged (``--known``, ``--triaged``) does not."""
    return [trace for trace in traces if not is_known(opts, trace)]


def _first_failing(traces, supervisor, status) -> Trace | None:
    for trace in traces:
        if supervisor.execute(trace).failure is not None:
            if status:
                status(f"a trace from the shared store still fails ({trace.failure.kind if trace.failure else '?'})")
            return trace
    return None


def search(opts: FuzzOptions, status=None, on_find=None, started: float | None = None) -> FuzzResult:
    """Run workers until the budget ends or a failure (``status`` gets status lines, ``on_find``
    every find as it arrives, of a known kind too, with the path of the target's output in
    its run or None). ``started`` (a ``time.monotonic()`` value) is when the budget began.

    Ctrl-C ends the search with ``interrupted`` set, never losing what was reported. A worker
    that dies or hangs is a find (``kvprop.search.supervisor``); one that hits an error of
    kvprop itself raises ``WorkerCrash``; a target that cannot be used raises ``TargetError``;
    a search the target made impossible raises ``Unusable``. With ``opts.redis``, stored traces
    for this target are replayed first, every find is pushed for the other machines, and a
    find pushed by another machine ends this search too, unless it is triaged here; Redis lost
    mid-search leaves the search going on locally (``kvprop.search.store``)."""
    from kvprop.search.store import TraceStore, sharing

    start = time.monotonic() if started is None else started
    store = None
    if opts.redis:
        store = TraceStore(opts.redis, opts.target, opts.variant, say=status)
        known = _from_store(opts, store, status)
        if known is not None:
            if on_find:
                on_find(known, None)
            return FuzzResult(known, 0, 0, time.monotonic() - start, frozenset(), 0.0, shared=True)
    files = Path(tempfile.mkdtemp(prefix="kvprop-fuzz-"))
    try:
        return _search(opts, status, sharing(on_find, store), start, store, files)
    finally:
        shutil.rmtree(files, ignore_errors=True)


def _search(opts: FuzzOptions, status, on_find, start: float, store, files: Path) -> FuzzResult:
    ctx = mp.get_context("fork") if sys.platform.startswith("linux") else mp.get_context("spawn")
    out, stop, limit = ctx.Queue(), ctx.Event(), ctx.Value("q", NO_LIMIT)
    parent = os.getpid()
    workers: dict = {}
    spawned: dict[int, float] = {}

    def spawn(index: int, first: int) -> None:
        (files / f"w{index}.journal").unlink(missing_ok=True)
        p = ctx.Process(target=_worker, args=(index, opts, out, stop, limit, parent, first, files), daemon=True)
        p.start()
        spawned[index] = time.time()  # its start-up is held to sv.START_GRACE
        workers[index] = p

    for i in range(opts.workers):
        spawn(i, opts.first_run + i)
    tally = Tally(on_find=on_find, reachable=reachable_events(opts.target))
    shared = interrupted = False
    last_status = time.monotonic()
    try:
        while True:
            interrupt.check()  # one lost inside a finalizer ends the search all the same
            elapsed = time.monotonic() - start
            if elapsed >= opts.seconds or tally.crash or tally.unusable or tally.target_error:
                break
            if tally.found and (opts.driver != "walk" or shared):
                break
            if len(tally.exited) == len(workers):
                break  # every worker said it ends: nothing more will come
            if not any(p.is_alive() for p in workers.values()) and out.empty() and not _unjudged(workers, tally):
                break
            try:
                msg = out.get(timeout=min(0.25, max(0.01, opts.seconds - elapsed)))
            except queue_mod.Empty:
                msg = None
            if msg is not None:
                tally.absorb(msg, time.monotonic() - start)
            _judge_workers(opts, workers, spawned, tally, files, out, spawn, time.monotonic() - start)
            if tally.found:
                with limit.get_lock():
                    limit.value = min(limit.value, tally.best[0])
            if time.monotonic() - last_status >= STATUS_EVERY:
                last_status = time.monotonic()
                if status:
                    status(tally.status_line(time.monotonic() - start))
                theirs = _untriaged(opts, store.news()) if store is not None and not tally.found else []
                if theirs:
                    tally.take(theirs[0], time.monotonic() - start)
                    shared = True
    except KeyboardInterrupt:
        interrupted = True
    finally:
        stop.set()
        deadline = time.monotonic() + 5
        for p in workers.values():
            p.join(timeout=max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
            end_group(p.pid)
        while True:
            try:
                msg = out.get_nowait()
            except (queue_mod.Empty, OSError, ValueError):
                break
            tally.absorb(msg, time.monotonic() - start)
    if tally.target_error and not tally.found and not interrupted:
        raise TargetError(tally.target_error)
    if tally.crash and not tally.found and not interrupted:
        raise WorkerCrash(tally.crash)
    if tally.unusable and not tally.found and not interrupted:
        raise Unusable(tally.unusable)
    elapsed = time.monotonic() - start
    if status and not interrupted:
        status(tally.status_line(elapsed))
    found = tally.found_trace()
    return FuzzResult(
        found,
        tally.runs,
        tally.steps,
        elapsed,
        frozenset(tally.events),
        tally.found_at,
        shared,
        dict(tally.refused),
        interrupted,
        deterministic=opts.driver == "walk" or opts.workers == 1,
        known=dict(tally.known),
        depths=dict(tally.depths),
    )


def _unjudged(workers: dict, tally) -> bool:
    return any(not p.is_alive() and index not in tally.exited for index, p in workers.items())


def _judge_workers(
    opts: FuzzOptions, workers: dict, spawned: dict, tally, files: Path, out, spawn, elapsed: float
) -> None:
    """A worker that died without saying ``exit``, or whose journal went unwritten past the call
    timeout, is a find: its run up to the operation it was in. A walk worker whose death is of
    a known kind goes on from the next walk."""
    now = time.time()
    for index, p in list(workers.items()):
        if index in tally.exited:
            continue
        hung = oom = None
        if p.is_alive():
            build = opts.call_timeout if opts.build_timeout is None else opts.build_timeout
            idle = sv.hung_for(files / f"w{index}.journal", spawned[index], now, opts.call_timeout, build)
            held = resident_mib(p.pid, opts.max_memory)
            if idle is None and held <= opts.max_memory:
                continue
            p.kill()
            if held > opts.max_memory:
                oom = (held, opts.max_memory)
            else:
                hung = idle
        p.join()
        end_group(p.pid)
        while True:  # what it sent before it died is counted before its death
            try:
                tally.absorb(out.get(timeout=0.05), elapsed)
            except (queue_mod.Empty, OSError, ValueError):
                break
        if index in tally.exited:
            continue
        tally.exited.add(index)
        try:
            found, walk = sv.judge(files / f"w{index}.journal", exitcode=p.exitcode, hung=hung, oom=oom)
        except TargetError as e:
            tally.target_error = tally.target_error or str(e)
            continue
        tally.runs, tally.steps = tally.runs + 1, tally.steps + len(found.steps)  # the run it died in
        log = worker_setup.copy_log(files / f"w{index}.log", files, f"death-w{index}")
        walk = walk or 0
        assert found.failure is not None  # judge gives the run the death's failure
        if is_known(opts, found) and opts.driver == "walk":
            tally.known_find(found, None if log is None else str(log))
            tally.exited.discard(index)
            spawn(index, walk + opts.workers)
        else:
            tally.take(found, elapsed, (walk, index), None if log is None else str(log))
