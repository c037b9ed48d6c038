"""``kvprop report TRACE``: a find on a vLLM target as a reproducer vLLM's maintainers run without kvprop.

It replays the trace on its target in a supervised worker (vLLM's code never runs in kvprop's
own process), recording what kvprop asked of vLLM (``kvprop.repro.vllm_record`` for the
manager, ``vllm_scheduler_record`` for the scheduler), writes ``repro.py``
(``vllm_script``, ``vllm_scheduler_script``) and ``REPORT.md`` (``report_page``) into the
output folder, then runs
the script with this interpreter, isolated and with kvprop made unimportable: only a script
that exits 1 on the installed release is kept, so a report never holds a reproducer that
cannot fail. Exit 0 written; 2 a trace or find it cannot report (the message says which
targets and kinds it takes); 1 vLLM's process died or hung while replaying (a find, saved in
the output folder).
"""

from __future__ import annotations

import contextlib
import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import attrs

from kvprop.errors import ConfigError, KvpropError
from kvprop.exits import EXIT_CLEAN
from kvprop.front.choices import REPORTED  # the targets it reports (the parser offers them)
from kvprop.front.commands import died_find
from kvprop.front.output_paths import writable_folder
from kvprop.repro.report_page import Page, manager_steps, markdown, scheduler_steps
from kvprop.search.supervisor import Died, Supervisor
from kvprop.search.trace import Trace
from kvprop.targets.vllm.loading import INSTALL_HINT

PICTURE = "failing-step.svg"  # the pool and the block tables before the failing operation and at the find
SCRIPT_TIMEOUT = 600  # seconds: importing vLLM and replaying a minimised trace take far less
REPRODUCER = "repro.py"  # the script kvprop report writes


def without_kvprop(script: str = REPRODUCER) -> str:
    """Python that runs ``script`` with every import of kvprop refused, as a maintainer's
    environment has none."""
    return f"import runpy, sys; sys.modules['kvprop'] = None; runpy.run_path({script!r}, run_name='__main__')"


def run_reproducer(folder: Path, python: str = sys.executable, script: str = REPRODUCER) -> subprocess.CompletedProcess:
    """``folder/script`` (``repro.py`` unless named) run as a maintainer runs it: by ``python``
    (an environment's own interpreter), isolated, from its folder, with every import of kvprop
    refused."""
    return subprocess.run(
        [python, "-I", "-c", without_kvprop(script)],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=SCRIPT_TIMEOUT,
    )


def check_reportable(trace: Trace, source: str) -> None:
    """Only finds on a vLLM target, replayed on vLLM as it is, are reported."""
    target = trace.target
    if target not in REPORTED:
        named = "kvprop's own allocator" if target in (None, "kvprop") else f"target {target!r}"
        raise ConfigError(
            f"{source} is a find on {named}; kvprop report writes reproducers for targets 'vllm' "
            "(vLLM's KVCacheManager) and 'vllm-scheduler' (its Scheduler) only; for other targets, "
            "kvprop emit-test writes a regression test"
        )
    if trace.variant not in (None, "correct"):
        raise ConfigError(f"{source} names variant {trace.variant!r}; a vllm find runs on vLLM as it is (no variant)")


def cmd_report(args) -> int:
    from kvprop.search import trace as tr

    trace = tr.load(args.file)
    if args.target:
        trace = attrs.evolve(trace, target=args.target)
    check_reportable(trace, args.file)
    out = Path(args.out) if args.out else Path(args.file).with_suffix(".report")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {str(out)!r} is a file; give a folder")
    if importlib.util.find_spec("vllm") is None:  # looked for, not imported: vLLM runs only in the worker
        raise ConfigError(f"kvprop report needs vLLM importable; {INSTALL_HINT}")
    created = not out.exists()
    writable_folder(out, "--out" if args.out else "the report folder")
    with Supervisor(trace.target, None, None, args.call_timeout) as supervisor:
        try:
            supervisor.call(report_here, {"trace": tr.to_dict(trace), "out": str(out)})
        except Died as died:  # vLLM's process died or hung while replaying: a find of its own
            args.out = str(out)
            return died_find(args, died, "report")
        except KvpropError:  # refused (the trace does not fail here): no report, so no folder of one
            if created:
                with contextlib.suppress(OSError):
                    out.rmdir()  # only while empty
            raise
    print(f"wrote {out / 'repro.py'} and {out / 'REPORT.md'}; run: python repro.py (exit 1: the bug is present)")
    return EXIT_CLEAN


def report_here(trace: dict, out: str, journal=None) -> None:
    """In the supervised worker: vLLM's code runs only there."""
    from kvprop.search import trace as tr
    from kvprop.targets.vllm.loading import import_vllm

    write_report(tr.from_dict(trace), Path(out), import_vllm().version, journal)


def write_report(trace: Trace, out: Path, version: str, journal=None) -> None:
    """Record, render, write and verify; a find the script cannot state is a ConfigError."""
    written = scheduler_script if trace.target == "vllm-scheduler" else manager_script
    failure, script, configuration, steps, component, around = written(trace, version, journal)
    sentence = _sentence(failure.kind)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "repro.py"
    path.write_text(script, encoding="utf-8")
    run = run_reproducer(out)
    if run.returncode != 1:
        path.unlink()
        raise ConfigError(
            f"the reproducer exits {run.returncode} on vLLM {version}, not 1: the find ({failure.kind}) is not "
            f"reproduced by vLLM's calls alone; nothing written. Its output ends: "
            f"{_last_line(run.stderr or run.stdout)}"
        )
    title = f"vLLM {version}: {failure.kind} on the {component}"
    picture = around.picture(title)
    if picture is not None:
        (out / PICTURE).write_text(picture, encoding="utf-8")
    page = Page(
        component,
        version,
        failure,
        sentence,
        configuration,
        steps,
        _last_line(run.stderr),
        PICTURE if picture is not None else None,
        around.why_not,
    )
    (out / "REPORT.md").write_text(markdown(page), encoding="utf-8")


def _checked(failure, supported, target: str, version: str):
    """The find, if the script can state it."""
    if failure is None:
        raise ConfigError(f"the trace does not fail on vLLM {version}: there is nothing to reproduce")
    if failure.kind not in supported:
        raise ConfigError(
            f"the find is {failure.kind!r}, which kvprop report cannot state from vLLM alone on target "
            f"{target!r}; supported kinds: {', '.join(supported)}"
        )
    return failure


def _sentence(kind: str) -> str:
    from kvprop.check.kinds import KINDS

    return KINDS[kind].sentence if kind in KINDS else "vLLM raises no exception"


def scheduler_script(trace: Trace, version: str, journal):
    """The find on vLLM's scheduler: (failure, script, configuration, steps, component, the pool around the find)."""
    from kvprop.repro import vllm_scheduler_script as vs
    from kvprop.repro.vllm_scheduler_record import record_scheduler

    recording = record_scheduler(trace, journal)
    failure = _checked(recording.failure, vs.SUPPORTED, "vllm-scheduler", version)
    script = vs.render(recording, trace.steps, failure.kind, _sentence(failure.kind), version)
    configuration = _section(script, "# ---- the scheduler, as kvprop built it", "except TypeError")
    return failure, script, configuration, scheduler_steps(recording, trace.steps), "Scheduler", recording.around


def manager_script(trace: Trace, version: str, journal):
    """The find on vLLM's manager: (failure, script, configuration, steps, component, the pool around the find)."""
    from kvprop.repro import vllm_script as vs
    from kvprop.repro.vllm_record import record
    from kvprop.targets.vllm.config import manager_arguments

    recording = record(trace, journal)
    failure = _checked(recording.failure, vs.SUPPORTED, "vllm", version)
    if failure.kind == "target-crash" and not recording.calls:
        raise ConfigError(f"the crash on vLLM {version} comes before any call into vLLM: nothing to reproduce")
    kwargs, env = manager_arguments(recording.allocator.config)
    vs.check_constructors(kwargs)
    script = vs.render(recording, trace.steps, failure.kind, _sentence(failure.kind), version, (kwargs, env))
    configuration = _groups(kwargs["kv_cache_config"]) + _section(
        script, "    manager = KVCacheManager(", "except TypeError"
    )
    return failure, script, configuration, manager_steps(recording, trace.steps), "KVCacheManager", recording.around


def _section(script: str, start: str, end: str) -> str:
    """The script's lines from ``start`` up to ``end``, as a Python block."""
    at = script.index(start)
    text = textwrap.dedent(script[at : script.index(end, at)]).rstrip()
    return f"```python\n{text}\n```\n"


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
