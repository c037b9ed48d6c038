"""Attention specs and allocator configuration.

Every value is validated at construction so that a bad configuration fails where it is
written, with a message that names the field and the allowed range.

About 500 lines on purpose: every configuration option is declared here, once
(``kvprop.allocator.options``), beside the rules that relate it to the others.
"""

from __future__ import annotations

from typing import TypeAlias

import attrs

from kvprop.allocator.options import declared, option, smaller
from kvprop.errors import ConfigError

MAX_GROUPS = 8
# Upper bounds a real run stays far below; they keep a hostile or mistyped value from
# hanging the harness or exhausting memory (paged memory holds num_blocks x block_size int64).
MAX_BLOCK_SIZE = 1 << 12
MAX_TOKENS = 1 << 20
MAX_SLOTS = 1 << 24


def _int_at_least(lo: int, hi: int | None = None):
    """An integer >= ``lo``; at most ``hi`` where the field has a range of its own, else at most
    MAX_TOKENS (a bound no real run nears, so a mistyped value fails instead of hanging)."""

    def check(instance, attribute, value):
        name = f"{type(instance).__name__}.{attribute.name}"
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name} must be an integer, got {value!r}")
        if hi is not None and not lo <= value <= hi:
            raise ConfigError(f"{name} must be in [{lo}, {hi}], got {value}")
        if value < lo:
            raise ConfigError(f"{name} must be >= {lo}, got {value}")
        if value > MAX_TOKENS:
            raise ConfigError(f"{name} must be <= {MAX_TOKENS:,}, got {value:,}")

    return check


def _block_size(instance, attribute, value):
    _int_at_least(1)(instance, attribute, value)
    if value > MAX_BLOCK_SIZE:
        raise ConfigError(f"{type(instance).__name__}.block_size must be <= {MAX_BLOCK_SIZE}, got {value:,}")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@attrs.frozen
class FullAttention:
    """Every earlier token is attended: nothing is ever skipped."""

    block_size: int = attrs.field(validator=_block_size)
    kind = "full"

    def skipped_tokens(self, num_computed_tokens: int) -> int:
        return 0


@attrs.frozen
class SlidingWindow:
    """Token n attends tokens (n - window, n]: earlier tokens are skipped."""

    block_size: int = attrs.field(validator=_block_size)
    window: int = attrs.field(validator=_int_at_least(1))
    kind = "sliding_window"

    def skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.window + 1)

    @property
    def hit_blocks_needed(self) -> int:
        """Contiguous cached blocks a hit needs to cover the window of its next token."""
        return cdiv(self.window - 1, self.block_size)


@attrs.frozen
class ChunkedLocal:
    """Token n attends only the tokens of its own chunk of ``chunk`` tokens."""

    block_size: int = attrs.field(validator=_block_size)
    chunk: int = attrs.field(validator=_int_at_least(1))
    kind = "chunked_local"

    def __attrs_post_init__(self):
        if self.chunk % self.block_size:
            raise ConfigError(
                f"ChunkedLocal.chunk must be a multiple of block_size={self.block_size}, got {self.chunk}"
            )

    def skipped_tokens(self, num_computed_tokens: int) -> int:
        return (num_computed_tokens // self.chunk) * self.chunk


MAMBA_MODES = ("none", "align")


def _check_mode(instance, attribute, value):
    if value not in MAMBA_MODES:
        raise ConfigError(f"Mamba.mode must be one of {list(MAMBA_MODES)}, got {value!r}")


def _check_checkpoint(instance, attribute, value):
    if value is not None:
        _int_at_least(1)(instance, attribute, value)


@attrs.frozen
class Mamba:
    """A state-space (Mamba / linear-attention) group: the state after the last computed token
    is all a later token needs (vLLM's ``MambaSpec``, docs/design.md §2 "State-space groups").

    ``mode`` is vLLM's ``mamba_cache_mode``: "align" with prefix caching (states are kept at
    block boundaries and hashed there), "none" without (only the running state is kept)."""

    block_size: int = attrs.field(validator=_block_size)
    mode: str = attrs.field(default="align", validator=_check_mode)
    # vLLM's ``MambaSpec.num_speculative_blocks``: scratch columns after the running state, one
    # per draft, for the states a verification pass computes (equal to the engine's drafts)
    speculative_blocks: int = attrs.field(default=0, validator=_int_at_least(0, 4))
    # vLLM's ``MambaSpec.prefill_checkpoint_alignment`` with ``num_prefill_checkpoint_blocks=1``
    # (0.33.0; mamba_mixer2 sets 1, GDN and KDA layers their kernel's grid): a prefill chunk may
    # also save the state at the prompt's checkpoint inside it, into a column of its own
    # (kvprop.allocator.checkpoint). None: no checkpoint column (vLLM's 0 blocks).
    checkpoint: int | None = attrs.field(default=None, kw_only=True, validator=_check_checkpoint)
    kind = "mamba"

    def __attrs_post_init__(self):
        if self.checkpoint is not None and self.mode != "align":
            raise ConfigError(
                f"Mamba.checkpoint must be None in mode {self.mode!r}: vLLM saves prefill checkpoints only "
                f"in mode 'align' (MambaManager.has_prefill_checkpoint_blocks), got {self.checkpoint}"
            )

    def skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - 1)


SPEC_TYPES = (FullAttention, SlidingWindow, ChunkedLocal, Mamba)
GroupSpec: TypeAlias = FullAttention | SlidingWindow | ChunkedLocal | Mamba  # one group's spec, any kind
THINNED_BY_RETENTION = (SlidingWindow, Mamba)  # the group kinds prefix-cache retention applies to


def _check_groups(instance, attribute, groups):
    if not isinstance(groups, tuple) or not 1 <= len(groups) <= MAX_GROUPS:
        raise ConfigError(
            f"AllocatorConfig.groups must be a tuple of 1 to {MAX_GROUPS} attention specs, got {groups!r}"
        )
    for i, spec in enumerate(groups):
        if not isinstance(spec, SPEC_TYPES):
            raise ConfigError(
                f"AllocatorConfig.groups[{i}] must be one of FullAttention, SlidingWindow, ChunkedLocal, Mamba, "
                f"got {spec!r}"
            )
    sizes = {spec.block_size for spec in groups}
    if len(sizes) != 1:
        raise ConfigError(
            f"AllocatorConfig.groups must all have the same block_size (one shared pool), got {sorted(sizes)}"
        )


def _check_bool(instance, attribute, value):
    if not isinstance(value, bool):
        raise ConfigError(f"{type(instance).__name__}.{attribute.name} must be True or False, got {value!r}")


def _check_retention(instance, attribute, value):
    """vLLM's rule (``_validate_prefix_cache_retention_interval``, 0.30.0 on): None (dense) always;
    a model with no sliding window or Mamba group accepts only 0 (retention thins nothing there); otherwise
    a non-negative multiple of the block size."""
    if value is None:
        return
    name = "AllocatorConfig.retention_interval"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be None or an integer, got {value!r}")
    if not any(isinstance(spec, THINNED_BY_RETENTION) for spec in instance.groups):
        if value != 0:
            raise ConfigError(f"{name} must be None or 0 without a sliding-window or Mamba group, got {value}")
        return
    if value < 0 or value % instance.groups[0].block_size or value > MAX_TOKENS:
        raise ConfigError(
            f"{name} must be None or a multiple of block_size={instance.groups[0].block_size} "
            f"in [0, {MAX_TOKENS:,}], got {value}"
        )


REPORT_MODES = ("incremental", "full")


def _check_report_mode(instance, attribute, value):
    """vLLM's per-request ``kv_cache_report_mode`` (0.30.0 on), here for every request."""
    name = "AllocatorConfig.kv_cache_report_mode"
    if value not in REPORT_MODES:
        raise ConfigError(f"{name} must be one of {list(REPORT_MODES)}, got {value!r}")
    if value == "full" and not instance.enable_kv_cache_events:
        raise ConfigError(f"{name} 'full' needs enable_kv_cache_events=True: it only adds events")


def _check_hash_unit(instance, attribute, value):
    """vLLM's ``prefix_match_unit`` (``resolve_kv_cache_block_sizes``, 0.30.0 on): the token
    granularity of block hashes. Below the block size it enables hits that end inside a block,
    which vLLM allows only with a Mamba "align" group and, besides it, groups whose lookup can
    stop inside a block (full attention; ``partial_hash_hits_enabled``), and only with
    several groups (one group rejects any other unit)."""
    if value is None:
        return
    name = "AllocatorConfig.hash_unit"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be None or an integer, got {value!r}")
    bs = instance.groups[0].block_size
    if value < 1 or bs % value:
        raise ConfigError(f"{name} must be None or a divisor of block_size={bs}, got {value}")
    if value == bs:
        return
    kinds = [type(spec).__name__ for spec in instance.groups]
    if (
        not instance.enable_caching
        or len(kinds) < 2
        or "Mamba" not in kinds
        or any(kind not in ("FullAttention", "Mamba") for kind in kinds)
    ):
        raise ConfigError(
            f"{name} below block_size={bs} needs prefix caching and at least two groups, a Mamba group "
            f"among them and every other one FullAttention (vLLM's partial_hash_hits_enabled), got "
            f"{value} with groups {kinds} and enable_caching={instance.enable_caching}"
        )


# How the attention groups' pages are laid out, as a model's layers declare them to vLLM: each
# layout names the group kinds it applies to (every other group keeps the plain layout). The
# allocator's rules are the group kind's whatever the layout: only the KV cache spec class vLLM's
# registry maps to a manager changes (kvprop.targets.vllm.config.LAYOUT_SPECS).
PAGE_LAYOUTS = {
    "plain": ("full", "sliding_window", "chunked_local", "mamba"),
    "mla": ("full", "sliding_window"),  # multi-head latent attention (DeepSeek, Kimi), windows too (DeepSeek-V4)
    "hidden_state": ("full",),  # a cache of hidden states beside the model (extract_hidden_states)
    "quantised": ("full",),  # TurboQuant pages: vLLM quantises full-attention layers only
}


def page_layout_problem(layout: str, groups) -> str | None:
    """What ``layout`` needs that ``groups`` lack, or None: a group it applies to (else it changes
    nothing), and for "mla" no chunked-local group (no MLA model has one)."""
    if layout not in PAGE_LAYOUTS:
        return f"one of {list(PAGE_LAYOUTS)}, got {layout!r}"
    kinds = [spec.kind for spec in groups]
    if not any(kind in PAGE_LAYOUTS[layout] for kind in kinds):
        return f"a group of kind {' or '.join(PAGE_LAYOUTS[layout])} for layout {layout!r}, got {kinds}"
    if layout == "mla" and "chunked_local" in kinds:
        return f"no chunked-local group with layout 'mla' (no MLA model has one), got {kinds}"
    return None


def _check_page_layout(instance, attribute, value):
    if not isinstance(value, str):
        raise ConfigError(f"AllocatorConfig.page_layout must be a string, got {value!r}")
    if (problem := page_layout_problem(value, instance.groups)) is not None:
        raise ConfigError(f"AllocatorConfig.page_layout needs {problem}")


def eagle_problem(groups) -> str | None:
    """What the EAGLE drop needs that ``groups`` lack, or None where it is modelled: full
    attention and sliding windows (vLLM asserts that no chunked-local group drops; a state
    group's chunking and checkpoints move with the drop, not modelled yet), at most two groups
    (vLLM looks equal specs up together, which with more groups changes how often a group drops)."""
    kinds = [type(spec).__name__ for spec in groups]
    if any(kind not in ("FullAttention", "SlidingWindow") for kind in kinds):
        return f"groups of FullAttention and SlidingWindow only, got {kinds}"
    if len(kinds) > 2:
        return f"at most two groups, got {len(kinds)}"
    return None


@attrs.frozen
class AllocatorConfig:
    """The allocator's shape: groups sharing one pool of ``num_blocks`` (block 0 is the null
    block). Each other field is a declared option (``kvprop.allocator.options``) whose ``doc``
    says what it is and which vLLM setting it stands for."""

    groups: tuple = attrs.field(converter=lambda g: tuple(g) if isinstance(g, list) else g, validator=_check_groups)
    num_blocks: int = option(
        validator=_int_at_least(2),
        kw_only=False,
        doc="blocks in the shared pool, the null block (block 0) among them (vLLM's num_gpu_blocks)",
        types=(int,),
        simpler=lambda n: smaller(n, 2),
    )
    enable_caching: bool = option(
        True, validator=_check_bool, kw_only=False, doc="prefix caching (vLLM's enable_prefix_caching)", types=(bool,)
    )
    retention_interval: int | None = option(
        None,
        validator=_check_retention,
        doc="vLLM's prefix-cache retention (CacheConfig.prefix_cache_retention_interval, production default 0 "
        "since 0.30.0): which sliding-window and state blocks are worth a hash (kvprop.allocator.retention); "
        "null caches every block",
        types=(int, type(None)),
        absent=None,
        simpler=(None, 0),  # dense caching has no rule of its own to read
    )
    enable_kv_cache_events: bool = option(
        False,
        validator=_check_bool,
        doc="queue the KV cache events a router outside the engine replays (kvprop.allocator.events)",
        types=(bool,),
        absent=False,
        simpler=(False,),
    )
    hash_unit: int | None = option(
        None,
        validator=_check_hash_unit,
        doc="vLLM's prefix_match_unit: tokens per block hash; below the block size, hits may end inside a "
        "block (docs/design.md, 'Hits inside a block'); null is the block size",
        types=(int, type(None)),
        absent=None,
        simpler=(None,),  # hits end on block boundaries
    )
    kv_cache_report_mode: str = option(
        "incremental",
        validator=_check_report_mode,
        doc="vLLM's per-request kv_cache_report_mode, here for every request: 'full' also announces again "
        "the blocks each hit reuses",
        types=(str,),
        absent="incremental",
        simpler=("incremental",),
    )
    eagle: bool = option(
        False,
        validator=_check_bool,
        doc="vLLM's EAGLE/MTP block drop (use_eagle): a drafter's KV at a block's last position depends on the "
        "token after it, so a hit gives back its last block (docs/design.md, 'The EAGLE drop')",
        types=(bool,),
        absent=False,
        simpler=(False,),  # hits keep their last block
    )
    log_stats: bool = option(
        True,
        validator=_check_bool,
        doc="prefix-cache hit statistics (a served engine keeps them unless started with --disable-log-stats); "
        "only observes: a vLLM target builds its manager with them, so their hooks run",
        types=(bool,),
        absent=True,
        simpler=(True,),  # the engine's default
    )
    kv_cache_metrics: bool = option(
        False,
        validator=_check_bool,
        doc="vLLM's --kv-cache-metrics: block residency metrics, every block sampled; only observes",
        types=(bool,),
        absent=False,
        simpler=(False,),  # the engine's default
    )
    page_layout: str = option(
        "plain",
        validator=_check_page_layout,
        doc="how the attention groups' pages are laid out, as the model's layers declare them to vLLM "
        "(PAGE_LAYOUTS): 'plain', 'mla' (multi-head latent attention), 'hidden_state' (a hidden-state cache) "
        "or 'quantised' (TurboQuant); the allocator's rules are the group kind's, only vLLM's spec class changes",
        types=(str,),
        absent="plain",
        simpler=("plain",),
    )

    def __attrs_post_init__(self):
        mode = "align" if self.enable_caching else "none"
        for i, spec in enumerate(self.groups):
            if isinstance(spec, Mamba) and spec.mode != mode:
                # vLLM 0.33.0: MambaManager asserts "align" whenever prefix caching is on, and
                # caching off forces "none" (MambaModelConfig.verify_and_update_config)
                raise ConfigError(
                    f"AllocatorConfig.groups[{i}]: a Mamba group's mode is {mode!r} with enable_caching="
                    f"{self.enable_caching}, got {spec.mode!r}"
                )
        checkpoints = {spec.checkpoint for spec in self.groups if isinstance(spec, Mamba)}
        if len(checkpoints) > 1:
            # vLLM 0.33.0's scheduler splits chunks by the first Mamba group's alignment (a TODO there)
            raise ConfigError(
                f"AllocatorConfig.groups: every Mamba group must have the same checkpoint, got "
                f"{sorted(checkpoints, key=repr)}"
            )
        if self.eagle and (problem := eagle_problem(self.groups)) is not None:
            raise ConfigError(f"AllocatorConfig.eagle needs {problem} (docs/design.md §2 'The EAGLE drop')")
        if self.num_blocks * self.block_size > MAX_SLOTS:
            raise ConfigError(
                f"AllocatorConfig: num_blocks x block_size must be <= {MAX_SLOTS:,} slots of paged memory, "
                f"got {self.num_blocks:,} x {self.block_size}"
            )

    @property
    def block_size(self) -> int:
        return self.groups[0].block_size

    @property
    def unit(self) -> int:
        """Tokens per block hash: ``hash_unit``, or the block size when it is None."""
        return self.hash_unit or self.groups[0].block_size

    @property
    def partial_hits(self) -> bool:
        """Whether a hit may end inside a block (a hash unit below the block size)."""
        return self.unit < self.groups[0].block_size

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1


CONNECTOR_MODES = ("off", "sync", "async")
LOAD_FAILURE_POLICIES = ("recompute", "fail")
TIER_POLICIES = ("lru", "arc")  # vLLM's CPU tier's eviction_policy values (kv_offload/cpu/policies/factory.py)
MAX_PIPELINE_DEPTH = 3  # vLLM's async scheduler with two pipeline stages schedules three batches ahead
MAX_SPECULATIVE_TOKENS = 4  # MTP and EAGLE deployments propose 1 to 4 drafts


def _check_connector(instance, attribute, value):
    if value not in CONNECTOR_MODES:
        raise ConfigError(f"EngineConfig.connector must be one of {list(CONNECTOR_MODES)}, got {value!r}")


def _check_load_failure_policy(instance, attribute, value):
    """vLLM's ``KVTransferConfig.kv_load_failure_policy``: "fail" (its default) ends a request
    whose load failed with an error, "recompute" starts it again without the failed blocks."""
    if value not in LOAD_FAILURE_POLICIES:
        raise ConfigError(
            f"EngineConfig.load_failure_policy must be one of {list(LOAD_FAILURE_POLICIES)}, got {value!r}"
        )
    if value != "recompute" and instance.connector != "async":
        raise ConfigError(
            f"EngineConfig.load_failure_policy {value!r} needs connector 'async', got {instance.connector!r}: "
            f"only an asynchronous load can fail here"
        )


def _check_tier_policy(instance, attribute, value):
    if value not in TIER_POLICIES:
        raise ConfigError(f"EngineConfig.tier_policy must be one of {list(TIER_POLICIES)}, got {value!r}")


def _check_allocator(value):
    if not isinstance(value, AllocatorConfig):
        raise ConfigError(f"EngineConfig.allocator must be an AllocatorConfig, got {type(value).__name__}: {value!r}")


@attrs.frozen
class EngineConfig:
    """The scheduler and the external KV tier around the allocator; each field but the
    allocator's is a declared option (``kvprop.allocator.options``)."""

    allocator: AllocatorConfig = attrs.field(validator=lambda i, a, v: _check_allocator(v))
    token_budget: int = option(
        64,
        validator=_int_at_least(1),
        kw_only=False,
        doc="tokens the scheduler schedules per step (vLLM's max_num_batched_tokens)",
        types=(int,),
        simpler=lambda n: smaller(n, 1),
    )
    lookahead: int = option(
        0,
        validator=_int_at_least(0, 16),
        kw_only=False,
        doc="slots allocated ahead of each decode step (vLLM's num_lookahead_tokens)",
        types=(int,),
        simpler=(0,),
    )
    connector: str = option(
        "off",
        validator=_check_connector,
        kw_only=False,
        doc="the external KV tier: 'off', or a connector whose loads finish in their step ('sync') or later "
        "('async'; vLLM's offloading connector)",
        types=(str,),
        simpler=("off", "sync"),
    )
    vocab: int = option(
        4, validator=_int_at_least(1), kw_only=False, doc="the token alphabet prompts are drawn from", types=(int,)
    )
    speculative_tokens: int = option(
        0,
        validator=_int_at_least(0, MAX_SPECULATIVE_TOKENS),
        doc="draft tokens proposed after each sampled token and verified in the next step (vLLM's "
        "num_speculative_tokens; docs/design.md, 'Speculative decoding'); the minimiser lowers it with the "
        "state groups' scratch columns",
        types=(int,),
        absent=0,
    )
    load_failure_policy: str = option(
        "recompute",
        validator=_check_load_failure_policy,
        doc="what a failed load does to its request (vLLM's kv_load_failure_policy): 'recompute' starts it "
        "again without the failed blocks, 'fail' ends it with an error",
        types=(str,),
        absent="recompute",
        simpler=("recompute",),
    )
    max_num_seqs: int | None = option(
        None,
        validator=attrs.validators.optional(_int_at_least(1)),
        doc="running requests at most (vLLM's max_num_seqs, SchedulerConfig); a full batch admits no request "
        "but one starting an asynchronous load; null: no limit (the pool runs out of blocks first)",
        types=(int, type(None)),
        absent=None,
        simpler=(None,),
        draw=lambda choose, config: choose.pick((None, None, None, 1, 2, 4)),
    )
    pipeline_depth: int = option(
        1,
        validator=_int_at_least(1, MAX_PIPELINE_DEPTH),
        doc="batches in flight at once (vLLM's max_concurrent_batches: 1 synchronous, 2 its asynchronous "
        "scheduler, 3 that with two pipeline stages): the engine schedules ahead while fewer are in flight and "
        "completes the oldest when the queue is full (kvprop.sim.pipeline; docs/design.md, 'The pipelined "
        "scheduler')",
        types=(int,),
        absent=1,
        simpler=(1, 2),
        draw=None,  # drawn last, by the sampler (kvprop.search.late_draws.pipeline_depth)
    )
    tier_blocks: int | None = option(
        None,
        validator=attrs.validators.optional(_int_at_least(1)),
        doc="blocks the external tier holds, one per block hash and group (vLLM's CPU tier: cpu_bytes_to_use "
        "over one block's bytes, its num_chunks); null: kvprop's tier unbounded, vLLM's twice the GPU pool. A save "
        "that finds no room evicts idle blocks by tier_policy, or is dropped whole where too few are idle",
        types=(int, type(None)),
        absent=None,
        simpler=(None,),
        draw=None,  # drawn after the pipeline depth, by the sampler (kvprop.search.late_draws.offload_tier)
    )
    tier_policy: str = option(
        "lru",
        validator=_check_tier_policy,
        doc="which idle block the external tier evicts for a save (vLLM's eviction_policy): 'lru' the least "
        "recently used, 'arc' by adaptive replacement (kvprop.sim.tier_policy)",
        types=(str,),
        absent="lru",
        simpler=("lru",),
        draw=None,  # drawn with tier_blocks
    )

    tier_chunk: int = option(
        1,
        validator=_int_at_least(1),
        doc="GPU blocks per chunk of the external tier (vLLM's offloading connector blocks_per_chunk, 0.30.0 on): "
        "its keys, stores and loads are whole chunks, and tier_blocks counts their blocks. Driven through vLLM's "
        "scheduler; kvprop's own tier keeps one block per key and refuses chunks",
        types=(int,),
        absent=1,
        simpler=(1,),
        draw=None,  # drawn with tier_blocks, for vLLM's scheduler (kvprop.search.late_draws.offload_tier)
    )

    @property
    def fences_frees(self) -> bool:
        """Whether a request's blocks wait for its last batch in flight before they are freed:
        batches in flight beside a connector that loads (a KV consumer), whose load into a block
        freed and handed out again is not ordered after a write still in flight there (vLLM's
        ``defer_block_free``, ``Scheduler.__init__``, 0.24.0 on; kvprop.sim.fence)."""
        return self.pipeline_depth > 1 and self.connector != "off"

    def __attrs_post_init__(self):
        for spec in self.allocator.groups:
            if not isinstance(spec, Mamba):
                continue
            if self.speculative_tokens and spec.mode == "none":
                raise ConfigError(
                    "EngineConfig.speculative_tokens must be 0 with a Mamba group in mode 'none': its "
                    "speculative state columns are not modelled (docs/design.md §8.1); use mode 'align'"
                )
            if self.speculative_tokens >= spec.block_size:
                raise ConfigError(
                    f"EngineConfig.speculative_tokens must be below a Mamba group's block_size, got "
                    f"{self.speculative_tokens} drafts with blocks of {spec.block_size}: a step may then cross "
                    f"two block boundaries, and vLLM's worker copies only the last one's state into its "
                    f"column (docs/design.md §2 'Drafts with a state group')"
                )
            if spec.speculative_blocks != self.speculative_tokens:
                raise ConfigError(
                    f"Mamba.speculative_blocks must equal EngineConfig.speculative_tokens (vLLM sets "
                    f"num_speculative_blocks from num_speculative_tokens), got {spec.speculative_blocks} "
                    f"and {self.speculative_tokens}"
                )
        if self.pipeline_depth > 1 and (why := pipeline_problem(self)) is not None:
            raise ConfigError(f"EngineConfig.pipeline_depth must be 1 {why}, got {self.pipeline_depth}")
        if self.connector == "off" and (self.tier_blocks, self.tier_policy) != (None, "lru"):
            raise ConfigError(
                f"EngineConfig.tier_blocks must be null and tier_policy 'lru' with connector 'off' (there is no "
                f"external tier), got {self.tier_blocks!r} and {self.tier_policy!r}"
            )
        if self.connector == "off" and self.tier_chunk != 1:
            raise ConfigError(
                f"EngineConfig.tier_chunk must be 1 with connector 'off' (there is no external tier), got "
                f"{self.tier_chunk!r}"
            )
        if self.tier_blocks is not None and self.tier_blocks < self.tier_chunk:
            raise ConfigError(
                f"EngineConfig.tier_blocks must hold one chunk at least: {self.tier_blocks} blocks in chunks of "
                f"{self.tier_chunk} (tier_chunk)"
            )
        if self.connector != "off" and self.allocator.partial_hits:
            raise ConfigError(
                f"EngineConfig.connector must be 'off' with hash_unit below the block size, got {self.connector!r}: "
                f"what a connector stores and loads at a boundary inside a block is not modelled (docs/design.md §8.4)"
            )
        modes = {spec.mode for spec in self.allocator.groups if isinstance(spec, Mamba)}
        if self.connector != "off" and modes and (self.connector != "async" or modes != {"align"}):
            raise ConfigError(
                f"EngineConfig.connector must be 'off' or 'async' with a Mamba group, and the group in mode "
                f"'align', got connector {self.connector!r} and modes {sorted(modes)}: vLLM's offloading "
                f"connector loads asynchronously and offloads state only where prefix caching keeps it "
                f"(docs/design.md §3, connector)"
            )


def pipeline_problem(config: EngineConfig) -> str | None:
    """Why ``config`` cannot run with batches in flight as kvprop models it, or None. Drafts under
    the pipelined scheduler come from the worker as placeholders (vLLM's ``AsyncScheduler``), and a
    state group's columns move with each step's output, neither modelled yet; lookahead slots are
    an EAGLE drafter's."""
    if config.speculative_tokens:
        return f"with drafts (speculative_tokens={config.speculative_tokens}): drafts in flight are not modelled"
    if any(isinstance(spec, Mamba) for spec in config.allocator.groups):
        return "with a Mamba group: its state columns in flight are not modelled"
    if config.lookahead:
        return f"with lookahead slots (lookahead={config.lookahead}): an EAGLE drafter's, not modelled in flight"
    return None


def without_checkpoints(config: EngineConfig) -> EngineConfig:
    """``config`` with its state groups saving no prefill checkpoints (for a vLLM release whose
    checkpoints follow other rules, or for a walk that leaves a known checkpoint bug out)."""
    groups = tuple(attrs.evolve(g, checkpoint=None) if isinstance(g, Mamba) else g for g in config.allocator.groups)
    return attrs.evolve(config, allocator=attrs.evolve(config.allocator, groups=groups))


OPTIONS = declared(allocator=AllocatorConfig, engine=EngineConfig)
