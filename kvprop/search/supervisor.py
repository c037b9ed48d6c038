"""Supervised workers: target code runs only in a worker process, and its death is a find.

kvprop's own process never imports a target module nor calls target code. Each worker
sends what the target prints to a log file (never to kvprop's output), writes a journal of
the run in progress (``kvprop.search.journal``), and is judged by the parent:

- it sends a result: the target behaved (a violation, a ``target-crash`` raised in a call,
  or a pass);
- it dies — a signal, ``os._exit``, ``SystemExit`` or ``KeyboardInterrupt`` escaping target
  code — without a result: a ``target-crash`` find naming the signal or exit status, its
  trace read from the journal up to the operation it died in;
- its journal is not written for ``call_timeout`` seconds: the parent kills it, and the
  find is a ``target-hang`` at the operation it hung in.

As AFL and libFuzzer treat a crashing or hanging target: a find with its input saved, never
an error of the harness. ``Supervisor`` runs single executions (replay, minimising, the
probe, the shared store's traces) and whole commands that drive a target (``call``: agree,
coverage, bench's vLLM part) in one worker it restarts after each death; the fuzz workers
(``kvprop.search.fuzz``) use the same set-up and the same judgement.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from kvprop.errors import ConfigError, KvpropError, TargetError
from kvprop.search import CALL_TIMEOUT, MAX_MEMORY_MIB
from kvprop.search.descendants import end_group, resident_mib
from kvprop.search.isolation import in_fresh_fork, isolates
from kvprop.search.worker_setup import enter_worker, escaped, restart_log

if TYPE_CHECKING:
    from kvprop.search.trace import Failure, Trace

# The journal, the trace format and the engine are imported where they are used, not here: a
# worker of ``kvprop coverage`` starts fresh (spawned) and must not import the allocator it
# measures before measuring starts.


START_GRACE = 120.0  # seconds a worker may take to start (kvprop's own imports) before it writes its journal


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def death_cause(exitcode: int | None) -> str:
    """What ended a process, as the failure's ``exception`` (the minimiser keeps it constant)."""
    if exitcode is None:
        return "unknown"
    if exitcode < 0:
        return f"signal {signal_name(-exitcode)}"
    return f"exit status {exitcode}"


def judge(
    journal_path: Path, exitcode: int | None = None, hung: float | None = None, oom: tuple[float, float] | None = None
) -> tuple[Trace, int | None]:
    """The find a worker's death stands for: its journal's run with a ``target-crash`` (died
    with ``exitcode``) or ``target-hang`` (no progress for ``hung`` seconds) failure, and the
    run's walk index. A worker that died before it began a run has no journal to read: that is
    a ``TargetError`` (the target cannot even be set up). ``oom``: (MiB held, the bound) of a
    worker killed for its memory, a ``target-oom``."""
    from kvprop.search import journal as jn
    from kvprop.search.trace import Failure

    run = jn.read(journal_path)
    cause = death_cause(exitcode)
    if run is None:
        what = f"hung for {hung:.0f}s" if hung is not None else f"died ({cause})"
        if oom is not None:
            what = f"held {oom[0]:,.0f} MiB, past the bound of {oom[1]:,.0f} MiB (--max-memory),"
        raise TargetError(f"the worker running the target {what} before it began a run")
    where = {
        "build": "while building the target (its import or factory)",  # kvprop.front.commands.BUILDING
        "drain": "in the final drain",
        "operation": f"in operation {run.step}",
    }[run.phase]
    if oom is not None:
        failure = Failure(
            run.step,
            "target-oom",
            f"target-oom: the target's worker held {oom[0]:,.0f} MiB, past the bound of {oom[1]:,.0f} MiB "
            f"(--max-memory) {where}",
            "target-oom",
            "oom",
        )
    elif hung is not None:
        failure = Failure(
            run.step,
            "target-hang",
            f"target-hang: no progress for {hung:.0f}s {where}",
            "target-hang",
            "hang",
        )
    elif run.raised is not None:
        name, message = run.raised
        failure = Failure(
            run.step,
            "target-crash",
            f"target-crash: the target raised {name} {where}, a BaseException that ends the worker: {message}",
            "target-crash",
            name,
        )
    else:
        failure = Failure(
            run.step,
            "target-crash",
            f"target-crash: the target's process died ({cause}) {where}",
            "target-crash",
            cause,
        )
    return attrs.evolve(run.trace, failure=failure), run.index


def age(path: Path, now: float) -> float:
    """Seconds since a journal was last written (``now`` from ``time.time()``): its worker's
    heartbeat; 0 if it is not there yet."""
    try:
        return max(0.0, now - os.stat(path).st_mtime)
    except OSError:
        return 0.0


def begun(path: Path) -> bool:
    """Whether a worker has begun its first run (its journal holds a header). Until then it runs
    kvprop's own start-up (a spawned one imports torch anew, a coverage worker starts measuring),
    which no call timeout counts: on a loaded machine that alone takes seconds."""
    try:
        return os.stat(path).st_size > 0
    except OSError:
        return False


def hung_for(path: Path, started: float, now: float, call_timeout: float, build_timeout: float) -> float | None:
    """Seconds a worker has gone without progress, if that makes it hung, else None: past
    ``START_GRACE`` before its first run, past ``build_timeout`` while it builds the target (its
    import or factory: importing an engine takes seconds on a loaded machine), past
    ``call_timeout`` in an operation or the drain."""
    idle, grace = idle_for(path, started, now)
    if idle <= (grace or min(call_timeout, build_timeout)):
        return None
    if not grace and idle <= max(call_timeout, build_timeout):
        from kvprop.search import journal as jn

        limit = build_timeout if jn.building(path) else call_timeout
        if idle <= limit:
            return None
    return idle


def idle_for(path: Path, started: float, now: float) -> tuple[float, float]:
    """(seconds without progress, the limit they are held to) for a worker whose journal is
    ``path`` and whose request or start was at ``started`` (both from ``time.time()``): before its
    first run it is held to ``START_GRACE`` alone."""
    if not begun(path):
        return now - started, START_GRACE
    return min(now - started, age(path, now)), 0.0


# ---- single executions ---------------------------------------------------------------------


@attrs.frozen
class Executed:
    """One execution's outcome, as the worker or the parent's judgement gives it."""

    failure: Failure | None
    lines: tuple = ()  # (step, operation repr, outcome) per step, when asked for
    events: frozenset = frozenset()
    log: Path | None = None  # where the target's output of this run is kept (after a death)


def _serve(conn, target, variant, device, journal_path: Path, log_path: Path, parent: int) -> None:
    """The worker: executes each trace the parent sends until the pipe closes."""
    from kvprop.search import journal as jn

    enter_worker(log_path, parent)
    journal = jn.Journal(journal_path)
    try:
        while True:
            try:
                request = conn.recv()
            except EOFError:
                return
            kind, payload, options = request
            restart_log()
            try:
                if kind == "probe":
                    conn.send(("ok", probe_here(journal, target, variant, device, payload)))
                    continue
                if kind == "call":
                    conn.send(("ok", _call(conn, journal, payload, options)))
                    continue
                from kvprop.search import trace as tr  # here: ``kvprop coverage`` measures what it imports
                from kvprop.search.execute import execute

                trace = tr.from_dict(payload)

                def run(trace=trace, options=options):
                    lines: list = []
                    events: set = set()
                    failure = execute(
                        trace,
                        variant=variant,
                        target=target,
                        device=device,
                        on_step=_recorder(lines) if options.get("lines") else None,
                        checks=options.get("checks", True),
                        events=events,
                        journal=journal,
                    )
                    return attrs.asdict(failure) if failure else None, tuple(lines), frozenset(events)

                conn.send(("ok", in_fresh_fork(run) if isolates(target) else run()))
            except KvpropError as e:  # the target unusable, a configuration refused, a bad trace: raised there
                conn.send(("error", _portable(e)))
            except Exception as e:  # noqa: BLE001 - an error of kvprop itself, reported to the parent
                import traceback

                conn.send(("internal", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
            except BaseException as e:  # noqa: BLE001 - the target's: kvprop raises none in a worker
                escaped(e)
    except BaseException as e:  # noqa: BLE001 - as above
        escaped(e)


def _portable(error: KvpropError) -> KvpropError:
    """``error`` as it crosses the pipe: of its own type where that takes a message alone."""
    try:
        return type(error)(str(error))
    except TypeError:
        return KvpropError(str(error))


def _recorder(lines: list):
    def record(i, op, outcome) -> None:
        lines.append((i, repr(op), outcome))

    return record


def _call(conn, journal, function, options: dict):
    """``function(**kwargs, journal=journal)`` for a command that runs wholly in the worker
    (agree, coverage); with ``progress``, its progress calls go to the parent as they come."""
    kwargs = dict(options["kwargs"])
    if options.get("progress"):
        kwargs["progress"] = lambda *args: conn.send(("progress", args))
    return function(**kwargs, journal=journal)


def load_target_here(journal, target, variant):
    """Import ``target`` and read the shapes it declares, inside a journalled run (the first
    sampled configuration, which the import does not depend on): a hang or a death while
    importing is judged like one while building. The shapes it declares."""
    import random

    from kvprop.search.alphabet import RandomChooser, sample_config
    from kvprop.search.trace import Trace
    from kvprop.targets import shapes_of

    if journal is not None and target not in (None, "kvprop"):  # kvprop's own imports nothing
        config = sample_config(RandomChooser(random.Random(0)))
        journal.begin(Trace(config=config, steps=(), variant=variant, target=target, seed=0))
    return shapes_of(target)


def probe_here(journal, target, variant, device, attempts: int) -> str | None:
    """Build sampled configurations until one builds: None, or the first refusal if none did."""
    import random

    from kvprop.search.alphabet import RandomChooser, sample_config
    from kvprop.search.harness import Harness
    from kvprop.search.trace import Trace

    first = None
    shapes = load_target_here(journal, target, variant)
    for i in range(attempts):
        config = sample_config(RandomChooser(random.Random(i)), shapes)
        if journal is not None:
            journal.begin(Trace(config=config, steps=(), variant=variant, target=target, seed=i))
        try:
            Harness(config, variant=variant, target=target, device=device)
            return None
        except ConfigError as e:
            first = first or str(e)
    return first or "no reason given"


class Died(Exception):
    """The target's process died or hung during a ``Supervisor.call``: ``trace`` is the run it
    was in, its failure the judgement (a find), ``log`` what the target printed."""

    def __init__(self, trace: Trace, log: Path | None):
        self.trace, self.log = trace, log
        super().__init__(trace.failure.message if trace.failure else "the target's process ended")


class Supervisor:
    """Executes traces on one target in a worker process, restarted after each death.

    Use as a context manager; ``close`` ends the worker and removes its files."""

    def __init__(
        self,
        target=None,
        variant=None,
        device=None,
        call_timeout: float = CALL_TIMEOUT,
        fresh: bool = False,
        max_memory: float = MAX_MEMORY_MIB,
        build_timeout: float | None = None,
    ):
        self.target, self.variant, self.device = target, variant, device
        self.call_timeout = call_timeout
        self.build_timeout = call_timeout if build_timeout is None else build_timeout  # importing, building
        self.max_memory = max_memory  # MiB the worker may hold before it is a target-oom
        self.fresh = fresh  # the worker starts a new interpreter (spawn) instead of a fork of this one
        self.dir = Path(tempfile.mkdtemp(prefix="kvprop-worker-"))
        self.journal_path = self.dir / "journal"
        self.log_path = self.dir / "target.log"
        self.proc: Any = None  # the worker process, started on the first request
        self.conn: Any = None

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        ctx: Any = mp.get_context("fork" if sys.platform.startswith("linux") and not self.fresh else "spawn")
        ours, theirs = ctx.Pipe()
        self.journal_path.unlink(missing_ok=True)
        self.log_path.unlink(missing_ok=True)
        self.proc = ctx.Process(
            target=_serve,
            args=(theirs, self.target, self.variant, self.device, self.journal_path, self.log_path, os.getpid()),
            daemon=True,
        )
        self.proc.start()
        theirs.close()
        self.conn = ours

    def close(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(OSError):
                self.conn.close()
            self.proc.join(timeout=1)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()
            end_group(self.proc.pid)
            self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def _ask(self, request, on_progress=None):
        """The worker's answer to ``request``, or ``("died", trace)`` after judging its death;
        ``on_progress`` gets the arguments of each progress message before the answer."""
        if self.proc is None or not self.proc.is_alive():
            self._start()
        self.conn.send(request)
        started = time.time()
        while True:
            if self.conn.poll(0.05):
                try:
                    answer = self.conn.recv()
                except EOFError:
                    answer = None  # it died while answering: judged below
                if answer is not None and answer[0] == "progress":
                    if on_progress is not None:
                        on_progress(*answer[1])
                    continue
                if answer is not None:
                    return answer
            if not self.proc.is_alive():
                if self.conn.poll(0):
                    with contextlib.suppress(EOFError):
                        return self.conn.recv()
                self.proc.join()
                return self._died(exitcode=self.proc.exitcode)
            hung = hung_for(self.journal_path, started, time.time(), self.call_timeout, self.build_timeout)
            if hung is not None:
                self.proc.kill()
                self.proc.join()
                return self._died(hung=hung)
            held = resident_mib(self.proc.pid, self.max_memory)
            if held > self.max_memory:
                self.proc.kill()
                self.proc.join()
                return self._died(oom=(held, self.max_memory))

    def _died(self, exitcode=None, hung=None, oom=None):
        end_group(self.proc.pid)
        self.proc = None
        found, _ = judge(self.journal_path, exitcode=exitcode, hung=hung, oom=oom)
        return ("died", found)

    def _answer(self, answer):
        kind, payload = answer
        if kind == "error":
            raise payload
        if kind == "internal":
            raise RuntimeError(payload)
        return payload

    def execute(self, trace: Trace, *, lines: bool = False, checks: bool = True) -> Executed:
        """``trace`` run in the worker; a death is judged into the failure (its ``exception``
        names the signal or exit status) and the trace's steps up to it."""
        from kvprop.search import trace as tr
        from kvprop.search.trace import Failure

        sent = tr.to_dict(attrs.evolve(trace, failure=None))  # a candidate may have lost the recorded failure's step
        answer = self._ask(("execute", sent, {"lines": lines, "checks": checks}))
        if answer[0] == "died":
            found = answer[1]
            last = found.failure.step
            shown = tuple(
                (i, repr(op), "(the target's process ended here)" if i == last else "(ran; its outcome died with it)")
                for i, op in enumerate(found.steps)
            )
            return Executed(found.failure, shown, frozenset(), self.log_path if self.log_path.exists() else None)
        failure, shown, events = self._answer(answer)
        return Executed(Failure(**failure) if failure else None, shown, events)

    def call(self, function, kwargs: dict, progress=None):
        """``function(**kwargs, journal=...)`` run in the worker: a kvprop function that runs
        target code from start to end (``kvprop agree``, ``kvprop coverage``). Its result, or
        the trace of the run the target died or hung in (a ``Died``)."""
        answer = self._ask(
            ("call", function, {"kwargs": kwargs, "progress": progress is not None}), on_progress=progress
        )
        if answer[0] == "died":
            raise Died(answer[1], self.log_path if self.log_path.exists() else None)
        return self._answer(answer)

    def probe(self, attempts: int = 64) -> Trace | None:
        """Before a search: a target that builds none of ``attempts`` sampled configurations
        cannot be tested (a ConfigError with its first refusal). A death or hang while building
        is returned as the find it is."""
        answer = self._ask(("probe", attempts, {}))
        if answer[0] == "died":
            return answer[1]
        refusal = self._answer(answer)
        if refusal is not None:
            raise ConfigError(
                f"target {self.target!r} could not build any of {attempts} sampled configurations; "
                f"first refusal: {refusal}"
            )
        return None
