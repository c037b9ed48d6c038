"""The fast seeded swarm walker: the same operations and checks as the state machine,
without Hypothesis's per-step cost.

Each run draws its configuration, its operation weights (some operations switched off)
and its operations from its seed alone, so a run is reproducible from the seed and the
kvprop version.
"""

from __future__ import annotations

import hashlib
import random

import attrs

from kvprop.errors import ConfigError
from kvprop.search.alphabet import OPERATIONS, RandomChooser, sample_config, sample_weights
from kvprop.search.execute import execute
from kvprop.search.trace import Failure, Trace


def plan(seed: int, max_ops: int = 200) -> Trace:
    """The trace a walk with ``seed`` runs: configuration, swarm weights, operations."""
    rng = random.Random(seed)
    config = sample_config(RandomChooser(rng))
    weights = sample_weights(RandomChooser(rng))
    steps = []
    for _ in range(rng.randint(max_ops // 4, max_ops)):
        op = rng.choices(OPERATIONS, weights)[0]
        steps.append(op(**{k: rng.randint(lo, hi) for k, (lo, hi) in op.ARGS.items()}))
    return Trace(config=config, steps=tuple(steps), seed=seed, driver="walk")


def walk_seed(run_seed: int, worker: int, index: int) -> int:
    """The seed of a fuzz run's ``index``-th walk in ``worker``: a hash, so runs whose seeds
    differ by one, and workers of one run, explore unrelated walks."""
    digest = hashlib.blake2b(f"kvprop-walk:{run_seed}:{worker}:{index}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big")


@attrs.frozen
class WalkResult:
    trace: Trace
    failure: Failure | None
    steps_run: int
    events: frozenset
    refused: str | None = None  # the target refused this configuration: why (no steps ran)


def run_walk(
    seed: int, variant=None, target=None, device=None, max_ops: int = 200, checks: bool = True, canary: bool = False
) -> WalkResult:
    """One walk. A configuration the target cannot build (``ConfigError`` from its factory) is
    refused: zero steps, no failure, and the reason is reported (never a silent skip)."""
    trace = attrs.evolve(plan(seed, max_ops), variant=variant, target=target)
    events = set()
    count = [0]

    def on_step(i, op, outcome):
        count[0] += 1

    try:
        failure = execute(
            trace,
            variant=variant,
            target=target,
            device=device,
            on_step=on_step,
            checks=checks,
            events=events,
            canary=canary,
        )
    except ConfigError as e:
        if target in (None, "kvprop"):
            raise
        return WalkResult(trace, None, 0, frozenset(), refused=str(e))
    return WalkResult(trace, failure, count[0] + (failure is not None), frozenset(events))
