"""The state machine's search as one call a supervised worker makes: what the pytest plugin runs.

The plugin (``kvprop.front.pytest_plugin``) never runs target code in pytest's own process: a
target that exits, segfaults or raises ``KeyboardInterrupt`` there would end the user's whole
test session. It hands this function to a ``Supervisor`` instead, whose worker probes the target,
runs the machine with its journal (so a death or a hang is judged into a find with its trace)
and answers with plain data.
"""

from __future__ import annotations

from typing import Any

PROBE_SEEDS = 64  # sampled configurations tried before the search; one that builds is enough


def probe(target: str | None, variant: str | None, journal=None) -> None:
    """Build engines over sampled configurations until one builds (``supervisor.probe_here``): a
    target that refuses every one raises a ConfigError with its own first refusal, not
    Hypothesis's ``Unsatisfiable``."""
    from kvprop.errors import ConfigError, TargetError
    from kvprop.search.supervisor import probe_here

    try:
        refusal = probe_here(journal, target, variant, None, PROBE_SEEDS)
    except TargetError as e:  # the factory's own code failed: the user's to see, in one line
        raise TargetError(f"could not build an engine: {e}") from None
    if refusal is not None:
        raise ConfigError(
            f"target {target or 'kvprop'!r} could not build any of {PROBE_SEEDS} sampled configurations; "
            f"first refusal: {refusal}"
        )


def search(target: str | None, variant: str | None, profile: str, examples: int | None, journal=None) -> dict[str, Any]:
    """Probe, then run the state machine under ``profile`` (``examples`` overrides its
    ``max_examples``). Answers one of ``{"found": trace}`` (a violation or a crash the machine
    caught, in the trace format), ``{"unsatisfiable": reason}`` or ``{"clean": counters}``."""
    from hypothesis import settings
    from hypothesis.errors import Unsatisfiable
    from hypothesis.stateful import run_state_machine_as_test

    from kvprop.search import profiles
    from kvprop.search import trace as tr
    from kvprop.search.machine import failure_trace, machine_for

    probe(target, variant, journal)
    profiles.register()
    chosen = settings.get_profile(profile)
    if examples is not None:
        chosen = settings(chosen, max_examples=examples)
    machine = machine_for(variant=variant, target=target)
    machine.journal = journal
    try:
        run_state_machine_as_test(machine, settings=chosen)
    except Exception as e:
        if machine.failures:
            return {"found": tr.to_dict(failure_trace(machine)), "examples": machine.counters["examples"]}
        if isinstance(e, Unsatisfiable):
            refused = machine.counters.get("refused")
            common = refused.most_common(1) if refused else []
            reason = f"; most frequent refusal ({common[0][1]}x): {common[0][0]}" if common else ""
            return {"unsatisfiable": f"{machine.counters['examples']} tried, profile {profile}{reason}"}
        raise  # not a finding: an error of the run itself
    counters = machine.counters
    return {
        "clean": {
            "examples": counters["examples"],
            "steps": counters["steps"],
            "events": len(machine.events_seen),
        }
    }
