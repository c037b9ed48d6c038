"""Every bug variant is found from scratch by the state machine, with no hint, within a
bounded derandomized budget; the shrunk counterexamples are short."""

import time

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from kvprop import profiles
from kvprop.machine import machine_for, shrunk_length
from kvprop.variants import VARIANTS

BUDGET = 1000  # examples; each variant is found well inside it (see the README table)
MAX_SHRUNK = {"interleaved-external-alloc": 8}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_machine_finds_variant_from_scratch(variant, record_property):
    profiles.register()
    machine = machine_for(variant)
    start = time.perf_counter()
    with pytest.raises(BaseException) as info:  # noqa: B017 - any failure of the machine is the finding
        run_state_machine_as_test(machine, settings=settings(settings.get_profile("ci"), max_examples=BUDGET))
    assert not isinstance(info.value, (KeyboardInterrupt, SystemExit))
    length = shrunk_length(machine)
    record_property("examples", machine.counters["examples"])
    record_property("seconds", round(time.perf_counter() - start, 2))
    record_property("shrunk_steps", length)
    print(f"{variant}: found after {machine.counters['examples']} examples, shrunk to {length} steps")
    assert length <= MAX_SHRUNK.get(variant, 12)
