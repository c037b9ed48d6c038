"""The shapes each vLLM target builds for the release installed, as kvprop models them: the sampler draws only these.

The releases' own rules (``releases``) say why each other shape is refused; the registry names
these functions (``kvprop.targets.protocol``), evaluated where the target runs.
"""

from __future__ import annotations

import attrs

from kvprop.allocator.specs import AllocatorConfig, ChunkedLocal, EngineConfig, FullAttention
from kvprop.capabilities import Shapes
from kvprop.errors import ConfigError
from kvprop.targets.vllm.config import build_scheduler
from kvprop.targets.vllm.loading import import_scheduler, import_vllm
from kvprop.targets.vllm.releases import (
    checkpoint_refusal,
    has_full_report,
    partial_hits_refusal,
    takes_blocks_per_chunk,
    takes_connector_with_state_groups,
)
from kvprop.targets.vllm.spec_classes import release_layouts


def release_shapes() -> Shapes:
    """The shapes this vLLM release builds as kvprop models them (``allocator_refusal`` says
    why each other one is refused): the sampler draws only these."""
    v = import_vllm()  # without vLLM, the ConfigError that says how to get it
    return Shapes(
        hits_inside_blocks=partial_hits_refusal() is None,
        checkpoints=checkpoint_refusal() is None,
        full_report=has_full_report(),
        options=MAPPED_OPTIONS,
        page_layouts=release_layouts(v),
    )


# The self-drawn options (kvprop.allocator.options) both vLLM targets build: max_num_seqs is kvprop's
# scheduler's in front of the manager, and SchedulerConfig.max_num_seqs for vLLM's own scheduler.
MAPPED_OPTIONS = frozenset({"max_num_seqs"})
# The CPU tier of vLLM's offloading connector behind its scheduler: its size and eviction policy
# (cpu_bytes_to_use, eviction_policy; every release kvprop builds takes both, v1/kv_offload/cpu/spec.py),
# and from 0.30.0 its chunk (blocks_per_chunk, takes_blocks_per_chunk).
TIER_OPTIONS = frozenset({"tier_blocks", "tier_policy"})


def scheduler_shapes() -> Shapes:
    """The shapes kvprop drives through this release's scheduler (``scheduler_refusal`` says why each
    other one is refused): the manager's, less lookahead slots and the EAGLE drop, with a token
    budget for the drafts, and a state group beside a connector where the release takes one. Its
    pages are plain: the scheduler's model configuration is a tiny Llama, whose layers declare
    plain attention specs, so an MLA or quantised group would be a model vLLM never starts."""
    import_scheduler()  # without vLLM, the ConfigError that says how to get it
    return attrs.evolve(
        release_shapes(),
        lookahead=False,
        eagle=False,
        drafts_within_budget=True,
        state_with_connector=takes_connector_with_state_groups(),
        local_with_connector=_builds(_LOCAL_WITH_CONNECTOR),
        page_layouts=frozenset({"plain"}),
        # batches in flight through its asynchronous scheduler, where the release has one
        options=MAPPED_OPTIONS
        | TIER_OPTIONS
        | ({"tier_chunk"} if takes_blocks_per_chunk() else set())
        | ({"pipeline_depth"} if import_scheduler().AsyncScheduler is not None else set()),
    )


# A chunked-local group beside the offloading connector: 0.24.0's connector asserts every
# group is full attention or a window (``get_sliding_window_size_in_blocks``); 0.34.0 takes it.
_LOCAL_WITH_CONNECTOR = EngineConfig(
    AllocatorConfig((ChunkedLocal(4, 8), FullAttention(4)), 16), token_budget=8, connector="async"
)


def _builds(config: EngineConfig) -> bool:
    """Whether this release's own start-up builds a scheduler for ``config``: its validation
    called, not re-implemented."""
    try:
        build_scheduler(config)
    except ConfigError:
        return False
    return True
