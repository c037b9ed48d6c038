"""``kvprop fuzz --ray [ADDRESS]``: the walk campaign as Ray tasks (``kvprop.search.ray_campaign``).

Finds are written to ``--out`` the moment the driver receives them (as ``kvprop fuzz`` does);
the reported find is minimised on the cluster, in a supervised worker of a node that has the
target, and its steps are replayed there for the listing, so the driver needs neither the
engine nor its import. With ``--redis`` each find is pushed to the shared trace store, which
every ``kvprop fuzz --redis`` (either driver, any machine) replays before it searches.

Ray speaks for itself in two ways kvprop keeps apart from its own output: its driver prints
a lost worker's error to stdout from a thread of its own, and its core library ends the
driver's process (status 1, the status of a find, without a word of kvprop's) when Ray's own
processes die under it as it connects. So stdout is kvprop's alone while Ray runs, and the
driver is a child process whose end this one reports.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import sys
import tempfile
import threading

import attrs

from kvprop import __version__
from kvprop.errors import ConfigError
from kvprop.exits import EXIT_USAGE
from kvprop.front.commands import print_json, say

WATCHED = (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD)  # what the parent of the Ray driver waits on
PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent dies


def check_args(args) -> None:
    """What ``--ray`` does not combine with: exit 2 before anything starts."""
    if args.driver != "walk":
        raise ConfigError(
            f"--ray runs the walk driver's campaign (each run a seed of its own), not {args.driver!r}; "
            f"share finds with Hypothesis drivers through --redis"
        )
    if args.canary:
        raise ConfigError("--canary searches in the process pool: run it without --ray first, then --ray")
    if args.no_guards:
        raise ConfigError("--no-guards applies to the process pool only: run it without --ray")


class _MainThreadStdout:
    """stdout for the main thread, where kvprop writes its output (its ``--json`` document
    among it); what other threads write, Ray's among them, goes to stderr."""

    def __init__(self, out, err):
        self.out, self.err = out, err

    def write(self, text: str) -> int:
        main = threading.current_thread() is threading.main_thread()
        return (self.out if main else self.err).write(text)

    def flush(self) -> None:
        self.err.flush()
        self.out.flush()

    def __getattr__(self, name):
        return getattr(self.out, name)


@contextlib.contextmanager
def _stdout_is_kvprop_s():
    """Ray's driver prints the error of a lost worker ("(raylet) A worker died ...") to stdout
    from its own thread, whatever ``log_to_driver`` says: there it would break ``--json``."""
    stdout = sys.stdout
    sys.stdout = _MainThreadStdout(stdout, sys.stderr)  # type: ignore[assignment]
    try:
        yield
    finally:
        sys.stdout = stdout


def drive_in_child(args) -> None:
    """Go on in a child process, as the Ray driver; this process waits for it and exits with
    its status. When the child ends without Python finishing (Ray's core library ended it:
    its raylet died as it connected), this one says so and exits 2 instead of the child's 1,
    which would read as a find. Linux only (elsewhere nothing forks)."""
    if not sys.platform.startswith("linux"):
        return
    read, write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, WATCHED)
    pid = os.fork()
    if pid == 0:
        _as_the_driver(parent, mask)
        os.close(read)
        atexit.register(_finished, write)
        return
    os.close(write)
    code = os.waitstatus_to_exitcode(_wait_forwarding_signals(pid))
    os.set_blocking(read, False)
    try:
        finished = os.read(read, 1)
    except BlockingIOError:  # nothing written, and a process the child forked still holds the pipe
        finished = b""
    if not finished and code >= 0:
        message = (
            f"kvprop {args.command}: Ray ended kvprop's Ray driver (exit status {code}): Ray's own processes "
            f"(its raylet, an agent) died under it; see Ray's lines above and its logs "
            f"(/tmp/ray/session_latest/logs by default)"
        )
        print(message, file=sys.stderr, flush=True)
        if args.json:
            print_json(args, {"command": args.command, "exit": EXIT_USAGE, "verdict": "unusable", "error": message})
        code = EXIT_USAGE
    os._exit(code if code >= 0 else 128 - code)


def _as_the_driver(parent: int, mask) -> None:
    """The child: in a process group of its own, so that a signal for kvprop (a terminal's
    Ctrl-C, ``timeout``, a CI cancelling the job's group) reaches it once, forwarded; and
    interrupted (SIGTERM) if its parent is killed outright."""
    os.setpgid(0, 0)
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    if os.getppid() != parent:  # killed before the line above could take effect
        os.kill(os.getpid(), signal.SIGTERM)


def _finished(fd: int) -> None:
    """Tell the parent that Python finished this process: the exit status is kvprop's own."""
    with contextlib.suppress(OSError):  # the parent is gone
        os.write(fd, b".")


def _wait_forwarding_signals(pid: int) -> int:
    """The child's wait status, once it ends; SIGINT and SIGTERM go on to it meanwhile."""
    while True:
        info = signal.sigwaitinfo(WATCHED)
        if info.si_signo != signal.SIGCHLD:
            os.kill(pid, info.si_signo)
            continue
        ended, status = os.waitpid(pid, os.WNOHANG)
        if ended:
            return status


@contextlib.contextmanager
def session(args, opts):
    """Connected to the cluster at ``args.ray`` ('' starts a Ray instance here with ``--workers``
    CPUs, stopped at the end), every node checked for the target: yields the CPUs. From the
    connection on this runs in a child process (``drive_in_child``), and Ray writes nothing
    to stdout."""
    from kvprop.search import ray_campaign as rc

    address = args.ray or None
    rc.import_ray()  # without Ray: exit 2 before anything forks
    drive_in_child(args)
    with _stdout_is_kvprop_s():
        rc.connect(address, args.workers)
        try:
            slots = rc.check_nodes(opts)
            where = f"Ray cluster {address}" if address else "a local Ray instance"
            label = f"variant {args.variant}" if args.variant else f"target {args.target or 'kvprop'}"
            budget = f"{args.max_runs:,} runs" if args.max_runs else f"{args.seconds:g}s"
            say(
                args,
                f"kvprop {__version__} fuzz --ray: {where}, {slots} CPUs, {label}, budget {budget}, seed {args.seed}",
            )
            yield slots
        finally:
            rc.disconnect()  # ends Ray's threads here; a cluster joined goes on without this driver


def campaign(args, opts, slots: int, on_find):
    """The campaign (``kvprop.search.ray_campaign.campaign``); each find goes to ``on_find``
    with the path of a file holding the target's output in its run, and with ``--redis`` to
    the shared trace store, as the process pool's finds do (``kvprop.search.store.sharing``)."""
    from kvprop.search import fuzz
    from kvprop.search import ray_campaign as rc
    from kvprop.search.store import TraceStore, sharing

    def status(line: str) -> None:
        say(args, line)

    store = TraceStore(args.redis, opts.target, opts.variant, say=status) if args.redis else None
    found = sharing(on_find, store)

    def received(trace, log_text):
        log = None
        if log_text:
            with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False, encoding="utf-8") as f:
                f.write(log_text)
                log = f.name
        found(trace, log)

    try:
        result = rc.campaign(
            opts, slots, status=status, on_find=received, started=args.started, batch_runs=args.ray_batch
        )
    except fuzz.Unusable as e:
        raise ConfigError(f"nothing could be tested: {e}") from None
    again = result.requeue_line()
    if again is not None:
        say(args, again)
    return result


def _minimise_remote(trace: dict, target, variant, device, call_timeout: float) -> dict:
    """On a node: the smallest trace that fails like ``trace``, each candidate in a supervised worker."""
    from kvprop.repro.minimise import minimiser_for
    from kvprop.search import trace as tr
    from kvprop.search.supervisor import Supervisor

    with Supervisor(target, variant, device, call_timeout) as supervisor:
        minimiser = minimiser_for(
            tr.from_dict(trace), variant, target, device, executor=lambda t: supervisor.execute(t).failure
        )
        return tr.to_dict(minimiser.run())


def minimise_on_cluster(args, found):
    """(trace, interrupted): the find minimised on a node, or the find itself when Ctrl-C
    cancels the task."""
    import ray

    from kvprop.search import trace as tr

    ref = (
        ray.remote(_minimise_remote)
        .options(num_cpus=1, max_retries=2)
        .remote(tr.to_dict(found), args.target, args.variant, args.device, args.call_timeout)
    )
    try:
        return tr.from_dict(ray.get(ref)), False
    except KeyboardInterrupt:
        ray.cancel(ref, force=True)
        return found, True


def _execute_remote(trace: dict, target, variant, device, call_timeout: float, lines: bool, checks: bool):
    from kvprop.search import trace as tr
    from kvprop.search.supervisor import Supervisor

    with Supervisor(target, variant, device, call_timeout) as supervisor:
        return attrs.evolve(supervisor.execute(tr.from_dict(trace), lines=lines, checks=checks), log=None)


class ClusterReplays:
    """Replays a trace on the cluster, as a ``Supervisor`` replays it here (``print_steps``)."""

    def __init__(self, args):
        self.args = args

    def execute(self, trace, *, lines: bool = False, checks: bool = True):
        import ray

        from kvprop.search import trace as tr

        a = self.args
        remote = ray.remote(_execute_remote).options(num_cpus=1, max_retries=2)
        return ray.get(remote.remote(tr.to_dict(trace), a.target, a.variant, a.device, a.call_timeout, lines, checks))
