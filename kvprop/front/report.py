"""``kvprop report TRACE``: a find on vLLM's manager target as a reproducer vLLM's maintainers run without kvprop.

It replays the trace on the ``vllm`` target in a supervised worker (vLLM's code never runs in
kvprop's own process), recording the calls into vLLM (``kvprop.repro.vllm_record``), writes
``repro.py`` (``kvprop.repro.vllm_script``) and ``REPORT.md`` into the output folder, then runs
the script with this interpreter, isolated and with kvprop made unimportable: only a script
that exits 1 on the installed release is kept, so a report never holds a reproducer that
cannot fail. Exit 0 written; 2 a trace or find it cannot report (the message says which
targets and kinds it takes); 1 vLLM's process died or hung while replaying (a find, saved in
the output folder).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

from kvprop.errors import ConfigError
from kvprop.exits import EXIT_CLEAN
from kvprop.front.commands import died_find
from kvprop.search.supervisor import Died, Supervisor
from kvprop.search.trace import Trace
from kvprop.targets.vllm.loading import INSTALL_HINT

SCRIPT_TIMEOUT = 600  # seconds: importing vLLM and replaying a minimised trace take far less
# Runs the reproducer with every import of kvprop refused, as a maintainer's environment has none.
WITHOUT_KVPROP = "import runpy, sys; sys.modules['kvprop'] = None; runpy.run_path('repro.py', run_name='__main__')"


def check_reportable(trace: Trace, source: str) -> None:
    """Only finds on the ``vllm`` target, replayed on vLLM as it is, are reported."""
    target = trace.target
    if target == "vllm-scheduler":
        raise ConfigError(
            f"{source} is a find on target 'vllm-scheduler'; reproducers for vLLM's Scheduler are not "
            "supported yet; allowed: a trace of target 'vllm' (vLLM's KVCacheManager)"
        )
    if target != "vllm":
        named = "kvprop's own allocator" if target in (None, "kvprop") else f"target {target!r}"
        raise ConfigError(
            f"{source} is a find on {named}; kvprop report writes reproducers for target 'vllm' "
            "(vLLM's KVCacheManager) only; for other targets, kvprop emit-test writes a regression test"
        )
    if trace.variant not in (None, "correct"):
        raise ConfigError(f"{source} names variant {trace.variant!r}; a vllm find runs on vLLM as it is (no variant)")


def cmd_report(args) -> int:
    from kvprop.search import trace as tr

    trace = tr.load(args.file)
    check_reportable(trace, args.file)
    out = Path(args.out) if args.out else Path(args.file).with_suffix(".report")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {str(out)!r} is a file; give a folder")
    if importlib.util.find_spec("vllm") is None:  # looked for, not imported: vLLM runs only in the worker
        raise ConfigError(f"kvprop report needs vLLM importable; {INSTALL_HINT}")
    with Supervisor("vllm", None, None, args.call_timeout) as supervisor:
        try:
            supervisor.call(report_here, {"trace": tr.to_dict(trace), "out": str(out)})
        except Died as died:  # vLLM's process died or hung while replaying: a find of its own
            args.out = str(out)
            return died_find(args, died, "report")
    print(f"wrote {out / 'repro.py'} and {out / 'REPORT.md'}; run: python repro.py (exit 1: the bug is present)")
    return EXIT_CLEAN


def report_here(trace: dict, out: str, journal=None) -> None:
    """In the supervised worker: vLLM's code runs only there."""
    from kvprop.search import trace as tr
    from kvprop.targets.vllm.loading import import_vllm

    write_report(tr.from_dict(trace), Path(out), import_vllm().version, journal)


def write_report(trace: Trace, out: Path, version: str, journal=None) -> None:
    """Record, render, write and verify; a find the script cannot state is a ConfigError."""
    from kvprop.check.kinds import KINDS
    from kvprop.repro import vllm_script as vs
    from kvprop.repro.vllm_record import record
    from kvprop.targets.vllm.config import manager_arguments

    recording = record(trace, journal)
    failure = recording.failure
    if failure is None:
        raise ConfigError(f"the trace does not fail on vLLM {version}: there is nothing to reproduce")
    if not vs.supported(failure.kind):
        raise ConfigError(
            f"the find is {failure.kind!r}, which kvprop report cannot state from vLLM's manager alone; "
            f"supported kinds: {', '.join(vs.SUPPORTED)}"
        )
    if failure.kind == "target-crash" and not recording.calls:
        raise ConfigError(f"the crash on vLLM {version} comes before any call into vLLM: nothing to reproduce")
    kwargs, env = manager_arguments(recording.allocator.config)
    vs.check_constructors(kwargs)
    sentence = KINDS[failure.kind].sentence if failure.kind in KINDS else "vLLM's KVCacheManager raises no exception"
    script = vs.render(recording, trace.steps, failure.kind, sentence, version, (kwargs, env))
    out.mkdir(parents=True, exist_ok=True)
    path = out / "repro.py"
    path.write_text(script, encoding="utf-8")
    run = subprocess.run(
        [sys.executable, "-I", "-c", WITHOUT_KVPROP],
        cwd=out,
        capture_output=True,
        text=True,
        timeout=SCRIPT_TIMEOUT,
    )
    if run.returncode != 1:
        path.unlink()
        raise ConfigError(
            f"the reproducer exits {run.returncode} on vLLM {version}, not 1: the find ({failure.kind}) is not "
            f"reproduced by vLLM's calls alone; nothing written. Its output ends: "
            f"{_last_line(run.stderr or run.stdout)}"
        )
    text = markdown(recording, trace.steps, failure, sentence, version, script, _last_line(run.stderr))
    text = text.replace("## Configuration\n\n", "## Configuration\n\n" + _groups(kwargs["kv_cache_config"]), 1)
    (out / "REPORT.md").write_text(text, encoding="utf-8")


def _groups(kv_cache_config) -> str:
    """The pool and each KV cache group in a line: the spec's class and what sets its shape."""
    lines = [f"- {kv_cache_config.num_blocks} blocks (the null block among them)"]
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        shown = ("block_size", "sliding_window", "attention_chunk_size", "mamba_cache_mode")
        fields = ", ".join(f"{name}={getattr(spec, name)!r}" for name in shown if getattr(spec, name, None) is not None)
        lines.append(f"- group {g}: `{type(spec).__name__}` ({fields})")
    return "\n".join(lines) + "\n\nas vLLM's constructors (`repro.py` builds exactly this):\n\n"


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no output)"


def _words(call) -> str:
    """One call in plain words."""
    if call.name == "Request":
        return f"request `{call.args[0]}` arrives: {len(call.args[1])} prompt tokens, max_tokens={call.args[2]}"
    if call.name == "append_output_token_ids":
        return f"`{call.args[0]}` gets {len(call.args[1])} output token(s)"
    if call.name in ("num_computed_tokens", "shared_prefix_boundary"):
        return f"`{call.args[0]}`.{call.name} = {call.args[1]}"
    from kvprop.repro.vllm_script import call_lines

    said = call_lines(call)[0].split("  # ")[0]
    return f"`{said}`" + (f": {call.outcome}" if call.outcome else "")


def markdown(recording, steps, failure, sentence: str, version: str, script: str, actual: str) -> str:
    from kvprop.repro.vllm_script import where

    start, end = script.index("    manager = KVCacheManager("), script.index("except TypeError")
    title = (
        f"vLLM {version}: KVCacheManager raises {failure.exception or 'an exception'}"
        if failure.kind == "target-crash"
        else f"vLLM {version}: {sentence} (broken)"
    )
    lines = [
        f"# {title}",
        "",
        f"Engine: vLLM's v1 `KVCacheManager`, vLLM {version}, driven by kvprop's scheduler through its public calls.",
        f"Find: `{failure.kind}`, as kvprop names it; the steps below are the calls a kvprop trace made into vLLM.",
        "",
        "## Configuration",
        "",
        "```python",
        textwrap.dedent(script[start:end]).rstrip(),
        "```",
        "",
        "## Steps",
        "",
    ]
    last_op = None
    for call in recording.calls:
        if call.op != last_op:
            lines.append(f"From {where(call.op, steps)}:")
            lines.append("")
            last_op = call.op
        if call.name == "new_step_starts":
            lines.append("- a new engine step starts (`manager.new_step_starts()`)")
            continue
        lines.append(f"- {_words(call)}")
    expected = "every call returns without an exception" if failure.kind == "target-crash" else sentence
    lines += [
        "",
        "## Expected and actual",
        "",
        f"- Expected: {expected}.",
        f"- Actual (kvprop): {failure.message}",
        f"- Actual (repro.py): `{actual}`",
        "",
        "## Running it",
        "",
        f"In an environment with vLLM {version} (and its torch), nothing else: `python repro.py`.",
        "It exits 1 while the bug is present (an AssertionError, or vLLM's own exception), 0 once it is fixed,",
        "2 where the installed vLLM does not take this configuration (another release's API).",
        "",
    ]
    return "\n".join(lines)
