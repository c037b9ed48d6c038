"""The values of a configuration drawn after every other, from the sampler's side stream.

A knob added to the sampler draws here, last, so that every value drawn before it, and the
operations after, keep their seeds (seeds quoted in notes, tests and bug reports stay valid):
the pipeline depth, then the external tier's size and policy.
"""

from __future__ import annotations

import attrs

from kvprop.allocator.specs import TIER_POLICIES, EngineConfig, pipeline_problem
from kvprop.capabilities import Shapes


def late_draws(side, config: EngineConfig, shapes: Shapes) -> EngineConfig:
    return offload_tier(side, pipeline_depth(side, config, shapes), shapes)


def offload_tier(side, config: EngineConfig, shapes: Shapes) -> EngineConfig:
    """A tier of a quarter, half or all of the GPU pool in three of five shapes with a connector, so
    saves evict (twice the pool, the default, rarely fills in a walk), with either eviction
    policy, in chunks of 2 or 4 blocks in half the shapes where the target takes chunks; drawn
    after the pipeline depth, so that every value drawn before keeps its seed. Drawn only for a
    target that names the options (vLLM's scheduler, whose CPU tier they size): kvprop's own
    tier runs size and policy from a trace or a configuration, and drawing them for it would
    move every connector walk that the variants' shipped seeds find (tests/test_tier.py holds
    its policies)."""
    if config.connector == "off" or shapes.options is None or "tier_blocks" not in shapes.options:
        return config
    num_blocks = config.allocator.num_blocks
    blocks = side.pick((None, None, max(1, num_blocks // 4), max(1, num_blocks // 2), num_blocks))
    config = attrs.evolve(config, tier_blocks=blocks, tier_policy=side.pick(TIER_POLICIES))
    if "tier_chunk" not in shapes.options:
        return config
    chunk = side.pick((1, 1, 2, 4))
    return config if blocks is not None and blocks < chunk else attrs.evolve(config, tier_chunk=chunk)


def pipeline_depth(side, config: EngineConfig, shapes: Shapes) -> EngineConfig:
    """Batches in flight in half the shapes that can have them, 2 and 3 alike (vLLM's asynchronous
    scheduler, and that with two pipeline stages); drawn last, so that every value drawn before
    keeps its seed. The order is one whose draws under the CI profile of the state machine reach
    both depths (tests/test_machine.py)."""
    if not shapes.builds("pipeline_depth") or pipeline_problem(config) is not None:
        return config
    return attrs.evolve(config, pipeline_depth=side.pick((1, 1, 3, 2)))
