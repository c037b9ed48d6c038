"""Every bug variant is found from scratch by the state machine, with no hint, within a
bounded derandomized budget, and its counterexample minimises to a short trace."""

import time

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from kvprop.repro.minimise import minimise
from kvprop.search import profiles
from kvprop.search.execute import execute
from kvprop.search.machine import failure_trace, machine_for, trace_length
from kvprop.targets.variants import VARIANTS

BUDGET = 1000  # examples under the ci profile; each variant is found well inside it (see the README)
# The state machine's find of the motivating bug carries async loads (FinishLoad steps) that the
# minimiser keeps: 12 steps in the CI run, against 5 for a walk's find.
MAX_SHRUNK = {"interleaved-external-alloc": 16}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_machine_finds_variant_from_scratch(variant, record_property):
    profiles.register()
    machine = machine_for(variant)
    start = time.perf_counter()
    with pytest.raises(BaseException) as info:  # noqa: B017 - any failure of the machine is the finding
        run_state_machine_as_test(machine, settings=settings(settings.get_profile("ci"), max_examples=BUDGET))
    assert not isinstance(info.value, (KeyboardInterrupt, SystemExit))
    found_after = time.perf_counter() - start
    best = minimise(failure_trace(machine), variant=variant)
    assert execute(best, variant=variant) is not None, "the minimised trace must still fail"
    assert execute(best, variant=None) is None, "the minimised trace must pass on the correct allocator"
    length = trace_length(best)
    record_property("examples", machine.counters["examples"])
    record_property("seconds_to_find", round(found_after, 2))
    record_property("shrunk_steps", length)
    print(
        f"{variant}: found after {machine.counters['examples']} examples ({found_after:.1f}s), "
        f"minimised to {length} steps"
    )
    assert length <= MAX_SHRUNK.get(variant, 12)


# What catches each variant when kvprop's allocator runs without its own guards: always an
# invariant, never a guard or a crash (an allocator under test need not have guards).
CAUGHT_WITHOUT_GUARDS = {
    "interleaved-external-alloc": "block-in-two-groups",
    "touch-before-capacity-check": "cached-count-behind",
    "evict-keeps-hash": "cache-map-stale",
    "swa-skip-off-by-one": "null-in-attended-range",
    "hits-recached": "events-diverge",
    "free-during-async-load": "freed-request-remains",
    "loads-unreserved": "liveness",
    "capacity-overcount": "spurious-refusal",
    "hit-stops-early": "hit-too-short",
    "free-keeps-cached-count": "freed-request-remains",
    "accepts-negative-external": "misuse-accepted",
    "retention-tail-short": "cached-block-lost-hash",
    "eviction-unannounced": "events-diverge",
    "state-cached-early": "data-mismatch",
    "state-retired-early": "null-in-attended-range",
    "cache-past-computed": "data-mismatch",
    "draft-slots-returned": "table-rewritten",
}


def test_the_guard_free_table_names_every_variant():
    assert sorted(CAUGHT_WITHOUT_GUARDS) == sorted(VARIANTS)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_walker_finds_variant_by_an_invariant_with_the_guards_off(variant, monkeypatch):
    from kvprop.allocator import guards
    from kvprop.search.walk import run_walk

    monkeypatch.setattr(guards, "ENABLED", False)
    failure = next(f for f in (run_walk(seed, variant=variant).failure for seed in range(3000)) if f is not None)
    assert (failure.origin, failure.kind) == ("violation", CAUGHT_WITHOUT_GUARDS[variant])
