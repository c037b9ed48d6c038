"""The ``kvprop`` command: parsing, validation of every value, and exit codes that mean one thing.

Exit codes: 0 clean (steps ran and nothing failed), 1 a violation or target crash found or
reproduced, 2 unusable input or configuration (the message says what and what is allowed),
3 an error of kvprop itself (one line; ``--debug`` shows the traceback), 130 interrupted, 141
the reader of stdout went away (``kvprop ... | head -1``). With ``--json`` stdout carries one
JSON document whatever the exit: the command's own, or else the exit code and the error.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback

from kvprop import __version__, interrupt
from kvprop.errors import KvpropError
from kvprop.exits import (
    EXIT_CLEAN,
    EXIT_CLOSED_PIPE,
    EXIT_FOUND,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
)
from kvprop.front import choices  # the choices below, without the modules that run the commands
from kvprop.front.values import (  # the values of the command line
    cores,
    kinds,
    mebibytes,
    operations,
    positive_int,
    redis_url,
    seconds,
    seed,
    workers,
)
from kvprop.search import (  # imports nothing else: the CLI measures what it runs
    CALL_TIMEOUT,
    DRIVERS,
    FUZZ_SECONDS,
    MAX_MEMORY_MIB,
    MIN_CALL_TIMEOUT,
    RAY_BATCH,
)

# ---- the parser ---------------------------------------------------------------------------


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


class UsageError(Exception):
    """A command line argparse refuses, with the usage and message argparse would print."""


class _Parser(argparse.ArgumentParser):
    """Raises its errors instead of exiting, so that ``main`` reports them as it reports every
    other exit 2 (with ``--json``, as the JSON object too); its subcommands' parsers are of
    this class as well."""

    def error(self, message):
        raise UsageError(f"{self.format_usage()}{self.prog}: error: {message}\n")


# Where each command's function is, as "module:function": imported in ``main`` once the command
# line parsed, so that help, the version and argument errors import no command's module.
COMMANDS = "kvprop.front.commands"
FUZZ = "kvprop.front.fuzz_command"


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kvprop", description=__doc__.split("\n")[0], formatter_class=_Formatter)
    p.add_argument("--version", action="version", version=f"kvprop {__version__}")
    p.add_argument("--debug", action="store_true", help="show the traceback of an internal error")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name, func: str, help_text):
        sp = sub.add_parser(name, help=help_text, description=help_text, formatter_class=_Formatter)
        sp.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        sp.set_defaults(func=func)
        return sp

    def call_timeout_arg(sp, what: str = "the target", during: str = "") -> None:
        sp.add_argument(
            "--call-timeout",
            type=seconds,
            default=None,
            help=f"seconds {what} may take without progress{during} before it is a target-hang find "
            f"(default: {CALL_TIMEOUT:g}, or a quarter of --seconds where that is less, at least "
            f"{MIN_CALL_TIMEOUT:g}; importing and building the target keep {CALL_TIMEOUT:g})",
        )
        sp.add_argument(
            "--max-memory",
            type=mebibytes,
            default=MAX_MEMORY_MIB,
            metavar="MIB",
            help="resident memory (MiB) a worker running the target may hold before it is a target-oom find",
        )

    def envs_arg(sp) -> None:
        sp.add_argument(
            "--envs",
            default=".venv-vllm-",
            metavar="PREFIX",
            help="where each release's environment is, as a prefix of its folder (make vllm-env)",
        )

    def target_args(
        sp, variant_help="bug variant of kvprop's allocator (see `kvprop variants`); kvprop target only", more=""
    ):
        sp.add_argument("--variant", default=None, help=variant_help)
        sp.add_argument(
            "--target",
            default=None,
            help="'kvprop' (default), 'vllm' (vLLM's KVCacheManager), 'vllm-scheduler' (vLLM's Scheduler), "
            "'sglang' (SGLang's scheduler loop), or package.module:factory" + more,
        )
        sp.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when present, else cpu)")
        call_timeout_arg(sp, during=" (importing, building, one operation)")

    f = command("fuzz", f"{FUZZ}:cmd_fuzz", "search for a violation until the budget ends (exit 1 found, 0 clean)")
    f.add_argument(
        "--seconds",
        type=seconds,
        default=argparse.SUPPRESS,  # its default depends on --max-runs: kvprop.front.fuzz_command.time_budget
        help="time budget, counted from the command's start (default: 60, or none with a run budget); "
        "--max-runs alone ends after its runs, however long they take",
    )
    f.add_argument("--workers", type=workers, default=cores(), help="worker processes (the default is the cores)")
    f.add_argument(
        "--seed",
        type=seed,
        default=argparse.SUPPRESS,
        help="run seed; each walk's seed is a hash of it (from the clock when not given)",
    )
    f.add_argument(
        "--driver", default="walk", choices=DRIVERS, help="walk: fast seeded walker; hypothesis: state machine"
    )
    f.add_argument("--out", default="counterexamples", help="where traces and regression tests are written")
    f.add_argument("--max-ops", type=operations, default=200, help="operations per walk")
    f.add_argument(
        "--max-runs",
        type=positive_int,
        default=None,
        help="walk driver: the campaign's runs in all, the same runs on any number of workers; "
        "hypothesis driver: the examples each worker runs",
    )
    f.add_argument(
        "--canary", action="store_true", help="first prove the checks find a fault switched on in the target"
    )
    f.add_argument("--canary-seconds", type=seconds, default=30.0, help="budget of the canary search")
    f.add_argument(
        "--redis", type=redis_url, default=None, metavar="URL", help="share finds with other machines through Redis"
    )
    f.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="walk driver: run the campaign as Ray tasks on the cluster at ADDRESS (HOST:PORT, ray://HOST:PORT, "
        "auto), or on a Ray instance started here with --workers CPUs when no ADDRESS (pip install 'kvprop[ray]')",
    )
    f.add_argument(
        "--ray-batch",
        type=positive_int,
        default=RAY_BATCH,
        metavar="RUNS",
        help="--ray: runs per task (larger batches for larger clusters: docs/campaigns.md's cost model)",
    )
    f.add_argument("--fresh", action="store_true", help="hypothesis driver: ignore the example database (.hypothesis/)")
    f.add_argument("--json", action="store_true", help="print one JSON summary on stdout (progress goes to stderr)")
    f.add_argument(
        "--known",
        type=kinds,
        default=frozenset(),
        metavar="KIND[,KIND]",
        help="walk driver: finds of these already-triaged kinds are saved and counted, and the search goes on",
    )
    f.add_argument(
        "--triaged",
        default=None,
        metavar="FILE",
        help="walk driver: finds whose signature (kind[:exception]@operation) this JSON file lists are saved and "
        "counted, and the search goes on; a new bug of a triaged kind still ends it (e.g. findings/triaged.json)",
    )
    f.add_argument(
        "--no-guards", action="store_true", help="run kvprop's allocator without its own guards (kvprop target only)"
    )
    target_args(f)

    r = command(
        "replay", f"{COMMANDS}:cmd_replay", "re-execute a trace step by step (exit 1 reproduces, 0 passes, 2 bad file)"
    )
    r.add_argument("file")
    target_args(r, "replay on this variant instead of the recorded one ('correct' for the fixed allocator)")

    m = command("minimise", f"{COMMANDS}:cmd_minimise", "minimise an existing trace (exit 1: still fails, written)")
    m.add_argument("file")
    m.add_argument("--out", default=None, help="where to write (default: overwrite FILE)")
    target_args(m)

    e = command("emit-test", f"{COMMANDS}:cmd_emit_test", "write the standalone pytest regression test for a trace")
    e.add_argument("file")
    e.add_argument("--out", default=None, help="test file to write (default: test_<name>.py beside FILE)")
    e.add_argument(
        "--target",
        default=None,
        help="the target the test replays on (default: the trace's, if it is one of kvprop's own)",
    )

    rp = command(
        "report",
        "kvprop.front.report:cmd_report",
        "write a find on a vLLM target as a reproducer needing only vLLM (exit 0 written, 2 cannot, "
        "1 vLLM died or hung replaying it)",
    )
    rp.add_argument("file")
    rp.add_argument(
        "--target", default=None, choices=choices.REPORTED, help="the target to replay on (default: the trace's)"
    )
    rp.add_argument("--out", default=None, help="folder for repro.py and REPORT.md (default: FILE's name + .report)")
    call_timeout_arg(rp, "vLLM", " while the trace is replayed")

    b = command("bugs", f"{FUZZ}:cmd_bugs", "fuzz every bug variant from scratch and tabulate (exit 0: all found)")
    b.add_argument("--seconds-per-bug", type=seconds, default=30.0, help="budget per variant")
    b.add_argument("--driver", default="walk", choices=DRIVERS, help="the search driver")
    b.add_argument("--workers", type=workers, default=1, help="worker processes per search")
    b.add_argument("--seed", type=seed, default=0, help="run seed")
    b.add_argument("--device", default=None, help="cpu | cuda | cuda:N")
    b.add_argument("--json", action="store_true", help="print the table as JSON")
    b.add_argument("--no-guards", action="store_true", help="run kvprop's allocator without its own guards")
    b.add_argument("--only", default=None, metavar="NAME[,NAME]", help="only these variants (see `kvprop variants`)")

    command("variants", f"{COMMANDS}:cmd_variants", "list the bug variants of kvprop's allocator ('correct' has none)")

    t = command(
        "targets",
        f"{COMMANDS}:cmd_targets",
        "list the registered targets, what each declares and the release it drives",
    )
    t.add_argument("--json", action="store_true", help="print the list as JSON")

    fa = command(
        "facts", "kvprop.front.facts:cmd_facts", "rewrite or check the blocks of docs/design.md the code generates"
    )
    mode = fa.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", dest="mode", action="store_const", const="write", help="rewrite the blocks in place")
    mode.add_argument("--check", dest="mode", action="store_const", const="check", help="exit 1 naming stale blocks")
    fa.add_argument("--file", default=None, help="the document; none: docs/design.md beside the package")

    cov = command(
        "coverage", f"{COMMANDS}:cmd_coverage", "statement and branch coverage of the target's allocator by walks"
    )
    cov.add_argument("--seconds", type=seconds, default=60.0, help="time budget of the walks")
    cov.add_argument("--seed", type=seed, default=0, help="run seed; each walk's seed is a hash of it")
    cov.add_argument("--max-ops", type=operations, default=200, help="operations per walk")
    cov.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    cov.add_argument("--html", default=None, metavar="DIR", help="also write coverage.py's HTML report into DIR")
    cov.add_argument("--out", default="counterexamples", help="where a target that dies or hangs is saved")
    target_args(cov, more="; 'vllm+vllm-scheduler' alternates walks between vLLM's two targets")

    bi = command(
        "bisect",
        "kvprop.front.bisect:cmd_bisect",
        "replay a find on every release of its engine in a range (exit 1: some affected)",
    )
    bi.add_argument("file")
    bi.add_argument("--releases", required=True, metavar="FIRST..LAST", help="e.g. 0.22.1..0.34.0, both included")
    bi.add_argument("--target", default=None, choices=choices.ENGINE_TARGETS, help="default: the trace's target")
    bi.add_argument(
        "--envs",
        default=None,
        metavar="PREFIX",
        help="where each release's environment is, as a prefix of its folder (default: .venv-vllm- or "
        ".venv-sglang-, by the target's engine; make vllm-env, make sglang-env)",
    )
    bi.add_argument("--json", action="store_true", help="one JSON object instead of the table")

    fi = command(
        "findings",
        "kvprop.front.findings:cmd_findings",
        "run every recorded finding's reproducer on each release it names (exit 1: one answers otherwise)",
    )
    fi.add_argument("dir", nargs="?", default="findings", help="the folder of findings (default: findings)")
    envs_arg(fi)
    fi.add_argument("--releases", action="store_true", help="only print the releases the findings name")
    fi.add_argument("--json", action="store_true", help="one JSON list of answers instead of the table")

    ag = command(
        "agree",
        "kvprop.front.agree_command:cmd_agree",
        "walk a target beside its reference, kvprop's allocator or SGLang's Python core (exit 1: they disagree)",
    )
    ag.add_argument(
        "--target", required=True, help="'vllm', 'vllm-scheduler', package.module:factory, or 'sglang-rust'"
    )
    ag.add_argument("--walks", type=positive_int, default=100, help="walks to compare")
    ag.add_argument("--seed", type=seed, default=0, help="the first walk's seed; walks take consecutive seeds")
    ag.add_argument("--max-ops", type=operations, default=200, help="operations per walk")
    ag.add_argument(
        "--no-junction",
        action="store_true",
        help="for a target without the shared-prefix junction (vLLM before 0.30.0): no retention, no state group",
    )
    ag.add_argument(
        "--block-hits",
        action="store_true",
        help="hits end on block boundaries (no hash unit): for vLLM 0.30.0, whose hits inside a block "
        "follow other rules than the 0.33.0 kvprop models",
    )
    ag.add_argument(
        "--no-checkpoints",
        action="store_true",
        help="state groups save no prefill checkpoints: for vLLM before 0.33.0, whose checkpoints follow "
        "other rules or do not exist",
    )
    ag.add_argument(
        "--incremental-report",
        action="store_true",
        help="no request asks for the full KV cache report: for vLLM before 0.30.0, which has none",
    )
    ag.add_argument(
        "--reference-variant",
        default=None,
        metavar="NAME",
        help="run kvprop's allocator as this variant: a release's known bug kvprop fixes (vLLM 0.33.0 and 0.34.0: "
        "checkpoint-over-running-state+reannounces-every-position+copy-before-compute; 0.30.0: "
        "reannounces-every-position), "
        "so that everything else can still be compared; names joined by '+' switch on several",
    )
    ag.add_argument(
        "--release-rules",
        action="store_true",
        help="take the five options above from the installed vLLM release (what it lacks of kvprop's "
        "model, and its known bugs: kvprop.targets.vllm.releases); the header names them",
    )
    ag.add_argument("--json", action="store_true", help="print one JSON object")
    ag.add_argument("--out", default="counterexamples", help="where a target that dies or hangs is saved")
    call_timeout_arg(ag)

    bench = command("bench", f"{COMMANDS}:cmd_bench", "throughput, scaling and time-to-find tables")
    bench.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    bench.add_argument("--quick", action="store_true", help="shorter runs")
    bench.add_argument(
        "--baseline",
        metavar="FILE",
        default=None,
        help="an earlier `kvprop bench --json` output (the previous code): the targets table shows its "
        "values in a 'before' column",
    )
    bench.add_argument(
        "--markdown",
        metavar="PATH",
        default=None,
        help="also write the tables as a markdown document headed by the command, the date and the "
        "machine (make benchmarks: docs/benchmarks.md)",
    )
    bench.add_argument(
        "parts",
        nargs="*",
        type=_bench_part,
        metavar="PART",
        help="which tables: startup (seconds of kvprop --help, --version, targets and an argument error, each "
        "a fresh process), throughput, supervision (the same walks in this process and in a supervised "
        "worker), scaling, time_to_find, vllm (run from a vLLM environment), sglang (from an SGLang "
        "environment), ray (a campaign as Ray tasks against the process pool, and its cost model), targets; "
        "default: all but vllm, sglang and ray",
        default=None,
    )
    return p


def _bench_part(text: str) -> str:
    # not argparse's choices: with nargs="*" it rejects an empty list (no part named)
    if text not in choices.PARTS:
        raise argparse.ArgumentTypeError(f"invalid part {text!r} (choose from {', '.join(choices.PARTS)})")
    return text


def _function(path: str):
    """The command's function ``module:function`` names, its module imported now."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


VERDICTS = {
    EXIT_CLEAN: "clean",
    EXIT_FOUND: "found",
    EXIT_USAGE: "unusable",
    EXIT_INTERNAL: "error",
    EXIT_INTERRUPTED: "interrupted",
}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = _parse(argv)
        _timeouts(args)
        interrupt.install()
        args.started = time.monotonic()
        code, error = _run(args)
        if getattr(args, "json", False) and not getattr(args, "printed_json", False):
            _print_outcome(args.command, code, error)
        sys.stdout.flush()  # a closed pipe is met here, not while Python shuts down
        return code
    except BrokenPipeError:
        return _reader_gone()


def _timeouts(args: argparse.Namespace) -> None:
    """``call_timeout`` and ``build_timeout`` of a command that runs a target. Given, the call
    timeout holds everywhere. Not given, it fits the time budget, so that a target that hangs is
    found, saved and minimised within ``--seconds`` instead of outliving it: a quarter of the
    budget, between ``MIN_CALL_TIMEOUT`` and ``CALL_TIMEOUT``; importing and building the target
    (an engine's import takes seconds on a loaded machine) keep ``CALL_TIMEOUT``."""
    given = vars(args)
    if "call_timeout" not in given:
        return
    if given["call_timeout"] is not None:
        args.build_timeout = args.call_timeout
        return
    if "seconds" in given:
        budget = given["seconds"]
    else:  # fuzz's own default budget (kvprop.front.fuzz_command.time_budget)
        budget = FUZZ_SECONDS if given.get("command") == "fuzz" and given.get("max_runs") is None else None
    args.call_timeout = CALL_TIMEOUT if budget is None else min(CALL_TIMEOUT, max(MIN_CALL_TIMEOUT, budget / 4))
    args.build_timeout = CALL_TIMEOUT


def _parse(argv: list[str]) -> argparse.Namespace:
    """The parsed command line; otherwise ``SystemExit`` as argparse exits: 2 for an error
    (with ``--json``, its JSON object too), 0 after ``--help`` or ``--version``, their text
    flushed here, where a closed pipe is caught."""
    code: int | str | None
    try:
        return build_parser().parse_args(argv)
    except UsageError as e:
        print(e, end="", file=sys.stderr)
        if "--json" in argv:
            _print_outcome(None, EXIT_USAGE, str(e).strip().splitlines()[-1])
        code = EXIT_USAGE
    except SystemExit as e:
        code = e.code
    sys.stdout.flush()
    sys.exit(code)


def _run(args) -> tuple[int, str | None]:
    """The command's exit code, and the message of the error that ended it (printed on stderr)."""
    try:
        return _function(args.func)(args), None
    except BrokenPipeError:
        raise
    except KvpropError as e:
        message = f"kvprop {args.command}: {e}"
        print(message, file=sys.stderr)
        return EXIT_USAGE, message
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return EXIT_INTERRUPTED, "interrupted"
    except Exception as e:  # noqa: BLE001 - an error of kvprop itself: one line, never a "find"
        if args.debug:
            traceback.print_exc()
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        message = f"kvprop {args.command}: internal error: {type(e).__name__}: {first}"
        hint = "" if args.debug else " (run with --debug for the traceback)"
        print(message + hint, file=sys.stderr)
        if args.debug and getattr(e, "args", None) and "\n" in str(e):
            print(str(e), file=sys.stderr)
        return EXIT_INTERNAL, message


def _print_outcome(command: str | None, code: int, error: str | None) -> None:
    """The JSON object of a ``--json`` run that ended without the command's own: a script
    reading stdout gets a document on every exit, never nothing or half a table."""
    outcome = {"command": command, "exit": code, "verdict": VERDICTS.get(code, "error"), "error": error}
    print(json.dumps(outcome, indent=1), flush=True)


def _reader_gone() -> int:
    """Whoever read stdout closed it (``kvprop fuzz | head -1``): end quietly, as a Unix tool
    that SIGPIPE ends does. stdout now points at /dev/null, so that the output still buffered
    is not flushed into the closed pipe at exit (Python would print "Exception ignored")."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_CLOSED_PIPE


if __name__ == "__main__":
    sys.exit(main())
