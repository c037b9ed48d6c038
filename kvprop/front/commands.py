"""What each ``kvprop`` command but the search does (``fuzz_command`` runs ``fuzz`` and ``bugs``),
and the helpers they share; ``kvprop.front.cli`` parses and maps outcomes to exit codes."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

import attrs

from kvprop import __version__
from kvprop.errors import ConfigError
from kvprop.exits import EXIT_CLEAN, EXIT_FOUND, EXIT_INTERRUPTED
from kvprop.front.output_paths import unwritable_is_usage, writable_file, writable_folder

PROGRESS_EVERY = 1.0


def say(args, text: str = "") -> None:
    """Human output: stdout, or stderr when stdout carries --json."""
    print(text, file=sys.stderr if getattr(args, "json", False) else sys.stdout, flush=True)


def print_json(args, value) -> None:
    """The one JSON document of a ``--json`` run, on stdout; ``kvprop.front.cli.main`` prints
    one of its own (the exit code and the error) for a run that ends without it."""
    print(json.dumps(value, indent=1), flush=True)
    args.printed_json = True


def broken_rule(kind: str) -> str | None:
    """The sentence a violation kind breaks (``kvprop.check.kinds``), shown under its message."""
    from kvprop.check.kinds import INVARIANTS, KINDS

    found = KINDS.get(kind)
    return (
        None
        if found is None
        else f"{found.sentence} (invariant {found.invariant}: {INVARIANTS[found.invariant].statement})"
    )


BUILDING = "while building the target"  # how a death's judgement places one before any operation


def print_steps(trace, supervisor, out=print, log_to: Path | None = None):
    """Replay ``trace`` in ``supervisor``'s worker, printing each step; the failure, if any.
    If the target's process died, what it printed is kept at ``log_to``."""
    out(f"config: {trace.config!r}")
    executed = supervisor.execute(trace, lines=True)
    for i, op, outcome in executed.lines:
        out(f"  {i:3d}: {op}\n       -> {outcome}")
    failure = executed.failure
    if failure is not None:
        where = (
            f"step {failure.step}: {trace.steps[failure.step]!r}"
            if failure.step < len(trace.steps)
            else "building the target"
            if failure.origin != "violation" and BUILDING in failure.message
            else "the final drain"
        )
        out(f"  FAILED at {where} ({ORIGINS[failure.origin]})\n  {failure.message}")
        rule = broken_rule(failure.kind)
        if rule:
            out(f"  the rule: {rule}")
        if executed.log is not None and log_to is not None:
            try:
                shutil.copyfile(executed.log, log_to)
                out(f"  the target's output: {log_to}")
            except OSError as e:
                out(f"  the target's output could not be kept at {log_to}: {e.strerror}")
    return failure


ORIGINS = {
    "violation": "an invariant failed",
    "target-crash": "the target crashed",
    "target-hang": "the target hung",
    "target-oom": "the target's memory grew past the bound",
}


def supervisor_for(args, variant, target, fresh: bool = False):
    from kvprop.search.supervisor import Supervisor

    return Supervisor(
        target,
        variant,
        args.device,
        args.call_timeout,
        fresh=fresh,
        max_memory=args.max_memory,
        build_timeout=args.build_timeout,
    )


def check_device(device) -> None:
    if device is not None:
        from kvprop.sim.memory import pick_device

        pick_device(device)


def check_allocator(variant, target) -> None:
    """The variant exists, and applies to the kvprop target only; the target is named as one is.
    Nothing is imported: the target is loaded only in a supervised worker."""
    from kvprop.targets import check_name
    from kvprop.targets.variants import get_variant

    get_variant(variant)
    check_name(target)
    if target not in (None, "kvprop") and variant not in (None, "correct"):
        raise ConfigError(f"--variant {variant!r} applies to the kvprop target only, not to --target {target!r}")


MINIMISE_HANG_SECONDS = 120.0  # minimising a hang without a time budget: each hanging candidate costs the timeout


def hang_bound(args, found) -> float | None:
    """Seconds minimising ``found`` may take: a hang's candidates that still hang each cost the
    call timeout, so minimising one is bounded by the command's time budget (``--seconds``) or
    ``MINIMISE_HANG_SECONDS``; any other find is minimised until no pass applies."""
    if found.failure is None or found.failure.kind != "target-hang":
        return None
    budget = vars(args).get("seconds")
    return budget if budget is not None else MINIMISE_HANG_SECONDS


def minimise_find(args, found, supervisor):
    """Minimise with a progress line, each candidate in ``supervisor``'s worker; Ctrl-C keeps
    the best so far. Returns (trace, interrupted)."""
    from kvprop.repro.minimise import minimiser_for

    last = [time.monotonic()]
    bound = hang_bound(args, found)
    if bound is not None:
        say(
            args,
            f"  minimising a hang: each candidate that still hangs takes the call timeout "
            f"({supervisor.call_timeout:g}s); at most {bound:g}s, then the smallest so far is kept",
        )

    def progress(best, replays):
        if time.monotonic() - last[0] >= PROGRESS_EVERY:
            last[0] = time.monotonic()
            say(args, f"  minimising: {len(best.steps)} operations ({replays} replays)")

    minimiser = None
    try:
        minimiser = minimiser_for(
            found,
            variant=supervisor.variant,
            target=supervisor.target,
            device=args.device,
            progress=progress,
            executor=lambda trace: supervisor.execute(trace).failure,
            deadline=None if bound is None else time.monotonic() + bound,
        )
        best = minimiser.run()
        if minimiser.out_of_time:
            say(args, f"  minimising stopped at its {bound:g}s bound: the smallest trace so far is kept")
        return best, False
    except KeyboardInterrupt:
        return (minimiser.best if minimiser is not None else found), True


# ---- fuzz ---------------------------------------------------------------------------------


def _check_out(args) -> None:
    """``--out`` can take a find before anything runs (kvprop.repro.counterexample.check_out)."""
    from kvprop.repro import counterexample

    counterexample.check_out(Path(args.out))


def died_find(args, died, command: str) -> int:
    """The target died or hung while ``command`` ran it: a find, saved under ``--out`` with what
    the target printed, and exit 1."""
    from kvprop.repro import counterexample

    out = counterexample.check_out(Path(args.out))
    trace = died.trace
    name = counterexample.name_for(trace)
    path = counterexample.write_found(trace, out, name)
    print(f"FOUND {trace.failure.kind} while {command} ran the target: {trace.failure.message}", file=sys.stderr)
    print(f"saved {path}\nreplay: {replay_line(path, trace)}", file=sys.stderr)
    log = counterexample.keep_log(died.log, out, name) if died.log is not None else None
    if log is not None:
        print(f"the target's output in that run: {log}", file=sys.stderr)
    if getattr(args, "json", False):
        kind, message = trace.failure.kind, trace.failure.message
        find = {"kind": kind, "message": message, "trace": str(path), "log": None if log is None else str(log)}
        print_json(args, {"exit": EXIT_FOUND, "verdict": "found", "find": find})
    return EXIT_FOUND


def replay_line(path, trace) -> str:
    """The command that replays ``path``, shell-quoted; a target outside kvprop is named, since
    a trace never chooses code itself."""
    from kvprop.targets import is_builtin

    target = "" if is_builtin(trace.target) else f" --target {shlex.quote(trace.target)}"
    return f"kvprop replay {shlex.quote(str(path))}{target}"


# ---- the other commands --------------------------------------------------------------------


def _trusted_target(trace, args, command: str):
    """The target to run a trace on. A trace is data and never chooses code: the target it names
    runs only if it is one of kvprop's own or ``--target`` names the same one."""
    from kvprop.targets import check_name, is_builtin

    if args.target is not None:
        check_name(args.target)
        return args.target
    if trace.target is None or is_builtin(trace.target):
        return trace.target
    raise ConfigError(
        f"{args.file} names target {trace.target!r}, code outside kvprop; a trace never chooses code to run. "
        f"To run it, name it yourself: kvprop {command} {shlex.quote(str(args.file))} "
        f"--target {shlex.quote(trace.target)}"
    )


def _load(args, command: str):
    from kvprop.search import trace as tr

    trace = tr.load(args.file)
    variant = args.variant if args.variant is not None else trace.variant
    target = _trusted_target(trace, args, command)
    check_device(args.device)
    check_allocator(variant, target)
    return trace, variant, target


def cmd_replay(args) -> int:
    trace, variant, target = _load(args, "replay")
    print(
        f"replaying {args.file} ({len(trace.steps)} operations) on variant {variant or 'correct'}, "
        f"target {target or 'kvprop'}{'' if trace.guards else ', without the allocator' + chr(39) + 's own guards'}"
    )
    with supervisor_for(args, variant, target) as supervisor:
        failure = print_steps(trace, supervisor, log_to=Path(args.file).with_suffix(".replay.log"))
    if failure is None:
        print("PASSED: the trace no longer fails")
        return EXIT_CLEAN
    recorded = trace.failure.kind if trace.failure else None
    same = "the recorded violation" if recorded == failure.kind else f"recorded: {recorded}"
    print(f"REPRODUCED {failure.kind} ({same})")
    return EXIT_FOUND


def cmd_minimise(args) -> int:

    trace, variant, target = _load(args, "minimise")
    out = writable_file(args.out or args.file, "--out" if args.out else "the trace")
    print(f"minimising {args.file} ({len(trace.steps)} operations; Ctrl-C keeps the smallest so far) ...", flush=True)
    with supervisor_for(args, variant, target) as supervisor:
        try:
            best, interrupted = minimise_find(args, trace, supervisor)
        except ValueError as e:
            print(f"cannot minimise: {e}")
            return EXIT_CLEAN
        best = attrs.evolve(best, variant=variant, target=target)
        out = _save_or_fall_back(best, out)
        stopped = " (interrupted: the smallest so far)" if interrupted else ""
        print(f"{len(trace.steps)} operations -> {len(best.steps)}{stopped}; wrote {out}")
        if interrupted:  # asked to stop: the smallest trace so far is kept, nothing more runs
            return EXIT_INTERRUPTED
        print_steps(best, supervisor)
    return EXIT_FOUND


def _save_or_fall_back(trace, out: Path) -> Path:
    """``trace`` written at ``out``; if that fails, at a new file in the temporary directory,
    said on stderr: a minimised trace is never lost to a path that went bad during the run."""

    from kvprop.search import trace as tr

    try:
        tr.save(trace, out)
        return out
    except OSError as e:
        fd, fallback = tempfile.mkstemp(prefix="kvprop-minimised-", suffix=".json")
        os.close(fd)
        tr.save(trace, Path(fallback))
        print(f"could not write {out} ({e.strerror}); the trace is at {fallback}", file=sys.stderr)
        return Path(fallback)


def cmd_emit_test(args) -> int:

    from kvprop.repro import regress
    from kvprop.search import trace as tr

    trace = tr.load(args.file)
    target = _trusted_target(trace, args, "emit-test")
    if target != trace.target:
        trace = attrs.evolve(trace, target=target)
    source = regress.render(trace, source=Path(args.file).name)
    option = "--out" if args.out else "the test beside the trace"
    out = writable_file(args.out or Path(args.file).with_name(f"test_{regress.test_name(trace)}.py"), option)
    with unwritable_is_usage(out, option):
        out.write_text(source, encoding="utf-8")
    print(f"wrote {out}")
    return EXIT_CLEAN


def cmd_variants(args) -> int:
    from kvprop.targets.variants import CORRECT, VARIANTS

    for v in (CORRECT, *VARIANTS.values()):
        print(f"{v.name:30s} {v.bug}")
    return EXIT_CLEAN


def cmd_targets(args) -> int:
    """The registered targets with what each declares; nothing is imported, versions come from
    package metadata."""

    from kvprop.targets.protocol import REGISTRY, version

    rows = []
    for t in REGISTRY.values():
        if isinstance(t.shapes, str):  # the release installed says, where the target runs
            shapes, limits = None, [f"as the installed release builds them ({t.shapes})"]
        else:
            shapes, limits = attrs.asdict(t.shapes), t.shapes.limits()
            shapes = {name: sorted(v) if isinstance(v, frozenset) else v for name, v in shapes.items()}
        rows.append(
            {
                "name": t.name,
                "summary": t.summary,
                "factory": t.factory,
                "own_scheduler": t.own_scheduler,
                "package": t.package,
                "version": version(t),
                "capabilities": list(t.capabilities.declared()) if t.capabilities else None,
                "shapes": shapes,
                "limits": limits,
            }
        )
    if args.json:
        print_json(args, rows)
        return EXIT_CLEAN
    for r in rows:
        installed = f"{r['package']} {r['version'] or 'not installed'}"
        print(f"{r['name']:15s} {r['summary']} ({installed})")
        print(f"{'':15s} declares: {', '.join(r['capabilities']) or 'nothing beyond the required calls'}")
        print(f"{'':15s} draws: {'; '.join(r['limits']) or 'every shape'}")
    print("\npackage.module:factory  a user's allocator: its factory returns Built(allocator, view, capabilities);")
    print("package.module:TARGET   or a Target declaration (capabilities and shapes): docs/targets.md")
    return EXIT_CLEAN


def cmd_bench(args) -> int:
    from kvprop.front import bench
    from kvprop.search.supervisor import Died

    try:
        return _bench(bench, args)
    except Died as died:  # vLLM died or hung under measurement: a find like any other
        args.out = "counterexamples"
        return died_find(args, died, "bench")


def _bench(bench, args) -> int:
    if args.markdown is not None:
        writable_file(args.markdown, "--markdown", make_folder=False)
    result = bench.main(
        quick=args.quick,
        as_json=args.json,
        parts=args.parts or bench.DEFAULT_PARTS,
        baseline=args.baseline,
        markdown=args.markdown,
    )
    if args.json:
        print_json(args, result)
    return EXIT_CLEAN


def cmd_coverage(args) -> int:
    from kvprop.front import coverage
    from kvprop.search.supervisor import Died

    check_device(args.device)  # the target and variant are checked in the worker, before it measures
    _check_out(args)
    if args.html is not None:
        writable_folder(args.html, "--html")
    label = f"variant {args.variant}" if args.variant else f"target {args.target or 'kvprop'}"
    say(args, f"kvprop {__version__} coverage: {label}, walk driver, {args.seconds:g}s budget, seed {args.seed}")

    def progress(runs, steps, elapsed):
        say(args, f"  {elapsed:5.0f}s: {runs:,} walks, {steps:,} steps")

    options = {
        "target": args.target,
        "variant": args.variant,
        "seconds": args.seconds,
        "seed": args.seed,
        "max_ops": args.max_ops,
        "device": args.device,
        "html": args.html,
    }
    with supervisor_for(args, args.variant, args.target, fresh=True) as supervisor:  # the walks run in a new process
        try:
            report = supervisor.call(coverage.measure, options, progress=progress)
        except Died as died:
            return died_find(args, died, "coverage")
    if args.json:
        print_json(args, report.as_dict())
    else:
        print(coverage.render(report))
    return EXIT_CLEAN
