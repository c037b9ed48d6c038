"""kvprop inside a project's own test suite: ``pytest --kvprop-target package.module:factory``.

Registered through the ``pytest11`` entry point (``kvprop = kvprop.front.pytest_plugin``), as
Hypothesis registers its own, so pytest loads it in every session of an environment kvprop
is installed in. It therefore imports nothing of kvprop, Hypothesis or torch at import time,
and does nothing at all unless ``--kvprop-target`` is given. With it, the session gets one
more test item, ``kvprop[<target>]``, which runs in a supervised worker
(``kvprop.search.supervisor``; pytest's own process never runs target code):

1. loads the target's factory (a target that cannot be loaded fails with kvprop's message);
2. builds engines over sampled configurations until one builds (none of
   ``kvprop.search.suite.PROBE_SEEDS`` building fails with the first refusal, where Hypothesis
   would say ``Unsatisfiable``);
3. runs kvprop's state machine under the chosen profile; a violation, a crash of the target
   (an exception, an exit, a signal, a ``KeyboardInterrupt`` or another ``BaseException``) or
   a hang is written as a trace under ``--kvprop-out`` and fails the item with the failure,
   the trace's path and the command that replays it, while the session goes on.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import NoReturn

import pytest

DEFAULT_PROFILE = "ci"
PROFILE_ENV = "KVPROP_PROFILE"  # kvprop.search.profiles.ENV, not imported: this module must import cheaply
DEFAULT_OUT = "counterexamples"
CALL_TIMEOUT = 60.0  # kvprop.search.CALL_TIMEOUT, not imported: this module must import cheaply
MAX_MEMORY_MIB = 8192  # kvprop.search.MAX_MEMORY_MIB, likewise


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _seconds(text: str) -> float:
    from kvprop.front.values import seconds  # when the option is given: this module imports nothing of kvprop

    return seconds(text)


def _mebibytes(text: str) -> float:
    from kvprop.front.values import mebibytes

    return mebibytes(text)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvprop", "kvprop: stateful property-based testing of a KV-cache allocator")
    group.addoption(
        "--kvprop-target",
        metavar="TARGET",
        default=None,
        help="run kvprop's state machine against this allocator as one more test, kvprop[TARGET]: "
        "'package.module:factory' (factory(config) -> (allocator, view), see kvprop's docs/targets.md), "
        "'kvprop' or 'vllm'",
    )
    group.addoption(
        "--kvprop-profile",
        metavar="NAME",
        default=None,
        help=f"kvprop's Hypothesis profile: dev, ci, fuzz or repro (default: ${PROFILE_ENV}, else {DEFAULT_PROFILE})",
    )
    group.addoption(
        "--kvprop-examples",
        metavar="N",
        type=_positive_int,
        default=None,
        help="examples to run (default: the profile's max_examples)",
    )
    group.addoption(
        "--kvprop-variant",
        metavar="NAME",
        default=None,
        help="a bug variant of kvprop's own allocator (with --kvprop-target kvprop only; see `kvprop variants`)",
    )
    group.addoption(
        "--kvprop-out",
        metavar="DIR",
        default=DEFAULT_OUT,
        help=f"where the trace of a failure is written (default: {DEFAULT_OUT}, relative to the current directory)",
    )
    group.addoption(
        "--kvprop-call-timeout",
        metavar="SECONDS",
        type=_seconds,
        default=CALL_TIMEOUT,
        help=f"seconds the target may go without progress before it is a target-hang find (default: {CALL_TIMEOUT:g})",
    )
    group.addoption(
        "--kvprop-max-memory",
        metavar="MIB",
        type=_mebibytes,
        default=MAX_MEMORY_MIB,
        help=f"resident memory (MiB) the target's worker may hold before it is a target-oom find "
        f"(default: {MAX_MEMORY_MIB})",
    )
    group.addoption(
        "--kvprop-no-minimise",
        action="store_true",
        default=False,
        help="write the failing trace as found, without minimising it first",
    )


def _profile(config: pytest.Config) -> str:
    return config.getoption("kvprop_profile") or os.environ.get(PROFILE_ENV) or DEFAULT_PROFILE


def pytest_report_header(config: pytest.Config):
    target = config.getoption("kvprop_target")
    if target is None:
        return None
    variant = config.getoption("kvprop_variant")
    examples = config.getoption("kvprop_examples")
    return (
        f"kvprop: target {target}{f' (variant {variant})' if variant else ''}, profile {_profile(config)}"
        f"{f', {examples} examples' if examples else ''}"
    )


@pytest.hookimpl(tryfirst=True)  # before -k/-m/--deselect, so they select the kvprop item like any other
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    target = config.getoption("kvprop_target")
    if target is None:
        return
    name = f"kvprop[{target}]"
    items.append(KvpropItem.from_parent(session, name=name, nodeid=name))


class KvpropItem(pytest.Item):
    """kvprop's state machine over ``--kvprop-target``: one test item of the session."""

    def runtest(self) -> None:
        run(self)

    def reportinfo(self):
        return self.path, None, self.name


# ---- the run (everything below imports kvprop lazily) --------------------------------------


def _fail(message: str) -> NoReturn:
    """Fail the item with kvprop's message only: no traceback, no chained exception."""
    raise pytest.fail.Exception(f"kvprop: {message}", pytrace=False) from None


def run(item: KvpropItem) -> None:
    from kvprop.errors import ConfigError, TargetError
    from kvprop.search import trace as tr
    from kvprop.search.suite import search
    from kvprop.search.supervisor import Died

    config = item.config
    target = config.getoption("kvprop_target")
    variant = config.getoption("kvprop_variant")
    named = None if target == "kvprop" else target
    examples = config.getoption("kvprop_examples")
    try:
        profile = _profile_checked(config)
        _check_target(target, variant)
        with _supervisor(config, named, variant) as supervisor:
            try:
                answer = supervisor.call(
                    search, {"target": named, "variant": variant, "profile": profile, "examples": examples}
                )
            except Died as died:  # the target's process died or hung: a find with its trace
                _report(item, died.trace, target, variant, profile, None, supervisor, died.log)
            if "found" in answer:
                found = tr.from_dict(answer["found"])
                _report(item, found, target, variant, profile, answer["examples"], supervisor)
    except (ConfigError, TargetError) as e:
        _fail(str(e))
    if "unsatisfiable" in answer:
        _fail(f"target {target!r} could build none of the configurations Hypothesis drew ({answer['unsatisfiable']})")
    counters = answer["clean"]
    summary = f"{counters['examples']} examples, {counters['steps']} steps, {counters['events']} events reached"
    item.user_properties.append(("kvprop", summary))
    item.add_report_section("call", "kvprop", f"target {target}, profile {profile}: {summary}\n")


def _supervisor(config: pytest.Config, target: str | None, variant: str | None):
    from kvprop.search.supervisor import Supervisor

    timeout, memory = config.getoption("kvprop_call_timeout"), config.getoption("kvprop_max_memory")
    return Supervisor(target, variant, None, timeout, max_memory=memory)


def _profile_checked(config: pytest.Config) -> str:
    """The chosen profile's name, once it is known to exist. The worker applies it explicitly:
    whatever profile the user's conftest loaded (or Hypothesis's own ``ci`` on CI=true) neither
    applies nor changes."""
    from kvprop.errors import ConfigError
    from kvprop.search import profiles

    name = _profile(config)
    if name not in profiles.PROFILES:
        source = "--kvprop-profile" if config.getoption("kvprop_profile") else f"${PROFILE_ENV}"
        raise ConfigError(f"unknown profile {name!r} (from {source}); known: {', '.join(profiles.PROFILES)}")
    return name


def _check_target(target: str, variant: str | None) -> None:
    """The target is named as one is and the variant exists and applies to it; ConfigError saying
    why not. Nothing of the target is imported here: only its supervised worker loads it."""
    from kvprop.errors import ConfigError
    from kvprop.targets import check_name
    from kvprop.targets.variants import get_variant

    if target != "kvprop":
        check_name(target)
        if variant not in (None, "correct"):
            raise ConfigError(f"--kvprop-variant {variant!r} applies to --kvprop-target kvprop only, not to {target!r}")
    get_variant(variant)


def _report(
    item: KvpropItem, found, target: str, variant: str | None, profile: str, examples, supervisor, log=None
) -> NoReturn:
    """Write the failing trace (minimised unless told not to, each candidate in ``supervisor``'s
    worker) and fail with where it is and how to replay it; ``log``: what the target printed
    in the run it died in."""
    import shlex

    from kvprop.front.commands import broken_rule
    from kvprop.targets import is_builtin

    failure = found.failure
    after = f", after {examples} examples" if examples is not None else ""
    rule = broken_rule(failure.kind)
    head = (
        f"target {target!r}{f' (variant {variant})' if variant else ''} failed {failure.kind} "
        f"(Hypothesis, profile {profile}{after})\n  {_where(found)}" + (f"\n  the rule: {rule}" if rule else "")
    )
    from kvprop.search.trace import save

    config = item.config
    try:
        out = _out_dir(config)
        name = _name(found, target)
        found_path = out / f"{name}.found.json"
        save(found, found_path)
        if log is not None:
            import shutil

            shutil.copyfile(log, out / f"{name}.log")
    except OSError as e:
        _fail(f"{head}\n(the trace could not be written under --kvprop-out: {e})")
    best, note = found, ""
    if not config.getoption("kvprop_no_minimise"):
        best, note = _minimise(found, supervisor)
    lines = [note] if note else []
    if log is not None:
        lines.append(f"what the target printed: {_show(out / f'{name}.log', config)}")
    if best is found:
        trace_path = found_path
    else:
        trace_path = out / f"{name}.json"
        try:
            save(best, trace_path)
        except OSError as e:
            shown = _show(found_path, config)
            _fail(f"{head}\ntrace (as found): {shown}\n(the minimised trace could not be written: {e})")
        lines.append(f"minimised from {len(found.steps)} to {_operations(len(best.steps))}, failing {_where(best)}")
    shown = _show(trace_path, config)
    lines.append(f"trace: {shown}")
    if best is not found:
        lines.append(f"as found: {_show(found_path, config)}")
    # a trace never chooses code: a target outside kvprop is named on the command line
    named = "" if is_builtin(best.target) else f" --target {shlex.quote(best.target)}"
    lines += [
        f"replay: kvprop replay {shlex.quote(shown)}{named}",
        f"regression test: kvprop emit-test {shlex.quote(shown)}{named}",
    ]
    _fail("\n".join([head, *lines]))


def _where(trace) -> str:
    failure = trace.failure
    if failure.step >= len(trace.steps):
        return f"in the final drain, after {_operations(len(trace.steps))}: {failure.message}"
    return f"at operation {failure.step + 1} of {len(trace.steps)}: {failure.message}"


def _operations(n: int) -> str:
    return f"{n} operation{'' if n == 1 else 's'}"


def _minimise(found, supervisor):
    """The minimised trace and a note, or the trace as found and a note saying why not. Each
    candidate runs in the supervised worker: one that kills the target is judged, not fatal."""
    from kvprop.repro.minimise import minimiser_for

    try:
        minimiser = minimiser_for(
            found,
            variant=supervisor.variant,
            target=supervisor.target,
            executor=lambda trace: supervisor.execute(trace).failure,
        )
        return minimiser.run(), ""
    except ValueError:
        return found, "(the trace passed when replayed, so it is not minimised: is the target deterministic?)"
    except Exception as e:  # noqa: BLE001 - the find stands; say why it is not minimised
        return found, f"(minimising failed: {type(e).__name__}: {e})"


def _out_dir(config: pytest.Config) -> Path:
    out = Path(config.getoption("kvprop_out"))
    if not out.is_absolute():
        out = Path(config.invocation_params.dir) / out
    out.mkdir(parents=True, exist_ok=True)
    return out


def _name(trace, target: str) -> str:
    """``kvprop_<kind>_<target>_<digest of the trace>``: different finds never share a file."""
    import hashlib
    import json
    import re

    from kvprop.search.trace import to_dict

    digest = hashlib.blake2b(json.dumps(to_dict(trace), sort_keys=True).encode(), digest_size=4).hexdigest()
    return re.sub(r"\W+", "_", f"kvprop_{trace.failure.kind}_{target}_{digest}", flags=re.ASCII).strip("_").lower()


def _show(path: Path, config: pytest.Config) -> str:
    """``path`` as the user would type it where they ran pytest."""
    try:
        return str(path.relative_to(Path(config.invocation_params.dir)))
    except ValueError:
        return str(path)
