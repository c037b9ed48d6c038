"""``kvprop fuzz --ray [ADDRESS]``: the walk campaign as Ray tasks (``kvprop.search.ray_campaign``).

Finds are written to ``--out`` the moment the driver receives them (as ``kvprop fuzz`` does);
the reported find is minimised on the cluster, in a supervised worker of a node that has the
target, and its steps are replayed there for the listing, so the driver needs neither the
engine nor its import. With ``--redis`` each find is pushed to the shared trace store, which
every ``kvprop fuzz --redis`` (either driver, any machine) replays before it searches.
"""

from __future__ import annotations

import contextlib
import tempfile

import attrs

from kvprop import __version__
from kvprop.errors import ConfigError
from kvprop.front.commands import say


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


@contextlib.contextmanager
def session(args, opts):
    """Connected to the cluster at ``args.ray`` ('' starts a Ray instance here with ``--workers``
    CPUs, stopped at the end), every node checked for the target: yields the CPUs."""
    from kvprop.search import ray_campaign as rc

    address = args.ray or None
    started_here = rc.connect(address, args.workers)
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
        if started_here:
            rc.disconnect()


def campaign(args, opts, slots: int, on_find):
    """The campaign (``kvprop.search.ray_campaign.campaign``); each find goes to ``on_find``
    with the path of a file holding the target's output in its run, and with ``--redis`` to
    the shared trace store."""
    from kvprop.search import fuzz
    from kvprop.search import ray_campaign as rc

    store = None
    if args.redis:
        from kvprop.search.store import TraceStore

        store = TraceStore(args.redis, opts.target, opts.variant)

    def received(trace, log_text):
        log = None
        if log_text:
            with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False, encoding="utf-8") as f:
                f.write(log_text)
                log = f.name
        on_find(trace, log)
        if store is not None:
            store.push(trace)

    try:
        return rc.campaign(
            opts,
            slots,
            status=lambda line: say(args, line),
            on_find=received,
            started=args.started,
            batch_runs=args.ray_batch,
        )
    except fuzz.Unusable as e:
        raise ConfigError(f"nothing could be tested: {e}") from None


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
