"""The fast seeded swarm walker: the same operations and checks as the state machine,
without Hypothesis's per-step cost.

Each run draws its configuration, its operation weights (some operations switched off) and
its length from its seed, then each operation, as the state machine does, by those weights
among the operations that would do something now (``ready_operations``), from the engine as
it stands. A run is reproducible from its seed and the kvprop version on the same target;
its trace records the operations it ran, which replay anywhere.
"""

from __future__ import annotations

import functools
import hashlib
import random
from collections.abc import Iterator

import attrs

from kvprop.allocator.specs import EngineConfig
from kvprop.capabilities import ANY_SHAPE, Shapes
from kvprop.errors import ConfigError
from kvprop.search.alphabet import Operation, RandomChooser, ready_operations, sample_config, sample_weights
from kvprop.search.execute import run
from kvprop.search.harness import Harness
from kvprop.search.trace import Failure, Trace
from kvprop.targets import shapes_of


@attrs.frozen
class WalkStart:
    """What a seed decides before the first operation; ``rng`` then draws every operation."""

    rng: random.Random
    config: EngineConfig
    weights: tuple
    length: int


def start(seed: int, max_ops: int = 200, num_blocks: int | None = None, shapes: Shapes = ANY_SHAPE) -> WalkStart:
    """``num_blocks``: the pool fixed at that size instead of the sampled one (benchmarks);
    ``shapes``: the configurations the target declares it builds."""
    rng = random.Random(seed)
    config = sample_config(RandomChooser(rng), shapes)
    weights = sample_weights(RandomChooser(rng))
    if num_blocks is not None:
        config = attrs.evolve(config, allocator=attrs.evolve(config.allocator, num_blocks=num_blocks))
    return WalkStart(rng, config, weights, rng.randint(max_ops // 4, max_ops))


def operations(begun: WalkStart, harness: Harness, taken: list[Operation]) -> Iterator[Operation]:
    """The walk's operations, each drawn when the one before it has run (into ``taken``)."""
    rng = begun.rng
    for _ in range(begun.length):
        ready = ready_operations(begun.weights, harness)
        if not ready:
            return
        op_class = rng.choices([op for op, _ in ready], [weight for _, weight in ready])[0]
        op = op_class(**{k: rng.randint(lo, hi) for k, (lo, hi) in op_class.ARGS.items()})
        taken.append(op)
        yield op


@functools.lru_cache(maxsize=4096)
def plan(seed: int, max_ops: int = 200, on: str | None = None) -> Trace:
    """The trace walk ``seed`` runs on kvprop's own allocator, or on target ``on`` with the
    shapes it builds (drawn without checks): a fixed trace, which tests and the agreement check
    replay on other allocators. A ConfigError where ``on`` refuses the drawn configuration."""
    begun = start(seed, max_ops) if on is None else start(seed, max_ops, shapes=shapes_of(on))
    harness = Harness(begun.config, checks=False, target=on)
    taken: list[Operation] = []
    run(harness, operations(begun, harness, taken), drain=False)
    # guarded, whatever the setting of the process that first asked (the plan is cached)
    return Trace(config=begun.config, steps=tuple(taken), seed=seed, driver="walk", guards=True)


def walk_seed(run_seed: int, index: int) -> int:
    """The seed of a campaign's run ``index``, whichever worker or machine runs it: a hash, so
    campaigns whose seeds differ by one explore unrelated walks. (The ``0`` in the hashed text
    keeps the seeds of campaigns from before runs were numbered across workers.)"""
    digest = hashlib.blake2b(f"kvprop-walk:{run_seed}:0:{index}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big")


@attrs.frozen
class WalkResult:
    trace: Trace
    failure: Failure | None
    steps_run: int
    events: frozenset
    refused: str | None = None  # the target refused this configuration: why (no steps ran)


def run_walk(
    seed: int,
    variant=None,
    target=None,
    device=None,
    max_ops: int = 200,
    checks: bool = True,
    canary: bool = False,
    num_blocks: int | None = None,
    on_step=None,
    journal=None,
    index: int | None = None,
) -> WalkResult:
    """One walk, drawn on the allocator it runs on. A configuration the target cannot build
    (``ConfigError`` from its factory) is refused: zero steps, no failure, and the reason is
    reported (never a silent skip). ``journal`` (in a supervised worker) records the walk as it
    goes, with ``index``, its place in the worker's walks."""
    begun = start(seed, max_ops, num_blocks, shapes_of(target))
    if journal is not None:
        header = Trace(config=begun.config, steps=(), seed=seed, driver="walk", variant=variant, target=target)
        journal.begin(header, index)
    try:
        harness = Harness(
            begun.config, variant=variant, target=target, device=device, checks=checks, canary=canary, journal=journal
        )
    except ConfigError as e:
        if target in (None, "kvprop"):
            raise
        trace = Trace(config=begun.config, steps=(), seed=seed, driver="walk", variant=variant, target=target)
        return WalkResult(trace, None, 0, frozenset(), refused=str(e))
    taken: list[Operation] = []
    try:
        failure = run(harness, operations(begun, harness, taken), drain=True, on_step=on_step)
    finally:
        events = frozenset(harness.engine.events)
    trace = Trace(config=begun.config, steps=tuple(taken), seed=seed, driver="walk", variant=variant, target=target)
    # operations run and the drain, or up to the one that failed
    steps_run = len(taken) + (failure is None or failure.step >= len(taken))
    return WalkResult(trace, failure, steps_run, events)
