"""A walk campaign as Ray tasks (``kvprop fuzz --ray``; the optional ``ray`` extra).

The campaign's runs are cut into batches of consecutive run indices; each Ray task runs one
batch through ``kvprop.search.fuzz.search`` (one supervised worker process, so target code
never runs in the Ray worker itself) and streams back, as a Ray generator task, the moment
they happen: where it started (process and node), every find with its run index, and last
what the batch counted. Run ``i`` walks ``walk_seed(seed, i)`` wherever it runs, so the finds
are those of the process pool for the same seed and run budget.

A run is counted once, when its batch ends: a batch whose worker or node is lost is queued
again from its first run (what it counted is dropped; a find it reported is kept, once, by
its run index). Without ``known``/``triaged`` the reported find is the lowest-index failing
run: after a find, batches above it are cancelled and those below it finish.

Ray is imported only here and only when a campaign starts: ``import kvprop`` and the process
pool never need it.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import attrs

from kvprop import interrupt
from kvprop.errors import ConfigError, TargetError
from kvprop.search import RAY_BATCH, fuzz
from kvprop.search import trace as tr
from kvprop.search.tally import depth_counts
from kvprop.search.trace import Trace

BATCH_RUNS = RAY_BATCH  # runs per task, unless the campaign says otherwise
MAX_ATTEMPTS = 3  # a batch that loses its worker this many times ends the campaign (a fault of the cluster)
LOG_TAIL = 64 * 1024  # bytes of the target's output in a find's run that travel with the find
STATUS_EVERY = 2.0
_IMPORT_BROKEN = False  # set in a Ray worker whose import of the walk failed part way
INSTALL = "pip install 'kvprop[ray]'"


class RayUnavailable(ConfigError):
    """Ray is not installed, or the cluster cannot be reached: nothing ran (exit 2)."""


@attrs.frozen
class Find:
    index: int  # the run index (global, 0-based)
    trace: Trace
    log: str | None  # the tail of what the target printed in that run
    node: str


@attrs.frozen
class CampaignResult:
    found: Trace | None  # the lowest-index find not already triaged
    runs: int
    steps: int
    seconds: float
    events: frozenset
    seconds_to_find: float | None
    refused: dict
    known: dict  # signature key -> count of triaged finds
    finds: dict  # run index -> Find, every find the campaign received
    interrupted: bool
    requeued: int  # batches queued again after their worker or node was lost
    nodes: dict  # node -> runs counted there
    shared: bool = False  # as FuzzResult: a campaign's find is its own
    deterministic: bool = True  # the reported find is the lowest-index failing run, whatever the timing
    lost: dict = attrs.field(factory=dict)  # why batches were queued again (what was lost) -> how many
    depths: dict = attrs.field(factory=dict)  # built configurations by pipeline depth -> runs

    def requeue_line(self) -> str | None:
        """The batches run again, and what lost them, for the summary; None when none was."""
        if not self.requeued:
            return None
        why = ", ".join(f"{what}: {n}" for what, n in sorted(self.lost.items()))
        batches = "1 batch" if self.requeued == 1 else f"{self.requeued} batches"
        return f"{batches} run again from {'its' if self.requeued == 1 else 'their'} first run ({why})"

    @property
    def executed_runs(self) -> int:
        return self.runs - sum(self.refused.values())


# ---- connecting ----------------------------------------------------------------------------


def import_ray():
    try:
        import ray
    except ImportError:
        raise RayUnavailable(f"--ray needs Ray: {INSTALL} (or run without --ray: the process pool)") from None
    return ray


def _reachable(address: str) -> None:
    """``host:port`` or ``ray://host:port`` answers a TCP connection within 5 s (``auto`` is
    left to Ray); Ray itself waits far longer on an address nobody listens on."""
    if address == "auto":
        return
    url = urlsplit(address if "://" in address else f"tcp://{address}")
    try:
        host, port = url.hostname, url.port
    except ValueError as e:
        raise RayUnavailable(f"--ray {address!r}: not HOST:PORT or ray://HOST:PORT ({e})") from None
    if not host or port is None:
        raise RayUnavailable(f"--ray {address!r}: expected HOST:PORT, ray://HOST:PORT or auto")
    try:
        socket.create_connection((host, port), timeout=5).close()
    except OSError as e:
        raise RayUnavailable(
            f"--ray {address}: cannot connect ({e.strerror or e}); start a cluster with `ray start --head` "
            f"and pass its address, or give --ray no address for a local Ray instance"
        ) from None


def connect(address: str | None, cpus: int) -> bool:
    """Join the cluster at ``address``, or start a Ray instance here with ``cpus`` CPUs when
    it is None. True when kvprop started it (and so stops it, ``disconnect``)."""
    ray = import_ray()
    if address is not None:
        _reachable(address)
    try:
        if address is None:
            ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)
    except Exception as e:  # noqa: BLE001 - Ray's own processes failed (a raylet or agent died, a timeout): not kvprop's
        where = f"--ray {address}" if address else "--ray (a local Ray instance)"
        raise RayUnavailable(f"{where}: Ray did not start or connect: {e}") from None
    interrupt.install()  # Ray's driver turns SIGTERM into SystemExit; kvprop's meaning comes back
    return address is None


def disconnect() -> None:
    import ray

    ray.shutdown()


# ---- on a Ray worker -----------------------------------------------------------------------


def _log_tail(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - LOG_TAIL))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return None


def node_name() -> str:
    import ray

    return f"{ray.util.get_node_ip_address()}/{ray.get_runtime_context().get_node_id()[:8]}"


def run_batch(opts: fuzz.FuzzOptions, first: int, end: int):
    """A Ray generator task: runs [first, end) in one supervised worker, yielding
    ``("started", pid, node)``, then ``("find", index, trace dict, log tail)`` per find as it
    happens, then ``("done", counts)`` or ``("error", kind, message)``. A cancel (Ray raises
    ``KeyboardInterrupt`` here) ends the search, which stops its worker."""
    global _IMPORT_BROKEN
    if _IMPORT_BROKEN:
        os._exit(1)  # this process cannot import kvprop's walk again: Ray starts a fresh worker
    try:
        from kvprop.search.walk import walk_seed
    except BaseException:
        # a cancel arriving while torch loads leaves its half-made registrations in the process,
        # and every later import of torch here fails: the process serves no further task
        _IMPORT_BROKEN = True
        raise

    interrupt.requested.clear()  # a worker process runs task after task
    node = node_name()
    yield ("started", os.getpid(), node)
    index_of = {walk_seed(opts.seed, i): i for i in range(first, end)}
    events: queue.Queue = queue.Queue()

    def on_find(trace: Trace, log: str | None) -> None:
        assert trace.seed is not None  # a walk's trace records its seed
        events.put(("find", index_of[trace.seed], tr.to_dict(trace), _log_tail(log)))

    def work() -> None:
        batch = attrs.evolve(opts, workers=1, first_run=first, max_runs=end, seconds=1e9, redis=None)
        try:
            r = fuzz.search(batch, on_find=on_find)
            counts = {
                "runs": r.runs,
                "steps": r.steps,
                "events": sorted(r.events),
                "refused": dict(r.refused),
                "depths": dict(r.depths),
                "interrupted": r.interrupted,
            }
            events.put(("done", counts))
        except TargetError as e:
            events.put(("error", "target", str(e)))
        except fuzz.Unusable as e:
            events.put(("error", "unusable", str(e)))
        except ConfigError as e:
            events.put(("error", "config", str(e)))
        except Exception as e:  # noqa: BLE001 - an error of kvprop itself, reported to the driver
            events.put(("error", "crash", f"{node}: {type(e).__name__}: {e}"))

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    try:
        while True:
            try:
                item = events.get(timeout=0.2)
            except queue.Empty:
                continue
            yield item
            if item[0] in ("done", "error"):
                return
    finally:
        if thread.is_alive():  # cancelled: the search sees the request and stops its worker
            interrupt.requested.set()
            thread.join(timeout=10)
        interrupt.requested.clear()


def check_node(target: str | None, variant: str | None, device: str | None, call_timeout: float, version: str):
    """On one node: its kvprop is the driver's, and it builds the target (in a supervised
    worker). None, or what is wrong there."""
    from kvprop import __version__
    from kvprop.search.supervisor import Supervisor

    here = node_name()
    if __version__ != version:
        return f"node {here} has kvprop {__version__}, the driver {version}"
    try:
        with Supervisor(target, variant, device, call_timeout) as supervisor:
            dead = supervisor.probe()
    except (TargetError, ConfigError) as e:
        return f"node {here}: {e}"
    if dead is not None and dead.failure is not None:
        return f"node {here}: the target died while being built ({dead.failure.message})"
    return None


# ---- the driver ----------------------------------------------------------------------------


def check_nodes(opts: fuzz.FuzzOptions) -> int:
    """Every alive node builds the target, or the campaign does not start (ConfigError naming
    each node and what it lacks): a missing engine is never a find. Returns the CPUs."""
    import ray
    from ray.exceptions import RayError, RayTaskError
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from kvprop import __version__

    try:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        remote = ray.remote(check_node)
        refs = [
            remote.options(
                num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
            ).remote(opts.target, opts.variant, opts.device, opts.call_timeout, __version__)
            for n in nodes
        ]
        problems = [p for p in ray.get(refs) if p is not None]
    except RayTaskError:
        raise  # kvprop's own check failed on a node: an error of kvprop, said as such
    except RayError as e:  # a raylet, worker or node of Ray's died before the campaign could start
        raise RayUnavailable(
            f"--ray: Ray's processes died while the campaign started ({type(e).__name__}: {e})"
        ) from None
    if problems:
        raise ConfigError(
            f"{len(problems)} of {len(nodes)} Ray nodes cannot run target {opts.target or 'kvprop'}: "
            + "; ".join(problems)
            + " (every node needs kvprop and the engine: start the cluster from the engine's environment, "
            "or give the tasks a Ray runtime env that installs it; see docs/campaigns.md)"
        )
    return max(1, int(ray.cluster_resources().get("CPU", 1)))


@attrs.define
class _Batch:
    first: int
    end: int
    attempts: int = 0
    node: str = "?"
    pid: int | None = None


@attrs.define
class _Driver:
    """What the campaign holds between events: batches in flight, what finished, the finds."""

    opts: fuzz.FuzzOptions
    on_find: Callable[[Trace, str | None], None] | None
    on_started: Callable[[int, str], None] | None
    start: float
    runs: int = 0
    steps: int = 0
    events: set = attrs.field(factory=set)
    refused: Counter = attrs.field(factory=Counter)
    depths: Counter = attrs.field(factory=Counter)
    known: Counter = attrs.field(factory=Counter)
    finds: dict = attrs.field(factory=dict)
    best: int | None = None
    found_at: float | None = None
    requeued: int = 0
    lost: Counter = attrs.field(factory=Counter)  # what batches lost (LOST's words) -> batches queued again
    nodes: Counter = attrs.field(factory=Counter)
    error: tuple | None = None

    def take(self, batch: _Batch, item: tuple) -> bool:
        """Fold in one item a batch yielded; True when the batch is done."""
        from kvprop.search.signature import signature_of

        if item[0] == "started":
            batch.pid, batch.node = item[1], item[2]
            if self.on_started is not None:
                self.on_started(item[1], item[2])
        elif item[0] == "find" and item[1] not in self.finds:
            trace = tr.from_dict(item[2])
            self.finds[item[1]] = Find(item[1], trace, item[3], batch.node)
            if self.on_find is not None:
                self.on_find(trace, item[3])
            if fuzz.is_known(self.opts, trace):
                self.known[signature_of(trace).key] += 1
            elif self.best is None or item[1] < self.best:
                self.best = item[1]
                self.found_at = self.found_at or time.monotonic() - self.start
        elif item[0] == "done":
            counts = item[1]
            self.runs, self.steps = self.runs + counts["runs"], self.steps + counts["steps"]
            self.events |= set(counts["events"])
            self.refused.update(counts["refused"])
            self.depths.update(counts["depths"])
            self.nodes[batch.node] += counts["runs"]
            return True
        elif item[0] == "error":
            self.error = self.error or (item[1], item[2])
            return True
        return False

    def status_line(self, budget: int | None) -> str:
        elapsed = time.monotonic() - self.start
        rate = self.runs / elapsed if elapsed > 0 else 0.0
        per_node = ", ".join(f"{node} {n / elapsed:,.1f}" for node, n in sorted(self.nodes.items()))
        eta = ""
        if budget is not None and rate > 0:
            eta = f" | ETA {max(0.0, (budget - self.runs) / rate):,.0f}s"
        known = f" | known {sum(self.known.values()):,}" if self.known else ""
        again = f" | batches run again {self.requeued}" if self.requeued else ""
        finds = len(self.finds) - sum(self.known.values())
        return (
            f"[{elapsed:7.1f}s] runs {self.runs:,} | {rate:,.1f} runs/s ({per_node or 'no batch done yet'}) | "
            f"finds {finds}{known}{again}{eta}{depth_counts(self.depths)}"
        )


LOST = {  # what a batch lost, in the summary's words, by the Ray exception that said so
    "WorkerCrashedError": "a Ray worker lost",
    "NodeDiedError": "a Ray node lost",
    "LocalRayletDiedError": "the local raylet lost",
    "OutOfMemoryError": "a Ray worker killed by Ray's memory monitor",
}


def campaign(
    opts: fuzz.FuzzOptions,
    slots: int,
    status: Callable[[str], None] | None = None,
    on_find: Callable[[Trace, str | None], None] | None = None,
    started: float | None = None,
    batch_runs: int = BATCH_RUNS,
    on_started: Callable[[int, str], None] | None = None,
) -> CampaignResult:
    """Run ``opts``'s walk campaign on the connected Ray cluster, ``slots`` batches at a time
    (its CPUs), until the run budget (``opts.max_runs``) or ``opts.seconds`` ends, or the
    lowest-index find is certain. ``on_find`` gets every find once, as it arrives;
    ``on_started`` each task's (process id, node) as it starts. Ctrl-C cancels every task and
    returns with ``interrupted`` set."""
    import ray
    from ray.exceptions import RayError, TaskCancelledError

    start = time.monotonic() if started is None else started
    d = _Driver(opts, on_find, on_started, start)
    budget = opts.max_runs
    waiting: list[_Batch] = []  # batches queued again, lowest first
    next_first = 0
    flying: dict[Any, _Batch] = {}  # ObjectRefGenerator -> its batch
    task = ray.remote(run_batch).options(num_cpus=1, max_retries=0)
    interrupted = False
    last_status = time.monotonic()

    def next_batch() -> _Batch | None:
        nonlocal next_first
        if waiting:
            return waiting.pop(0)
        if budget is not None and next_first >= budget:
            return None
        end = next_first + batch_runs if budget is None else min(budget, next_first + batch_runs)
        batch, next_first = _Batch(next_first, end), end
        return batch

    def cancel(gen) -> None:
        flying.pop(gen)
        ray.cancel(gen)

    try:
        while True:
            interrupt.check()
            if time.monotonic() - start >= opts.seconds or d.error:
                break
            for gen in [g for g, b in flying.items() if d.best is not None and b.first > d.best]:
                cancel(gen)
            while len(flying) < 2 * slots:  # one queued behind each running task: no idle gap
                batch = next_batch()
                if batch is None or (d.best is not None and batch.first > d.best):
                    if batch is not None:
                        waiting.insert(0, batch)
                    break
                batch.attempts += 1
                flying[task.remote(opts, batch.first, batch.end)] = batch
            if not flying:
                break
            ready: list[Any] = ray.wait(list(flying), num_returns=1, timeout=0.25)[0]
            for gen in ready:
                batch = flying[gen]
                item: Any
                try:
                    item = ray.get(next(gen))
                except StopIteration:
                    flying.pop(gen)
                    continue
                except TaskCancelledError:
                    flying.pop(gen)
                    continue
                except RayError as e:  # its worker or node was lost: the batch runs again, from its first run
                    flying.pop(gen)
                    if batch.attempts >= MAX_ATTEMPTS:
                        d.error = (
                            "crash",
                            f"runs [{batch.first}, {batch.end}) lost their Ray worker "
                            f"{batch.attempts} times; last: {type(e).__name__}: {e}",
                        )
                        break
                    d.requeued += 1
                    d.lost[LOST.get(type(e).__name__, type(e).__name__)] += 1
                    waiting.append(batch)
                    waiting.sort(key=lambda b: b.first)
                    continue
                if d.take(batch, item):
                    flying.pop(gen)
            if status is not None and time.monotonic() - last_status >= STATUS_EVERY:
                last_status = time.monotonic()
                status(d.status_line(budget))
    except KeyboardInterrupt:
        interrupted = True
    finally:
        for gen in list(flying):
            cancel(gen)
    if d.error is not None and d.best is None and not interrupted:
        kind, message = d.error
        if kind == "target":
            raise TargetError(message)
        if kind == "unusable":
            raise fuzz.Unusable(message)
        if kind == "config":
            raise ConfigError(message)
        raise fuzz.WorkerCrash(message)
    if status is not None and not interrupted:
        status(d.status_line(budget))
    found = d.finds[d.best].trace if d.best is not None else None
    return CampaignResult(
        found,
        d.runs,
        d.steps,
        time.monotonic() - start,
        frozenset(d.events),
        d.found_at,
        dict(d.refused),
        dict(d.known),
        dict(d.finds),
        interrupted,
        d.requeued,
        dict(d.nodes),
        lost=dict(d.lost),
        depths=dict(d.depths),
    )
