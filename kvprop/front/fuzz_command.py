"""``kvprop fuzz`` and ``kvprop bugs``: a search, and what becomes of its find.

A find is on disk the moment it is reported (``<name>.found.json``), before it is
minimised; Ctrl-C while minimising keeps the smallest trace so far. A search ends at its run
budget, its time budget, a find or an interrupt, and its summary says which.
"""

from __future__ import annotations

import time
from pathlib import Path

from kvprop import __version__, interrupt
from kvprop.errors import ConfigError
from kvprop.exits import EXIT_CLEAN, EXIT_FOUND, EXIT_INTERRUPTED, EXIT_USAGE
from kvprop.front.commands import (
    check_allocator,
    check_device,
    minimise_find,
    print_json,
    print_steps,
    replay_line,
    say,
    supervisor_for,
)
from kvprop.search import FUZZ_SECONDS
from kvprop.search.signature import read_triaged, signature_of

NO_TIME_LIMIT = 1e9  # seconds (some 30 years): a run budget alone is never cut short by the clock
# --json's verdict for each exit of a search; exit 2 is a search that ran too little to call clean
VERDICTS = {EXIT_CLEAN: "clean", EXIT_FOUND: "found", EXIT_USAGE: "untested", EXIT_INTERRUPTED: "interrupted"}


def time_budget(args) -> float | None:
    """``--seconds``; without it, none when ``--max-runs`` gives a run budget (the run count
    asked for is the run count made, however slow the machine), else ``FUZZ_SECONDS``."""
    given = getattr(args, "seconds", None)
    if given is not None:
        return given
    return None if args.max_runs is not None else FUZZ_SECONDS


def _budget(args) -> str:
    """The budgets, as the header and the summary name them: "100 runs", "60s", "100 runs or 60s"."""
    runs = f"{args.max_runs:,} runs" if args.max_runs is not None else None
    clock = f"{args.seconds:g}s" if args.seconds is not None else None
    return " or ".join(budget for budget in (runs, clock) if budget)


def cmd_fuzz(args) -> int:
    from kvprop.repro import counterexample
    from kvprop.search import fuzz

    if getattr(args, "seed", None) is None:
        args.seed = time.time_ns() % 1_000_000_007
    args.seconds = time_budget(args)
    check_device(args.device)
    check_allocator(args.variant, args.target)
    _without_guards(args.no_guards, args.target)
    triaged = read_triaged(Path(args.triaged)) if args.triaged else frozenset()
    if (args.known or triaged) and args.driver != "walk":
        raise ConfigError(
            f"--known and --triaged keep searching past a find, which only the walk driver does, not {args.driver!r}"
        )
    out = counterexample.check_out(Path(args.out))
    args.logs = {}  # a find's trace -> where the target's output in its run is kept
    on_ray = args.ray is not None
    if on_ray:
        from kvprop.front import ray_fuzz

        ray_fuzz.check_args(args)  # the target is probed on every node of the cluster instead
    else:
        with supervisor_for(args, args.variant, args.target) as supervisor:
            dead = supervisor.probe()
        if dead is not None:  # the target died or hung while being built: a find before any search, on disk at once
            path = counterexample.write_found(dead, out, counterexample.name_for(dead))
            say(args, f"found {dead.failure.kind} while building the target; saved {path}")
            took = time.monotonic() - args.started
            return _report_find(args, fuzz.FuzzResult(dead, 0, 0, took, frozenset(), took), out, _summary(args, None))
        if args.canary:
            _canary(args)
    opts = fuzz.FuzzOptions(
        seconds=NO_TIME_LIMIT if args.seconds is None else args.seconds,
        workers=args.workers,
        seed=args.seed,
        driver=args.driver,
        variant=args.variant,
        target=args.target,
        device=args.device,
        max_ops=args.max_ops,
        max_runs=args.max_runs,
        redis=args.redis,
        fresh=args.fresh,
        known=args.known,
        triaged=triaged,
        call_timeout=args.call_timeout,
        max_memory=args.max_memory,
        build_timeout=args.build_timeout,
    )
    saved: dict = {}

    def on_find(trace, log=None):
        name = counterexample.name_for(trace)
        saved[name] = counterexample.write_found(trace, out, name)
        known = " (triaged: the search goes on)" if fuzz.is_known(opts, trace) else ""
        say(args, f"found {trace.failure.kind} (seed {trace.seed}); saved {saved[name]}{known}")
        if log is not None:
            args.logs[trace] = counterexample.keep_log(Path(log), out, name)
            say(args, f"  the target's output in that run: {args.logs[trace]}")

    if on_ray:
        return _on_ray(args, opts, out, on_find, saved)
    label = f"variant {args.variant}" if args.variant else f"target {args.target or 'kvprop'}"
    workers = f"{args.workers} worker{'s' if args.workers != 1 else ''}"
    unguarded = ", without the allocator's own guards" if args.no_guards else ""
    say(
        args,
        f"kvprop {__version__} fuzz: driver {args.driver}, {label}, {workers}, "
        f"budget {_budget(args)}, seed {args.seed}{unguarded}",
    )
    try:
        result = fuzz.search(opts, status=lambda line: say(args, line), on_find=on_find, started=args.started)
    except fuzz.Unusable as e:
        raise ConfigError(f"nothing could be tested: {e}") from None
    summary = _summary(args, result)
    if result.interrupted:
        return _interrupted(args, result, summary, saved)
    if result.found is None:
        return _clean(args, result, summary)
    return _report_find(args, result, out, summary)


def _interrupted(args, result, summary, saved: dict) -> int:
    say(args, f"\ninterrupted: {result.runs:,} runs, {result.steps:,} steps in {result.seconds:.1f}s, seed {args.seed}")
    for path in saved.values():
        say(args, f"  a find is saved in {path}")
    _emit_json(args, summary, EXIT_INTERRUPTED, error="interrupted", saved=[str(p) for p in saved.values()])
    return EXIT_INTERRUPTED


def _on_ray(args, opts, out, on_find, saved: dict) -> int:
    """The campaign as Ray tasks (``kvprop.front.ray_fuzz``), reported as the process pool's is;
    the find is minimised and its steps replayed on the cluster."""
    from kvprop.front import ray_fuzz
    from kvprop.repro import counterexample

    with ray_fuzz.session(args, opts) as slots:
        result = ray_fuzz.campaign(args, opts, slots, on_find)
        summary = _summary(args, result)
        summary["ray"] = {"cpus": slots, "runs_per_node": result.nodes, "requeued_batches": result.requeued}
        if result.interrupted:
            return _interrupted(args, result, summary, saved)
        if result.found is None:
            return _clean(args, result, summary)
        found = result.found
        say(args, f"\nminimising {len(found.steps)} operations on the cluster (Ctrl-C keeps the trace as found) ...")
        best, interrupted = ray_fuzz.minimise_on_cluster(args, found)
        name = counterexample.name_for(found)
        return _write_find(args, result, out, summary, name, best, interrupted, ray_fuzz.ClusterReplays(args))


def _without_guards(no_guards: bool, target: str | None) -> None:
    """With ``--no-guards``, kvprop's allocator runs without its own guards in this process and
    in every worker forked from it, and every trace the search makes records it
    (``Trace.guards``). Only kvprop's own allocator has them: another target is refused."""
    if not no_guards:
        return
    if target not in (None, "kvprop"):
        raise ConfigError(
            f"--no-guards runs kvprop's own allocator without its guards; --target {target!r} has none "
            f"of them (use it with --target kvprop)"
        )
    from kvprop.allocator import guards

    guards.ENABLED = False


def _summary(args, result) -> dict:
    from kvprop.search.fuzz import FuzzResult
    from kvprop.targets.protocol import reachable_events

    result = result or FuzzResult(None, 0, 0, 0.0, frozenset())
    return {
        "runs": result.runs,
        "steps": result.steps,
        "seconds": round(result.seconds, 3),
        "refused_configurations": result.runs - result.executed_runs,
        "refused_reasons": result.refused,
        "pipeline_depths": {str(d): n for d, n in sorted(result.depths.items())},
        "events": {name: name in result.events for name in reachable_events(args.target)},
        "seed": args.seed,
        "driver": args.driver,
        "target": args.target or "kvprop",
        "variant": args.variant,
        "guards": not args.no_guards,
        "known_finds": result.known,
        "budget": {"runs": args.max_runs, "seconds": args.seconds},
        "stopped": _stopped(args, result),
        "find": None,
    }


def _stopped(args, result) -> str:
    """Why the search ended: "interrupted", "find", "runs" (its run budget was spent) or "time"
    (its time budget ended first; with a run budget too, before all its runs)."""
    if result.interrupted:
        return "interrupted"
    if result.found is not None:
        return "find"
    if args.max_runs is None:
        return "time"
    asked = args.max_runs * (args.workers if args.driver == "hypothesis" else 1)  # examples: per worker
    return "runs" if result.runs >= asked or args.seconds is None else "time"


def _emit_json(args, summary, code: int, **extra) -> None:
    """The summary with the exit code and its verdict (``--json``)."""
    if args.json:
        print_json(args, {**summary, **extra, "exit": code, "verdict": VERDICTS[code]})


def _untested(args, summary, why: str) -> int:
    """A search that ran too little to call clean: unusable (exit 2), and why."""
    say(args, f"NOT CLEAN: {why}")
    _emit_json(args, summary, EXIT_USAGE, error=why)
    return EXIT_USAGE


def _clean(args, result, summary) -> int:
    from kvprop.search.fuzz import MIN_EXECUTED
    from kvprop.targets.protocol import reachable_events

    refused = result.runs - result.executed_runs
    if refused:
        reason, count = max(result.refused.items(), key=lambda kv: kv[1])
        say(args, f"the target refused {refused:,} of {result.runs:,} configurations; most often ({count:,}): {reason}")
    if result.runs == 0:
        why = f"the budget ({_budget(args)}) ended before any run completed; nothing was tested"
        return _untested(args, summary, why)
    if result.steps == 0 or result.executed_runs < MIN_EXECUTED * result.runs:
        return _untested(
            args,
            summary,
            f"{result.steps:,} steps ran and the target built {result.executed_runs:,} of {result.runs:,} "
            f"sampled configurations (at least {MIN_EXECUTED:.0%} must run); nothing was tested enough",
        )
    events = reachable_events(args.target)
    missing = [e for e in events if e not in result.events]
    known = ""
    if result.known:
        counts = ", ".join(f"{key} {n:,}" for key, n in sorted(result.known.items()))
        traces = sum(result.known.values())
        distinct = f"{len(result.known)} distinct triaged findings ({traces:,} traces: {counts}"
        known = f" but for {distinct}; saved under {args.out})"
    say(
        args,
        f"clean{known}: {result.runs:,} runs, {result.steps:,} steps in {result.seconds:.1f}s, "
        f"{_why_stopped(args, summary['stopped'])}; events reached {len(events) - len(missing)}/{len(events)}",
    )
    if missing:
        say(args, "  not reached: " + "; ".join(missing))
    _emit_json(args, summary, EXIT_CLEAN)
    return EXIT_CLEAN


def _why_stopped(args, stopped: str) -> str:
    """The end of a clean search in words; a time budget that ended before the run budget is
    said outright, since fewer runs were made than asked for."""
    if stopped == "runs":
        return f"all {args.max_runs:,} runs of the budget"
    if args.max_runs is not None:
        return f"stopped by the {args.seconds:g}s time budget before the {args.max_runs:,}-run budget"
    return f"stopped by the {args.seconds:g}s time budget"


def _report_find(args, result, out, summary) -> int:
    from kvprop.repro import counterexample

    found = result.found
    name = counterexample.name_for(found)
    best, interrupted = found, False
    with supervisor_for(args, args.variant, args.target) as supervisor:
        if not result.shared:
            say(args, f"\nminimising {len(found.steps)} operations (Ctrl-C keeps the smallest so far) ...")
            try:
                best, interrupted = minimise_find(args, found, supervisor)
            except ValueError:  # its first replay, in a fresh process, passed
                say(args, NOT_AGAIN)
        return _write_find(args, result, out, summary, name, best, interrupted, supervisor)


NOT_AGAIN = (
    "  the find did not fail again when replayed in a fresh process, so it is not minimised: the target is "
    "not deterministic, or its failure depends on what earlier examples left in the worker (the hypothesis "
    "driver runs them in one process); the trace as found is kept"
)


def _write_find(args, result, out, summary, name, best, interrupted, supervisor) -> int:
    from kvprop.repro import counterexample

    found = result.found
    if result.shared:
        say(args, f"\nFOUND {best.failure.kind} by another machine (shared store); {len(best.steps)} operations:")
    else:
        verdict = "minimising interrupted at" if interrupted else "minimised to"
        say(
            args,
            f"\nFOUND {best.failure.kind} after {result.seconds_to_find:.1f}s ({args.driver} seed "
            f"{found.seed}); {len(found.steps)} operations {verdict} {len(best.steps)}:",
        )
    trace_path, test_path = counterexample.write(best, out, name)  # on disk before it runs again
    if interrupted:  # asked to stop: the smallest trace so far is kept, nothing more runs
        say(args, "  (interrupted: its steps are shown by the replay below)")
    else:
        print_steps(best, supervisor, out=lambda s: say(args, s))
    say(args, f"\nwrote {trace_path}\nwrote {test_path}\nreplay: {replay_line(trace_path, best)}")
    signature = signature_of(best)
    say(args, f"signature: {signature.key} ({', '.join(signature.features)})")
    if not result.deterministic:
        say(args, "note: with several hypothesis workers, which find is reported depends on timing")
    summary["find"] = {
        "kind": best.failure.kind,
        "origin": best.failure.origin,
        "message": best.failure.message,
        "seed": found.seed,
        "operations_found": len(found.steps),
        "operations_minimised": len(best.steps),
        "trace": str(trace_path),
        "test": str(test_path),
        "log": str(args.logs[found]) if found in args.logs else None,
        "signature": signature.to_dict(),
    }
    if interrupted:  # Ctrl-C or SIGTERM while minimising: the find is kept, and the exit says it was asked to stop
        summary["stopped"] = "interrupted"
        _emit_json(args, summary, EXIT_INTERRUPTED, error="interrupted while minimising")
        return EXIT_INTERRUPTED
    _emit_json(args, summary, EXIT_FOUND)
    return EXIT_FOUND


def _canary(args) -> None:
    """The canary fault switched on in the target being fuzzed must be found within its budget:
    if it is not, the checks would miss a real bug too, and the run is refused (exit 2)."""
    from kvprop.search import fuzz

    say(args, f"canary: searching target {args.target or 'kvprop'} with the canary fault switched on ...")
    opts = fuzz.FuzzOptions(
        seconds=args.canary_seconds,
        workers=args.workers,
        seed=args.seed,
        driver="walk",
        variant=args.variant,
        target=args.target,
        device=args.device,
        canary=True,
        call_timeout=args.call_timeout,
        max_memory=args.max_memory,
        build_timeout=args.build_timeout,
    )
    result = fuzz.search(opts)
    if result.found is None:
        raise ConfigError(
            f"canary FAILED: the fault was not found in {args.canary_seconds:g}s ({result.steps:,} steps); "
            f"refusing to fuzz (the checks would not find a real bug either)"
        )
    seconds = result.seconds_to_find or 0.0
    say(args, f"canary ok: found {result.found.failure.kind if result.found.failure else '?'} in {seconds:.2f}s")


def _chosen(only: str | None, variants) -> list[str]:
    """The variants ``--only`` names (comma-separated), in the registry's order; every one without it."""
    if only is None:
        return list(variants)
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in variants]
    if unknown or not names:
        raise ConfigError(f"--only: unknown variants {unknown or [only]}; the variants are {list(variants)}")
    return [n for n in variants if n in names]


def cmd_bugs(args) -> int:
    from kvprop.repro.minimise import minimise
    from kvprop.search import fuzz
    from kvprop.search.machine import trace_length
    from kvprop.targets.variants import VARIANTS

    check_device(args.device)
    _without_guards(args.no_guards, None)
    if not args.json:
        guarded = "without the allocator's own guards" if args.no_guards else "guards on"
        print(
            f"kvprop {__version__} bugs: every variant from scratch, driver {args.driver}, "
            f"{args.seconds_per_bug:g}s each, seed {args.seed}, {guarded}\n"
            f"{'variant':30s} {'result':9s} {'seconds':>9s} {'runs':>7s} {'steps':>9s}       {'minimised':>4s}",
            flush=True,
        )
    rows = []
    for name in _chosen(args.only, VARIANTS):
        interrupt.check()
        opts = fuzz.FuzzOptions(
            seconds=args.seconds_per_bug,
            workers=args.workers,
            seed=args.seed,
            driver=args.driver,
            variant=name,
            device=args.device,
        )
        result = fuzz.search(opts)
        if result.interrupted:
            raise KeyboardInterrupt
        best = minimise(result.found, variant=name, device=args.device) if result.found else None
        rows.append(
            {
                "variant": name,
                "driver": args.driver,
                "found": result.found is not None,
                "kind": best.failure.kind if best and best.failure else None,
                "seconds": round(result.seconds_to_find or 0.0, 3) if result.found else None,
                "runs": result.runs if result.found else None,
                "steps": result.steps if result.found else None,
                "minimised_steps": trace_length(best) if best else None,
            }
        )
        if not args.json:
            r = rows[-1]
            print(
                f"{name:30s} {'found' if r['found'] else 'NOT FOUND':9s} "
                f"{(str(r['seconds']) + 's') if r['found'] else '-':>9s} {str(r['runs'] or '-'):>7s} "
                f"{str(r['steps'] or '-'):>9s} steps "
                f"{str(r['minimised_steps'] or '-'):>4s} ({r['kind'] or '-'})",
                flush=True,
            )
    if args.json:
        print_json(args, rows)
    return EXIT_CLEAN if all(r["found"] for r in rows) else EXIT_FOUND
