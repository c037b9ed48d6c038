"""What kvprop knows of each vLLM release: what each one's targets accept, and how ``agree`` walks it.

kvprop's allocator models vLLM 0.33.0's rules without the bugs found in them. A release from
before 0.33.0 lacks parts of that model, and every release from 0.30.0 on has known bugs that
kvprop fixes (docs/findings.md). The targets refuse what the installed release cannot run as
kvprop models it (``allocator_refusal``, ``scheduler_refusal``: each names itself and the
release), told from the release's own code, never from its version number. The step-for-step
comparison leaves the parts a release lacks out of its walks and runs kvprop's allocator as the
release's known bugs (``reference_variant``), so that everything else is still compared: one
table, read by ``kvprop agree --release-rules``, the vLLM tests and ``scripts/matrix.sh``.
"""

from __future__ import annotations

import functools
import inspect

from kvprop.allocator.specs import AllocatorConfig, EngineConfig, Mamba
from kvprop.targets.vllm.loading import import_scheduler

# Every release announces each block cached or evicted under a key (invariant 17's find).
EVERY_COPY = "announces-every-copy"
# The rules of 0.33.0's finds (docs/findings.md), each a variant of kvprop's allocator.
RULES_0_33 = f"checkpoint-over-running-state+reannounces-every-position+copy-before-compute+{EVERY_COPY}"


def release_rules(release: tuple[int, ...]) -> dict:
    """``agree``'s options for vLLM ``release`` (its first two numbers count).

    - every release: the block pool announces each block cached or evicted under a key
      (``announces-every-copy``);
    - before 0.30.0: no shared-prefix junction (walks without retention or state groups), no
      prefill checkpoints, no full KV cache report;
    - 0.30.0 to 0.32: hits inside a block and checkpoints follow other rules (hits end on
      block boundaries, no checkpoints); the full report announces every position;
    - 0.33.0 and 0.34.0: kvprop's model, with the three known rules of 0.33.0 (0.34.0 changed
      none of the code they live in: ``single_type_kv_cache_manager.py`` and the report's
      ``emit_cached_block_events`` are the same, and the agreement holds over the tests' walks).
    """
    release = tuple(release[:2])
    if release < (0, 30):
        return {
            "no_junction": True,
            "no_checkpoints": True,
            "incremental_report": True,
            "reference_variant": EVERY_COPY,
        }
    if release < (0, 33):
        return {
            "block_hits": True,
            "no_checkpoints": True,
            "reference_variant": f"reannounces-every-position+{EVERY_COPY}",
        }
    return {"reference_variant": RULES_0_33}


def as_flags(rules: dict) -> str:
    """The same options as ``kvprop agree`` flags."""
    flags = [f"--{name.replace('_', '-')}" for name, value in rules.items() if value is True]
    if rules.get("reference_variant"):
        flags.append(f"--reference-variant {rules['reference_variant']}")
    return " ".join(flags)


# ---- what each release accepts ---------------------------------------------------------


@functools.cache
def null_count_fixed() -> bool:
    """Whether this release keeps its null block's reference count at 0 (``Capabilities.
    null_count_fixed``): from 0.33.0 ``BlockPool.touch`` and ``free_blocks`` skip the null
    block; before, both counted it, a count the release calls "not maintained". The release's
    source is read as text, once."""
    from vllm.v1.core.block_pool import BlockPool

    return all("if block.is_null:" in inspect.getsource(f) for f in (BlockPool.touch, BlockPool.free_blocks))


def partial_hits_refusal() -> str | None:
    """Why this release cannot run hits inside a block as kvprop models them, or None. They
    exist from 0.30.0 (``HybridKVCacheCoordinator.enable_partial_hash_hits``;
    ``BlockPool.cache_partial_block`` exists from 0.24.0 with no caller), and kvprop's checks
    follow 0.33.0's rules: the state group keys the prompt's last unit boundary below its
    last token (``get_mamba_prefill_checkpoint_position``), where 0.30.0 keys the last one at
    or below its length. The release's source is read as text, once."""
    from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    if "enable_partial_hash_hits" not in inspect.getsource(HybridKVCacheCoordinator):
        return "it has no hits inside a block (prefix_match_unit, 0.30.0 on)"
    tail = inspect.getsource(MambaManager._cache_partial_tail_block)
    if "latest_prompt_hash_boundary = get_mamba_prefill_checkpoint_position" not in tail:
        return (
            "its hits inside a block follow other rules than the 0.33.0 ones kvprop models (its state "
            "group keys the prompt's last unit boundary at or below the prompt's length)"
        )
    return None


@functools.cache
def checkpoint_refusal() -> str | None:
    """Why this release cannot save prefill checkpoints as kvprop models them, or None. They
    exist from 0.30.0 (``MambaSpec.num_prefill_checkpoint_blocks``); kvprop follows 0.33.0,
    whose manager reserves a checkpoint column only in the chunk reaching the prefill's end
    under retention interval 0 (``_needs_internal_checkpoint``'s ``prefill_end``), where
    0.30.0 reserves one in every chunk that saves one."""
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    check = getattr(MambaManager, "_needs_internal_checkpoint", None)
    if check is None:
        return "it has no prefill checkpoints (MambaSpec.num_prefill_checkpoint_blocks, 0.30.0 on)"
    if "prefill_end" not in inspect.signature(check).parameters:
        return "its prefill checkpoints follow other rules than the 0.33.0 ones kvprop models"
    return None


@functools.cache
def _has_eagle_margin() -> bool:
    from vllm.v1.core import kv_cache_utils

    return hasattr(kv_cache_utils, "eagle_proof_margin")


def eagle_refusal(config: AllocatorConfig) -> str | None:
    """Why this release cannot run the EAGLE drop as kvprop models it, or None. One group drops
    its last block alike in every release measured (0.24.0 agrees step for step); with two
    groups kvprop follows 0.33.0, whose groups look one block past the candidate before they
    drop (``eagle_proof_margin``), which earlier releases lack."""
    if not config.eagle or len(config.groups) < 2 or _has_eagle_margin():
        return None
    return (
        "its EAGLE drop in a hybrid model follows other rules than the 0.33.0 ones kvprop models "
        "(no eagle_proof_margin)"
    )


@functools.cache
def has_full_report() -> bool:
    from vllm.v1.core.block_pool import BlockPool

    return hasattr(BlockPool, "emit_cached_block_events")


def allocator_refusal(config: AllocatorConfig) -> str | None:
    """What this release's allocator cannot take as kvprop models it, or None: the one list both
    vLLM targets refuse from, each naming itself and the release ("takes no ...")."""
    if config.partial_hits and (why := partial_hits_refusal()) is not None:
        return (
            f"no hash_unit below the block size here: {why}; hash_unit must be None or the block size, "
            f"got {config.hash_unit}"
        )
    checkpoint = next((g.checkpoint for g in config.groups if getattr(g, "checkpoint", None) is not None), None)
    if checkpoint is not None and (why := checkpoint_refusal()) is not None:
        return f"no prefill checkpoints here: {why}; Mamba.checkpoint must be None, got {checkpoint}"
    if config.kv_cache_report_mode == "full" and not has_full_report():
        return (
            "no full KV cache report here (kv_cache_report_mode, 0.30.0 on); kv_cache_report_mode must be "
            "'incremental', got 'full'"
        )
    if (why := eagle_refusal(config)) is not None:
        return f"no EAGLE drop with two groups here: {why}"
    return None


def scheduler_refusal(config: EngineConfig) -> str | None:
    """Why the scheduler target cannot run ``config`` yet, or None: what the manager target
    refuses, and what kvprop does not drive through vLLM's scheduler."""
    if config.lookahead:
        return (
            f"lookahead slots are not driven through vLLM's scheduler (lookahead={config.lookahead}; allowed: 0): "
            "vLLM derives them from an EAGLE drafter's own forward pass, which kvprop does not model"
        )
    if config.speculative_tokens and config.token_budget < 1 + config.speculative_tokens:
        # vLLM pads (0.30.0 on) a request whose hit leaves one token to 1 + K rows and, when they
        # do not fit the step's budget, schedules nothing rather than one row: with a budget under
        # 1 + K such a request waits forever (docs/findings.md)
        return (
            f"with {config.speculative_tokens} drafts vLLM's scheduler needs a token budget of at least "
            f"{1 + config.speculative_tokens} (token_budget={config.token_budget})"
        )
    if config.max_num_seqs is not None and config.token_budget < config.max_num_seqs:
        # SchedulerConfig refuses it at start-up (vllm/config/scheduler.py, 0.22.1 to 0.34.0)
        return (
            f"vLLM's scheduler needs a token budget of at least max_num_seqs (token_budget={config.token_budget}, "
            f"max_num_seqs={config.max_num_seqs}): SchedulerConfig refuses max_num_batched_tokens < max_num_seqs"
        )
    if config.pipeline_depth > 1 and import_scheduler().AsyncScheduler is None:
        return (
            f"this vLLM has no asynchronous scheduler (vllm/v1/core/sched/async_scheduler.py), so it keeps one "
            f"batch in flight; pipeline_depth must be 1, got {config.pipeline_depth}"
        )
    if config.tier_chunk > 1 and not takes_blocks_per_chunk():
        return (
            f"this vLLM's offloading connector has no blocks_per_chunk (0.30.0 on), so tier_chunk must be 1, got "
            f"{config.tier_chunk}"
        )
    if config.allocator.eagle:
        return (
            "the EAGLE drop is not driven through vLLM's scheduler (eagle must be False): it drafts by "
            "n-grams here, and an EAGLE or MTP drafter needs a draft model's configuration"
        )
    if config.connector != "off" and any(isinstance(spec, Mamba) for spec in config.allocator.groups):
        if not takes_connector_with_state_groups():
            return "this vLLM's scheduler does not take a KV connector with a Mamba group (it asserts so)"
    why = allocator_refusal(config.allocator)
    return None if why is None else f"this vLLM takes {why}"


@functools.cache
def takes_connector_with_state_groups() -> bool:
    """0.22.1 asserts in ``_mamba_block_aligned_split`` that no external tokens reach a state group
    ("External KV connector is not verified yet"). The release's source is read as text, once."""
    split = inspect.getsource(import_scheduler().Scheduler._mamba_block_aligned_split)
    return "External KV connector is not verified yet" not in split


@functools.cache
def takes_blocks_per_chunk() -> bool:
    """Whether the offloading connector reads ``blocks_per_chunk`` from its extra configuration
    (0.30.0 on: ``offloading/config.py``); before, it ignores the key and keeps one block per chunk."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading import config
    except ImportError:
        return False
    return "blocks_per_chunk" in inspect.getsource(config)
