"""vLLM's asynchronous scheduler with batches in flight (``pipeline_depth`` 2 and 3) through
kvprop's batch queue (docs/design.md §3, "The pipelined scheduler"); skipped where vLLM is absent."""

from __future__ import annotations

import os
from pathlib import Path

import attrs
import pytest
from packaging.version import Version

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
vllm = __import__("vllm") if os.environ.get("KVPROP_REQUIRE_VLLM") else pytest.importorskip("vllm")

from kvprop.allocator.specs import AllocatorConfig, EngineConfig, FullAttention, SlidingWindow  # noqa: E402
from kvprop.check.checker import Checker, drain  # noqa: E402
from kvprop.search.signature import read_triaged, signature_of  # noqa: E402
from kvprop.search.walk import plan, run_walk  # noqa: E402
from kvprop.sim.events import EV_DEFERRED_FREE, EV_PREEMPT, PIPELINE_EVENTS  # noqa: E402
from kvprop.targets import build_engine  # noqa: E402
from kvprop.targets.vllm.config import batches_in_flight  # noqa: E402
from kvprop.targets.vllm.loading import import_scheduler  # noqa: E402
from kvprop.targets.vllm.releases import scheduler_refusal  # noqa: E402

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(import_scheduler().AsyncScheduler is None, reason="this vLLM has no asynchronous scheduler"),
]

PROMPTS = ([1, 2, 3, 1, 2, 3, 1], [1, 2, 3, 1, 2, 3, 2, 2], [3, 3, 1])


TRIAGED = read_triaged(Path(__file__).parents[1] / "findings" / "triaged.json")


def config(depth: int, num_blocks: int = 24, connector: str = "off") -> EngineConfig:
    allocator = AllocatorConfig((FullAttention(4), SlidingWindow(4, 8)), num_blocks)
    return EngineConfig(allocator, token_budget=6, vocab=4, pipeline_depth=depth, connector=connector)


def run(cfg: EngineConfig, max_new_tokens: int = 5):
    """The engine once the workload drains with every check, and every request's tokens."""
    checker = Checker()
    engine = build_engine(cfg, target="vllm-scheduler", hooks=checker)
    requests = [engine.add_request(list(prompt), max_new_tokens) for prompt in PROMPTS]
    drain(engine, checker)
    return engine, [list(r.tokens) for r in requests]


def outputs(cfg: EngineConfig) -> list:
    return run(cfg)[1]


@pytest.mark.parametrize("depth", [2, 3])
def test_the_scheduler_built_is_the_asynchronous_one_with_depth_batches_in_flight(depth):
    engine = build_engine(config(depth), target="vllm-scheduler")
    vllm_config = engine.scheduler.vllm_config
    assert (type(engine.scheduler).__name__, batches_in_flight(vllm_config)) == ("AsyncScheduler", depth)


@pytest.mark.parametrize("depth", [2, 3])
def test_outputs_with_batches_in_flight_are_the_synchronous_ones(depth):
    assert outputs(config(depth)) == outputs(config(1))


@pytest.mark.parametrize("depth", [2, 3])
def test_outputs_under_preemption_with_batches_in_flight_are_the_synchronous_ones(depth):
    """A pool that preempts: a request preempted with its batch in flight is admitted again only
    once that output is back (vLLM's stale outputs)."""
    small = config(depth, num_blocks=11)
    engine, tokens = run(small)
    assert (engine.events[EV_PREEMPT] > 0, tokens) == (True, outputs(attrs.evolve(small, pipeline_depth=1)))


@pytest.mark.parametrize(("depth", "connector"), [(2, "sync"), (3, "async"), (1, "sync"), (2, "off")])
def test_the_deferred_free_fence_is_on_where_the_release_sets_it(depth, connector):
    """``defer_block_free``: batches in flight beside a connector that loads, from 0.24.0."""
    engine = build_engine(config(depth, connector=connector), target="vllm-scheduler")
    fenced = vars(engine.scheduler).get("defer_block_free", False)
    assert fenced == (import_scheduler().fences_frees and depth > 1 and connector != "off")


@pytest.mark.parametrize("connector", ["sync", "async"])
def test_outputs_beside_a_connector_with_batches_in_flight_are_the_synchronous_ones(connector):
    assert outputs(config(2, connector=connector)) == outputs(config(1, connector=connector))


@pytest.mark.skipif(not import_scheduler().fences_frees, reason="this vLLM has no deferred-free fence")
def test_an_abort_while_its_batch_is_in_flight_frees_its_blocks_once_the_batch_is_back():
    """The request's blocks leave it at once, held by the fence (invariant 1 counts them), and
    return to the pool with the batch's output."""
    checker = Checker()
    engine = build_engine(config(2, connector="sync"), target="vllm-scheduler", hooks=checker)
    request = engine.add_request([1, 2, 3, 1, 2, 3, 1], 5)
    engine.step()
    engine.abort(request.request_id)
    checker.check_all(engine)
    held = sum(engine.fenced_blocks().values())
    drain(engine, checker)
    actual = (held > 0, engine.events[EV_DEFERRED_FREE], sum(engine.fenced_blocks().values()))
    assert actual == (True, 1, 0)


def pipelined_seeds(depth: int, count: int) -> list[int]:
    """Walk seeds whose configuration this target drives at ``depth``."""
    seeds, seed = [], 0
    while len(seeds) < count:
        trace = plan(seed)
        if trace.config.pipeline_depth == depth and scheduler_refusal(trace.config) is None:
            seeds.append(seed)
        seed += 1
    return seeds


@pytest.mark.skipif(
    Version(vllm.__version__).release[:2] < (0, 30),
    reason="before 0.30.0 walks with batches in flight end in finds not triaged yet (docs/findings.md, "
    "'Batches in flight before 0.30.0')",
)
@pytest.mark.parametrize("depth", [2, 3])
def test_walks_with_batches_in_flight_reach_them_and_find_nothing_but_the_triaged_bugs(depth):
    """Six walks at ``depth``: none ends in a find the triaged findings do not name
    (findings/triaged.json: a key two blocks hold, announced per block, forgotten by a router's
    set, and the others docs/findings.md reports)."""
    results = [run_walk(seed, target="vllm-scheduler") for seed in pipelined_seeds(depth, 6)]
    reached = sum(PIPELINE_EVENTS[depth - 2] in r.events for r in results)
    new = [
        signature_of(attrs.evolve(r.trace, failure=r.failure)).key
        for r in results
        if r.failure and signature_of(attrs.evolve(r.trace, failure=r.failure)).key not in TRIAGED
    ]
    assert (reached > 0, new) == (True, [])
