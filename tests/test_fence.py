"""The deferred-free fence of kvprop's own engine (kvprop.sim.fence; docs/design.md §3, "The
deferred-free fence"): with batches in flight beside a connector that loads, a request's blocks
wait for its last batch."""

from __future__ import annotations

from kvprop.allocator.specs import AllocatorConfig, EngineConfig, FullAttention
from kvprop.check.checker import Checker, drain
from kvprop.search.alphabet import Preempt
from kvprop.search.harness import Harness
from kvprop.sim.events import EV_DEFERRED_FREE
from kvprop.sim.fence import FreeFence
from kvprop.targets import build_engine

PROMPT = [1, 2, 3, 1, 2, 3, 1]


def config(depth: int = 2, connector: str = "sync") -> EngineConfig:
    return EngineConfig(
        AllocatorConfig((FullAttention(4),), 16), token_budget=8, pipeline_depth=depth, connector=connector
    )


def test_a_deferred_free_is_released_once_the_step_it_waits_for_is_processed():
    fence = FreeFence()
    fence.batch_scheduled()
    fence.defer([3, 4])
    fence.batch_scheduled()
    fence.defer([5])
    assert (fence.batch_processed(), fence.batch_processed(), dict(fence.held())) == ([[3, 4]], [[5]], {})


def test_the_fence_holds_frees_only_beside_a_connector_with_batches_in_flight():
    fenced = [
        config(depth, connector).fences_frees
        for depth, connector in ((2, "sync"), (3, "async"), (1, "sync"), (2, "off"))
    ]
    assert fenced == [True, True, False, False]


def test_an_abort_while_its_batch_is_in_flight_frees_its_blocks_once_the_batch_is_back():
    checker = Checker()
    engine = build_engine(config(), hooks=checker)
    request = engine.add_request(list(PROMPT), 4)
    engine.step()
    engine.abort(request.request_id)
    checker.check_all(engine)
    held = sum(engine.fenced_blocks().values())
    drain(engine, checker)
    actual = (held, engine.events[EV_DEFERRED_FREE], sum(engine.fenced_blocks().values()), engine.view.num_free_blocks)
    assert actual == (2, 1, 0, 15)


def test_a_request_the_fence_holds_is_not_preempted():
    harness = Harness(config())
    harness.add_request(list(PROMPT), 4)
    harness.engine.step()
    outcome = Preempt(0).apply(harness)
    assert outcome == "not made: r0's last batch is in flight: a preemption would only defer its free"
