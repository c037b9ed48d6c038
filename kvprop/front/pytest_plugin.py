"""kvprop inside a project's own test suite: ``pytest --kvprop-target package.module:factory``.

Registered through the ``pytest11`` entry point (``kvprop = kvprop.front.pytest_plugin``), as
Hypothesis registers its own, so pytest loads it in every session of an environment kvprop
is installed in. It therefore imports nothing of kvprop, Hypothesis or torch at import time,
and does nothing at all unless ``--kvprop-target`` is given. With it, the session gets one
more test item, ``kvprop[<target>]``, which:

1. loads the target's factory (a target that cannot be loaded fails with kvprop's message);
2. builds engines over sampled configurations until one builds (none of ``PROBE_SEEDS``
   building fails with the first refusal, where Hypothesis would say ``Unsatisfiable``);
3. runs kvprop's state machine under the chosen profile; a violation (or a crash of the
   target) is written as a trace under ``--kvprop-out`` and fails the item with the
   violation, the trace's path and the command that replays it.
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
PROBE_SEEDS = 64  # sampled configurations tried before the search; one that builds is enough


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


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

    config = item.config
    target = config.getoption("kvprop_target")
    variant = config.getoption("kvprop_variant")
    try:
        machine_settings, profile = _settings(config)
        _check_target(target, variant)
        _probe(target, variant)
    except (ConfigError, TargetError) as e:
        _fail(str(e))
    _search(item, target, variant, machine_settings, profile)


def _settings(config: pytest.Config):
    """The chosen profile's settings, passed to the machine explicitly: whatever profile the
    user's conftest loaded (or Hypothesis's own ``ci`` on CI=true) neither applies nor changes."""
    from hypothesis import settings

    from kvprop.errors import ConfigError
    from kvprop.search import profiles

    name = _profile(config)
    profiles.register()
    if name not in profiles.PROFILES:
        source = "--kvprop-profile" if config.getoption("kvprop_profile") else f"${PROFILE_ENV}"
        raise ConfigError(f"unknown profile {name!r} (from {source}); known: {', '.join(profiles.PROFILES)}")
    chosen = settings.get_profile(name)
    examples = config.getoption("kvprop_examples")
    if examples is not None:
        chosen = settings(chosen, max_examples=examples)
    return chosen, name


def _check_target(target: str, variant: str | None) -> None:
    """The target loads and the variant exists and applies to it; ConfigError saying why not."""
    from kvprop.errors import ConfigError
    from kvprop.targets import load_factory
    from kvprop.targets.variants import get_variant

    if target != "kvprop":
        load_factory(target)
        if variant not in (None, "correct"):
            raise ConfigError(f"--kvprop-variant {variant!r} applies to --kvprop-target kvprop only, not to {target!r}")
    get_variant(variant)


def _probe(target: str, variant: str | None) -> None:
    """Build engines over sampled configurations until one builds: a target that refuses every
    one fails here with its own reason, not with Hypothesis's ``Unsatisfiable``."""
    import random

    from kvprop.errors import ConfigError, TargetError
    from kvprop.search.alphabet import RandomChooser, sample_config
    from kvprop.targets import build_engine, shapes_of

    first_refusal = None
    shapes = shapes_of(None if target == "kvprop" else target)
    for seed in range(PROBE_SEEDS):
        config = sample_config(RandomChooser(random.Random(seed)), shapes)
        try:
            build_engine(config, variant=variant, target=None if target == "kvprop" else target)
        except ConfigError as e:
            first_refusal = first_refusal or str(e)
            continue
        except TargetError as e:  # the factory's own code failed: the user's to see, in one line
            _fail(f"could not build an engine: {e}\n  configuration: {config}")
        return
    raise ConfigError(
        f"target {target!r} could not build any of {PROBE_SEEDS} sampled configurations; first refusal: {first_refusal}"
    )


def _search(item: KvpropItem, target: str, variant: str | None, machine_settings, profile: str) -> None:
    from hypothesis.errors import Unsatisfiable
    from hypothesis.stateful import run_state_machine_as_test

    from kvprop.search.machine import failure_trace, machine_for

    machine = machine_for(variant=variant, target=None if target == "kvprop" else target)
    error = None
    try:
        run_state_machine_as_test(machine, settings=machine_settings)
    except Exception as e:  # noqa: BLE001 - sorted below, outside the handler, so no exception chain is shown
        error = e
    if error is not None:
        if machine.failures:
            _report(item, failure_trace(machine), target, variant, profile, machine.counters["examples"])
        if isinstance(error, Unsatisfiable):
            refused = machine.counters.get("refused")
            common = refused.most_common(1) if refused else []
            reason = f"; most frequent refusal ({common[0][1]}x): {common[0][0]}" if common else ""
            _fail(
                f"target {target!r} could build none of the configurations Hypothesis drew "
                f"({machine.counters['examples']} tried, profile {profile}){reason}"
            )
        raise error  # not a finding: an error of the run itself, with its traceback
    counters = machine.counters
    summary = f"{counters['examples']} examples, {counters['steps']} steps, {len(machine.events_seen)} events reached"
    item.user_properties.append(("kvprop", summary))
    item.add_report_section("call", "kvprop", f"target {target}, profile {profile}: {summary}\n")


def _report(item: KvpropItem, found, target: str, variant: str | None, profile: str, examples: int) -> None:
    """Write the failing trace (minimised unless told not to) and fail with where it is and how to replay it."""
    import shlex

    from kvprop.targets import is_builtin

    failure = found.failure
    head = (
        f"target {target!r}{f' (variant {variant})' if variant else ''} failed {failure.kind} "
        f"(Hypothesis, profile {profile}, after {examples} examples)\n  {_where(found)}"
    )
    from kvprop.search.trace import save

    config = item.config
    try:
        out = _out_dir(config)
        name = _name(found, target)
        found_path = out / f"{name}.found.json"
        save(found, found_path)
    except OSError as e:
        _fail(f"{head}\n(the trace could not be written under --kvprop-out: {e})")
    best, note = found, ""
    if not config.getoption("kvprop_no_minimise"):
        best, note = _minimise(found, variant, target)
    lines = [note] if note else []
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


def _minimise(found, variant: str | None, target: str):
    """The minimised trace and a note, or the trace as found and a note saying why not."""
    from kvprop.repro.minimise import minimise

    try:
        return minimise(found, variant=variant, target=None if target == "kvprop" else target), ""
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
