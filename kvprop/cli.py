"""The ``kvprop`` command: fuzz | replay | shrink | emit-test | bugs | variants | bench."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

from kvprop import __version__
from kvprop.errors import ConfigError, KvpropError

EXIT_FOUND, EXIT_BAD_INPUT = 1, 2


def _print_steps(trace, variant, target, device) -> object:
    from kvprop.search.execute import execute

    def show(i, op, outcome):
        print(f"  {i:3d}: {op!r}\n       -> {outcome}")

    print(f"config: {trace.config!r}")
    failure = execute(trace, variant=variant, target=target, device=device, on_step=show)
    if failure is not None:
        where = (
            "the final drain"
            if failure.step >= len(trace.steps)
            else f"step {failure.step}: {trace.steps[failure.step]!r}"
        )
        print(f"  FAILED at {where}\n  {failure.message}")
    return failure


def cmd_fuzz(args) -> int:
    from kvprop.search import fuzz
    from kvprop.targets.variants import get_variant

    get_variant(args.variant)
    if args.target not in (None, "kvprop"):
        from kvprop.targets import load_factory

        load_factory(args.target)  # a bad target is a clear error here, not a crash in every worker
    if args.seconds <= 0 or args.workers < 1:
        raise ConfigError(f"--seconds must be > 0 and --workers >= 1, got {args.seconds} and {args.workers}")
    if args.canary and not _canary(args):
        return EXIT_FOUND + 2
    opts = fuzz.FuzzOptions(
        seconds=args.seconds,
        workers=args.workers,
        seed=args.seed,
        driver=args.driver,
        variant=args.variant,
        target=args.target,
        device=args.device,
        out=Path(args.out),
        max_ops=args.max_ops,
        max_runs=args.max_runs,
        redis=args.redis,
    )
    label = f"variant {args.variant}" if args.variant else f"target {args.target or 'kvprop'}"
    print(
        f"kvprop {__version__} fuzz: driver {args.driver}, {label}, {args.workers} workers, "
        f"{args.seconds:g}s budget, seed {args.seed}",
        flush=True,
    )
    result = fuzz.search(opts, status=lambda line: print(line, flush=True))
    if result.found is None:
        print(
            f"clean: {result.runs:,} runs, {result.steps:,} steps in {result.seconds:.1f}s, "
            f"events reached: {len(result.events)}"
        )
        return 0
    best = result.found
    if not result.shared:
        from kvprop.repro.minimise import minimise

        best = minimise(result.found, variant=args.variant, target=args.target, device=args.device)
    if result.shared:
        print(f"\nFOUND {best.failure.kind} by another machine (shared store); {len(best.steps)} operations:")
    else:
        print(
            f"\nFOUND {best.failure.kind} after {result.seconds_to_find:.1f}s ({args.driver} seed "
            f"{result.found.seed}); {len(result.found.steps)} operations minimised to {len(best.steps)}:"
        )
    _print_steps(best, args.variant, args.target, args.device)
    from kvprop.repro import counterexample

    trace_path, test_path = counterexample.write(best, Path(args.out))
    print(f"\nwrote {trace_path}\nwrote {test_path}\nreplay: kvprop replay {trace_path}")
    return EXIT_FOUND


def _canary(args) -> bool:
    from kvprop.search import fuzz

    print("canary: searching for the known bug 'interleaved-external-alloc' first ...", flush=True)
    opts = fuzz.FuzzOptions(
        seconds=args.canary_seconds,
        workers=args.workers,
        seed=args.seed,
        driver="walk",
        variant="interleaved-external-alloc",
        device=args.device,
    )
    result = fuzz.search(opts)
    if result.found is None:
        print(
            f"canary FAILED: the known bug was not found in {args.canary_seconds:g}s; refusing to fuzz "
            f"(the harness would not find a real one either)"
        )
        return False
    print(f"canary ok: found {result.found.failure.kind} in {result.seconds_to_find:.2f}s", flush=True)
    return True


def cmd_replay(args) -> int:
    from kvprop.search import trace as tr

    trace = tr.load(args.file)
    variant = args.variant if args.variant is not None else trace.variant
    target = args.target if args.target is not None else trace.target
    print(
        f"replaying {args.file} ({len(trace.steps)} operations) on variant {variant or 'correct'}, "
        f"target {target or 'kvprop'}"
    )
    failure = _print_steps(trace, variant, target, args.device)
    if failure is None:
        print("PASSED: the trace no longer fails")
        return 0
    recorded = trace.failure.kind if trace.failure else None
    same = "the recorded violation" if recorded == failure.kind else f"recorded: {recorded}"
    print(f"REPRODUCED {failure.kind} ({same})")
    return EXIT_FOUND


def cmd_shrink(args) -> int:
    import attrs

    from kvprop.repro.minimise import minimise
    from kvprop.search import trace as tr

    trace = tr.load(args.file)
    variant = args.variant if args.variant is not None else trace.variant
    target = args.target if args.target is not None else trace.target
    try:
        best = minimise(trace, variant=variant, target=target, device=args.device)
    except ValueError as e:
        print(f"cannot shrink: {e}")
        return 0
    best = attrs.evolve(best, variant=variant, target=target)
    out = Path(args.out or args.file)
    tr.save(best, out)
    print(f"{len(trace.steps)} operations -> {len(best.steps)}; wrote {out}")
    _print_steps(best, variant, target, args.device)
    return EXIT_FOUND


def cmd_emit_test(args) -> int:
    from kvprop.repro import regress
    from kvprop.search import trace as tr

    trace = tr.load(args.file)
    source = regress.render(trace, source=Path(args.file).name)
    out = Path(args.out) if args.out else Path(args.file).with_name(f"test_{regress.test_name(trace)}.py")
    out.write_text(source)
    print(f"wrote {out}")
    return 0


def cmd_bugs(args) -> int:
    from kvprop.repro.minimise import minimise
    from kvprop.search import fuzz
    from kvprop.search.machine import trace_length
    from kvprop.targets.variants import VARIANTS

    rows = []
    for name in VARIANTS:
        opts = fuzz.FuzzOptions(
            seconds=args.seconds_per_bug,
            workers=args.workers,
            seed=args.seed,
            driver=args.driver,
            variant=name,
            device=args.device,
        )
        result = fuzz.search(opts)
        best = minimise(result.found, variant=name, device=args.device) if result.found else None
        rows.append(
            {
                "variant": name,
                "driver": args.driver,
                "found": result.found is not None,
                "seconds": round(result.seconds_to_find, 3) if result.found else None,
                "steps": result.steps if result.found else None,
                "shrunk_steps": trace_length(best) if best else None,
            }
        )
        if not args.json:
            r = rows[-1]
            print(
                f"{name:30s} {'found' if r['found'] else 'NOT FOUND':9s} "
                f"{(str(r['seconds']) + 's') if r['found'] else '-':>9s} {str(r['steps'] or '-'):>9s} steps "
                f"{str(r['shrunk_steps'] or '-'):>4s} minimised",
                flush=True,
            )
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0 if all(r["found"] for r in rows) else EXIT_FOUND


def cmd_variants(args) -> int:
    from kvprop.targets.variants import VARIANTS

    for v in VARIANTS.values():
        print(f"{v.name:30s} {v.bug}")
    return 0


def cmd_bench(args) -> int:
    from kvprop import bench

    return bench.main(quick=args.quick, as_json=args.json)


def build_parser() -> argparse.ArgumentParser:
    from kvprop.search.fuzz import DRIVERS, default_workers

    p = argparse.ArgumentParser(
        prog="kvprop", description="Stateful property-based testing of paged, prefix-caching KV-cache allocators."
    )
    p.add_argument("--version", action="version", version=f"kvprop {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def target_args(sp, variant_help="bug variant of kvprop's allocator (see `kvprop variants`)"):
        sp.add_argument("--variant", default=None, help=variant_help)
        sp.add_argument("--target", default=None, help="'kvprop' (default), 'vllm', or package.module:factory")
        sp.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when present)")

    f = sub.add_parser("fuzz", help="search for a violation until the budget ends")
    f.add_argument("--seconds", type=float, default=60.0)
    f.add_argument("--workers", type=int, default=default_workers())
    f.add_argument("--seed", type=int, default=int(time.time()) % 1_000_000)
    f.add_argument(
        "--driver",
        default="walk",
        choices=DRIVERS,
        help="the search driver: walk (fast seeded walker, default) or hypothesis (the state machine)",
    )
    f.add_argument("--out", default="counterexamples")
    f.add_argument("--max-ops", type=int, default=200, help="operations per walk run")
    f.add_argument(
        "--max-runs",
        type=int,
        default=None,
        help="stop each worker after this many runs/examples (a deterministic budget, for CI)",
    )
    f.add_argument("--canary", action="store_true", help="first prove the harness finds a known bug")
    f.add_argument(
        "--redis",
        default=None,
        metavar="URL",
        help="share failures with other machines through Redis (needs the redis extra)",
    )
    f.add_argument("--canary-seconds", type=float, default=30.0)
    target_args(f)
    f.set_defaults(func=cmd_fuzz)

    r = sub.add_parser("replay", help="re-execute a trace step by step (exit 1: reproduces, 0: passes, 2: bad file)")
    r.add_argument("file")
    target_args(r, "replay on this variant instead of the recorded one ('correct' for the fixed allocator)")
    r.set_defaults(func=cmd_replay)

    s = sub.add_parser("shrink", help="minimise an existing trace")
    s.add_argument("file")
    s.add_argument("--out", default=None, help="where to write (default: overwrite FILE)")
    target_args(s)
    s.set_defaults(func=cmd_shrink)

    e = sub.add_parser("emit-test", help="write the standalone pytest regression test for a trace")
    e.add_argument("file")
    e.add_argument("--out", default=None)
    e.set_defaults(func=cmd_emit_test)

    b = sub.add_parser("bugs", help="fuzz every bug variant from scratch and tabulate")
    b.add_argument("--seconds-per-bug", type=float, default=30.0)
    b.add_argument("--driver", default="walk", choices=DRIVERS, help="the search driver (default: walk)")
    b.add_argument("--workers", type=int, default=1)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--device", default=None)
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_bugs)

    v = sub.add_parser("variants", help="list the bug variants")
    v.set_defaults(func=cmd_variants)

    bench = sub.add_parser("bench", help="throughput, scaling and time-to-find tables")
    bench.add_argument("--json", action="store_true")
    bench.add_argument("--quick", action="store_true")
    bench.set_defaults(func=cmd_bench)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        return args.func(args)
    except KvpropError as e:
        print(f"kvprop {args.command}: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
