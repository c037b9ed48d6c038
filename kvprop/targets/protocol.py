"""The target contract: the calls every target answers, the capabilities it may declare, and
the one registry every command resolves a target name through.

A target is a factory ``factory(config: AllocatorConfig)`` that returns ``Built(allocator,
view, capabilities)`` — or a plain ``(allocator, view)`` pair, which declares nothing beyond
the required calls. The allocator answers ``Allocator`` (the calls a scheduler makes), the
view answers ``View`` (what the invariants read). Everything beyond those is a capability,
declared as a field of ``Capabilities`` and never discovered by probing the objects: a
declared capability's calls must exist (``check_declared`` refuses the target otherwise),
and kvprop makes a capability's calls only when it is declared.

``docs/targets.md`` documents each call; ``kvprop targets`` lists the registry.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs

from kvprop.allocator.specs import EngineConfig, Mamba
from kvprop.capabilities import ANY_SHAPE, EVERY, NONE, Capabilities, Shapes
from kvprop.errors import ConfigError
from kvprop.sim.events import EV_EVICT, EV_PREEMPT, EV_REHIT, EVENTS, IN_FLIGHT_ONLY

__all__ = [
    "ANY_SHAPE",
    "EVERY",
    "NONE",
    "Allocator",
    "Built",
    "CacheKey",
    "Capabilities",
    "Shapes",
    "Target",
    "View",
]

# ---- the required calls ------------------------------------------------------------------


# A cache key in kvprop's terms: (kvprop block hash, group id) (docs/targets.md, "The view").
CacheKey = tuple[Any, int]


@runtime_checkable
class Allocator(Protocol):
    """The manager-facade calls kvprop's engine makes, as vLLM's scheduler makes them. The engine
    passes every argument of ``allocate_slots`` after ``num_new_tokens`` by keyword."""

    def get_computed_blocks(self, request: Any) -> tuple[Any, int] | tuple[Any, int, int]: ...

    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: int,
        *,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Any = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> Any: ...

    def free(self, request: Any) -> None: ...

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None: ...

    def reset_prefix_cache(self) -> bool: ...

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]: ...


@runtime_checkable
class View(Protocol):
    """The allocator's state in kvprop's terms, read by the invariants; each call's type is the
    one the reference view (``kvprop.allocator.view.AllocatorView``) returns."""

    num_blocks: int
    block_size: int
    num_groups: int
    null_block_id: int

    @property
    def num_free_blocks(self) -> int: ...

    def ref_cnt(self, block_id: int) -> int: ...

    def ref_cnts(self) -> list[int]: ...  # indexed by block id

    def cache_key(self, block_id: int) -> CacheKey | None: ...

    def cache_keys(self) -> list[CacheKey | None]: ...  # indexed by block id

    def free_queue_ids(self) -> list[int]: ...  # the head (evicted next) first

    def free_queue_ids_backward(self) -> list[int]: ...  # the tail first

    def free_queue_prefix(self, n: int) -> list[int]: ...

    def cache_map_items(self) -> Iterable[tuple[CacheKey, int]]: ...  # (key, block id), one per map entry

    def request_ids(self, group: int) -> Iterable[str]: ...

    def request_block_ids(self, group: int, request_id: str) -> list[int] | None: ...  # None: no table

    def num_cached_blocks(self, group: int, request_id: str) -> int | None: ...  # None: no table


ALLOCATOR_CALLS: tuple[str, ...] = (
    "get_computed_blocks",
    "allocate_slots",
    "free",
    "cache_blocks",
    "reset_prefix_cache",
    "get_block_ids",
)
VIEW_CALLS: tuple[str, ...] = (
    "ref_cnt",
    "ref_cnts",
    "cache_key",
    "cache_keys",
    "free_queue_ids",
    "free_queue_ids_backward",
    "free_queue_prefix",
    "cache_map_items",
    "request_ids",
    "request_block_ids",
    "num_cached_blocks",
)
VIEW_FIELDS: tuple[str, ...] = ("num_blocks", "block_size", "num_groups", "null_block_id", "num_free_blocks")

if TYPE_CHECKING:  # mypy holds kvprop's own allocator and the reference view to the Protocols above
    from kvprop.allocator.kv_cache_manager import KVCacheManager
    from kvprop.allocator.view import AllocatorView

    def _reference(allocator: KVCacheManager, view: AllocatorView) -> tuple[Allocator, View]:
        return allocator, view


# ---- what a target may declare: kvprop.capabilities (the engine reads it too) ---------


@attrs.frozen
class Built:
    """What a factory returns: the allocator, its view, and what they declare."""

    allocator: Any
    view: Any
    capabilities: Capabilities = NONE

    def __iter__(self):
        """``allocator, view = factory(config)`` reads a ``Built`` as it reads a plain pair."""
        return iter((self.allocator, self.view))


def check_declared(target: str, built: Built) -> Built:
    """The required calls and every declared capability's calls exist; else a ConfigError
    naming what is missing (a wiring mistake of the target, not a find). This reads the
    objects once, at build time, to hold a declaration to its word."""
    for side, obj, names in (
        ("allocator", built.allocator, ALLOCATOR_CALLS),
        ("view", built.view, VIEW_CALLS + VIEW_FIELDS),
    ):
        missing = [n for n in names if not hasattr(obj, n)]
        if missing:
            raise ConfigError(
                f"target {target!r}: the {side} ({type(obj).__name__}) lacks {missing} "
                f"(docs/targets.md lists what each must answer)"
            )
    for field in attrs.fields(Capabilities):
        if not getattr(built.capabilities, field.name):
            continue
        obj = built.allocator if field.metadata["side"] == "allocator" else built.view
        missing = [n for n in field.metadata["calls"] if not hasattr(obj, n)]
        if missing:
            raise ConfigError(
                f"target {target!r} declares {field.name}, but its {field.metadata['side']} "
                f"({type(obj).__name__}) lacks {missing}"
            )
    return built


# The Shapes field that leaves out the configurations needing each capability (check_needed).
SHAPE_WITHOUT = {
    "kv_events": "kv_events=False",
    "step_notice": 'group_kinds without "mamba"',
    "block_copies": "hits_inside_blocks=False",
    "keys_inside_blocks": "hits_inside_blocks=False",
    "pending_copies": "hits_inside_blocks=False",
    "deferred_frees": 'options without "pipeline_depth"',
}


def needed(engine_config: EngineConfig) -> dict[str, str]:
    """The capabilities a configuration needs its target to declare, each with why: on that
    shape the engine makes their calls and the checks read their reports, and a correct
    allocator run without them fails there (its view completed with empty reports)."""
    config = engine_config.allocator
    needs = {}
    if engine_config.fences_frees:
        needs["deferred_frees"] = (
            "batches in flight beside a connector that loads: a request's blocks are taken by "
            "pop_blocks_for_free() and freed by free_popped_blocks() once its last batch is back"
        )
    if config.enable_kv_cache_events:
        needs["kv_events"] = "enable_kv_cache_events=True: the checks replay take_events()"
    if config.enable_caching and any(isinstance(spec, Mamba) for spec in config.groups):
        needs["step_notice"] = (
            "a Mamba group with prefix caching: a hit on a state cached in the current step waits for "
            "the next step, which new_step_starts() announces"
        )
    if config.partial_hits:
        below = "a hash_unit below the block size"  # the same words for every such shape, counted as one reason
        needs["block_copies"] = f"{below}: a hit inside a block queues a copy, taken by take_kv_cache_block_copies()"
        needs["keys_inside_blocks"] = (
            f"{below}: a block is cached under keys inside it, read by extra_keys() and further_keys()"
        )
        needs["pending_copies"] = f"{below}: a queued copy holds a reference on both blocks, read by pending_copies()"
    return needs


def check_needed(target: str, declared: Capabilities, config: EngineConfig) -> None:
    """A ConfigError (the configuration refused, and counted so) where ``config`` needs a
    capability ``target`` does not declare, naming each and how to declare it."""
    offered = declared.declared()
    missing = {name: why for name, why in needed(config).items() if name not in offered}
    if not missing:
        return
    flags = ", ".join(f"{name}=True" for name in missing)
    shapes = ", ".join(dict.fromkeys(SHAPE_WITHOUT[name] for name in missing))
    raise ConfigError(
        f"target {target!r} does not declare {', '.join(missing)}, which this configuration needs: "
        f"{'; '.join(f'{name} ({why})' for name, why in missing.items())}. Where its allocator and view "
        f"offer those calls, declare them: the factory returns Built(allocator, view, Capabilities({flags})), "
        f"or a Target(..., capabilities=Capabilities({flags})) names it; otherwise leave such configurations "
        f"out of the Target's Shapes ({shapes}); docs/targets.md"
    )


class CompletedView:
    """A view that declares fewer reports than the checks read, completed with empty ones for
    what it does not declare: no keys inside a block, no queued copies, no evictions counted.
    Every other call goes to the target's view. kvprop's and vLLM's views declare them all and
    are never wrapped."""

    def __init__(self, view: Any, declared: Capabilities):
        self._view = view
        self._declared = declared

    def __getattr__(self, name: str) -> Any:
        return getattr(self._view, name)

    def extra_keys(self) -> dict:
        return self._view.extra_keys() if self._declared.keys_inside_blocks else {}

    def further_keys(self, block_id: int) -> list:
        return self._view.further_keys(block_id) if self._declared.keys_inside_blocks else []

    def pending_copies(self) -> list:
        return self._view.pending_copies() if self._declared.pending_copies else []

    @property
    def num_evictions(self) -> int:
        return self._view.num_evictions if self._declared.evictions else 0

    def records_of(self, request_id: str) -> list:
        return self._view.records_of(request_id) if self._declared.request_records else []


REPORTS = ("keys_inside_blocks", "pending_copies", "evictions", "request_records")  # what CompletedView completes


def complete_view(view: Any, declared: Capabilities) -> Any:
    """``view`` itself where it declares every report the checks read, else completed."""
    if all(getattr(declared, name) for name in REPORTS):
        return view
    return CompletedView(view, declared)


# ---- the registry --------------------------------------------------------------------------


@attrs.frozen
class Target:
    """A target's declaration: its factory, what it declares, which package it drives.

    kvprop's targets are registered here; a user's module may declare its own and name it
    (``--target package.module:TARGET``), so that kvprop knows its capabilities and the shapes
    it builds before building anything. A path naming a bare factory declares nothing."""

    name: str
    factory: Any  # "package.module:attribute" (imported only in a supervised worker), or the callable
    summary: str
    capabilities: Capabilities | None = None  # None: declared by what its factory returns
    # the configurations it builds, which the sampler draws only: a Shapes, or "module:function"
    # giving them for the release installed (evaluated where the target runs)
    shapes: Shapes | str = ANY_SHAPE
    own_scheduler: bool = False  # the factory builds the whole engine: factory(config, device, hooks, canary)
    # "module:function": the engine's own start-up validation of the whole configuration, called
    # before the factory (which sees only the allocator's); a ConfigError refuses the configuration
    startup: str | None = None
    package: str | None = None  # the distribution whose release it drives (its version is reported)
    # the engine events (kvprop.sim.events) its engine can reach, which a search reports; None: every one
    events: tuple[str, ...] | None = None
    # what ``kvprop agree`` walks beside it: kvprop's own allocator (None), another target that
    # must make the same decisions, or nothing ("") where no reference states its terms
    agrees_with: str | None = None


# vLLM's targets declare every call of the contract but a group's tables at once and an O(1)
# key lookup, which vLLM's structures do not offer cheaply (kvprop.targets.vllm); a fixed
# null-block count only where the release keeps one, declared by its factory; and no deferred
# frees: the manager target draws no batches in flight, and the scheduler target's own defers.
VLLM_CAPABILITIES = attrs.evolve(
    EVERY, raw_tables=False, key_lookup=False, null_count_fixed=False, deferred_frees=False
)

REGISTRY = {
    t.name: t
    for t in (
        Target(
            "kvprop",
            "kvprop.targets.kvprop:build_kvprop_engine",
            "kvprop's own allocator, or one of its bug variants (--variant)",
            EVERY,
            package="kvprop",
        ),
        Target(
            "vllm",
            "kvprop.targets.vllm.manager:make_target",
            "vLLM's own v1 KVCacheManager, driven by kvprop's scheduler",
            VLLM_CAPABILITIES,
            shapes="kvprop.targets.vllm.shapes:release_shapes",
            startup="kvprop.targets.vllm.config:check_startup",
            package="vllm",
            # kvprop's scheduler runs synchronously in front of vLLM's manager here
            events=tuple(e for e in EVENTS if e not in IN_FLIGHT_ONLY),
        ),
        Target(
            "vllm-scheduler",
            "kvprop.targets.vllm.scheduler:build_engine",
            "vLLM's own Scheduler (synchronous, or asynchronous with 2 or 3 batches in flight) and "
            "OffloadingConnector (its CPU tier of a drawn size, evicting by LRU or ARC, in chunks of 1 to 4 blocks) "
            "in charge of every step",
            VLLM_CAPABILITIES,
            shapes="kvprop.targets.vllm.shapes:scheduler_shapes",
            own_scheduler=True,
            package="vllm",
        ),
        Target(
            "sglang",
            "kvprop.targets.sglang.engine:build_engine",
            "SGLang's own scheduler loop (normal, not overlap), radix cache (Python tree core: full-attention "
            "and sliding-window components) and KV pools, in charge of every step",
            NONE,
            shapes="kvprop.targets.sglang.shape:release_shapes",
            own_scheduler=True,
            startup="kvprop.targets.sglang.shape:check_startup",
            package="sglang",
            events=(EV_EVICT, EV_PREEMPT, EV_REHIT),  # no loads, no drafts, no window skipping here
            agrees_with="",  # SGLang's pages and tree are not kvprop's blocks: no reference compares them
        ),
        Target(
            "sglang-rust",
            "kvprop.targets.sglang.engine:build_rust_core_engine",
            "SGLang's own scheduler loop over its Rust tree core (its default core from 0.5.19): judged by "
            "pool conservation, the data oracle and the idle check, and by `kvprop agree` against the Python core",
            NONE,
            shapes="kvprop.targets.sglang.shape:rust_core_shapes",
            own_scheduler=True,
            startup="kvprop.targets.sglang.shape:check_startup",
            package="sglang",
            events=(EV_EVICT, EV_PREEMPT, EV_REHIT),
            agrees_with="sglang",  # the Python core: SGLang's cores are meant to decide alike
        ),
    )
}
# The targets that drive vLLM's own code: the registry's, by the package they drive.
VLLM_TARGETS = tuple(name for name, t in REGISTRY.items() if t.package == "vllm")
NAMES = "'kvprop', 'vllm', 'vllm-scheduler', 'sglang', 'sglang-rust' or 'package.module:factory'"


def is_builtin(name: str | None) -> bool:
    """kvprop's own targets: a trace may name these; any other code runs only when a person names it."""
    return name is None or name in REGISTRY


def resolve(name: str | None) -> Target:
    """The target ``name`` stands for: a registered one, or a user's factory by path (checked
    for its form only; nothing is imported)."""
    if name is None:
        return REGISTRY["kvprop"]
    if isinstance(name, str) and name in REGISTRY:
        return REGISTRY[name]
    module_name, sep, attr = name.partition(":") if isinstance(name, str) else ("", "", "")
    if not sep or not attr.isidentifier() or not all(p.isidentifier() for p in module_name.split(".")):
        raise ConfigError(f"target must be {NAMES}, got {name!r}")
    return Target(name, name, "a user's allocator, loaded by path", None)


def reachable_events(name: str | None) -> tuple[str, ...]:
    """The engine events a run on ``name`` can reach: what its declaration says, else every one."""
    declared = resolve(name).events
    return EVENTS if declared is None else declared


def capabilities(name: str | None) -> Capabilities | None:
    """What ``name`` declares, where the registry knows it without building it; None where its
    factory declares it (a user's target, vLLM's, whose capabilities depend on the release)."""
    return resolve(name).capabilities


def version(target: Target) -> str | None:
    """The installed release of the package a target drives, read from its metadata (nothing is imported)."""
    if target.package is None:
        return None
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed(target.package)
    except PackageNotFoundError:
        return None
