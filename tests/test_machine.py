"""The state machine on the correct allocator: no violation, every hard state reached,
and a failure prints as a program a person can run."""

import random

import pytest
from hypothesis import Phase, settings
from hypothesis.reporting import with_reporter
from hypothesis.stateful import run_state_machine_as_test

from kvprop.errors import Violation
from kvprop.search import profiles
from kvprop.search.alphabet import OPERATIONS, AddRequest, RandomChooser, Step, sample_weights
from kvprop.search.machine import machine_for
from kvprop.sim.events import EVENTS


def _settings(**overrides):
    profiles.register()
    return settings(settings.get_profile("ci"), **overrides)


@pytest.fixture(scope="module")
def clean_run():
    """One derandomized CI run of the machine over the correct allocator."""
    machine = machine_for(None)
    run_state_machine_as_test(machine, settings=_settings())
    return machine


def test_machine_finds_no_violation_on_the_correct_allocator(clean_run):
    assert clean_run.failures == []
    assert clean_run.counters["examples"] >= 100
    assert clean_run.counters["steps"] >= 1000


def test_ci_run_reaches_every_tracked_event(clean_run):
    """The generators really reach the hard states (cross-group hits with external tokens at
    the queue head, evictions, preemption and re-hits, window skips, load failures, aborts)."""
    missing = set(EVENTS) - clean_run.events_seen
    assert not missing, f"the ci run never reached: {sorted(missing)}"


def test_a_failing_case_prints_as_a_runnable_step_program():
    machine = machine_for("swa-skip-off-by-one")
    lines = []
    with with_reporter(lines.append), pytest.raises(Violation) as info:
        run_state_machine_as_test(
            machine, settings=_settings(max_examples=300, phases=[p for p in Phase if p is not Phase.shrink])
        )
    printed = "\n".join(lines + list(getattr(info.value, "__notes__", [])))
    program = printed[printed.index("state = ") :]
    program = program[: program.index("state.teardown()") + len("state.teardown()")]
    configure = next(line for line in program.splitlines() if line.startswith("state.configure("))
    assert "config=EngineConfig(" in configure
    namespace = {type(machine).__name__: machine, machine.__name__: machine}
    exec("from kvprop.allocator.specs import *\nfrom kvprop.search.alphabet import *", namespace)
    with pytest.raises(Violation) as replayed:
        exec(program, namespace)
    assert replayed.value.kind == info.value.kind


def test_steps_draw_only_the_operations_their_example_weights_switch_on():
    machine = machine_for(None)
    drawn = []

    class Watching(machine):
        def run(self, op):
            drawn.append((self.weights, type(op)))
            super().run(op)

    run_state_machine_as_test(Watching, settings=_settings(max_examples=30))
    switched_off = [op.__name__ for weights, op in drawn if weights[OPERATIONS.index(op)] == 0]
    assert (len(drawn) > 100, switched_off) == (True, [])


def test_swarm_weights_never_switch_off_the_operations_that_drive_a_run():
    rng = random.Random(0)
    draws = [sample_weights(RandomChooser(rng)) for _ in range(200)]
    driving = {(w[OPERATIONS.index(Step)], w[OPERATIONS.index(AddRequest)]) for w in draws}
    assert {s for s, _ in driving} | {a for _, a in driving} == {2, 4, 8}
