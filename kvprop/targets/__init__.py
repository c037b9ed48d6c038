"""Targets: the allocator an engine drives, with the read-only view its invariants read.

A target is named ``kvprop`` (the default: kvprop's own allocator, or one of its bug
variants), ``vllm`` (vLLM's own ``KVCacheManager``), ``vllm-scheduler`` (vLLM's own
``Scheduler`` in charge of the steps, ``kvprop.targets.vllm_scheduler``) or
``package.module:factory`` — any callable ``factory(config: AllocatorConfig) -> (allocator,
view)``. The allocator answers
the manager-facade calls of ``kvprop.allocator.manager.KVCacheManager``; the view answers
the calls of ``kvprop.allocator.view.AllocatorView``. ``docs/targets.md`` documents both.

Bug variants are a target concern (``variants``), not part of the allocator. This layer
may import allocator, sim and check.
"""

from __future__ import annotations

import importlib
import os
import sys

from kvprop.errors import ConfigError, TargetError
from kvprop.sim.engine import Engine

BUILTIN = {
    "vllm": "kvprop.targets.vllm:make_target",
    "vllm-scheduler": "kvprop.targets.vllm_scheduler:build_engine",
}
NAMES = "'kvprop', 'vllm', 'vllm-scheduler' or 'package.module:factory'"


def is_builtin(name: str | None) -> bool:
    """kvprop's own targets: a trace may name these; any other code runs only when a person names it."""
    return name in (None, "kvprop", *BUILTIN)


FACADE_CALLS = ("get_computed_blocks", "allocate_slots", "free", "cache_blocks", "reset_prefix_cache", "get_block_ids")
VIEW_CALLS = (
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
VIEW_FIELDS = ("num_blocks", "block_size", "num_groups", "null_block_id", "num_free_blocks")


def check_name(target) -> None:
    """``target`` has the form of a target name (checked without importing anything)."""
    if target is None or is_builtin(target):
        return
    module_name, sep, attr = target.partition(":") if isinstance(target, str) else ("", "", "")
    if not sep or not attr.isidentifier() or not all(p.isidentifier() for p in module_name.split(".")):
        raise ConfigError(f"target must be {NAMES}, got {target!r}")


def load_factory(target: str):
    """The factory a target names; any way it cannot be loaded is a ConfigError that says why."""
    if not isinstance(target, str):
        raise ConfigError(f"target must be {NAMES}, got {target!r}")
    path = BUILTIN.get(target, target)
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"target must be {NAMES}, got {target!r}")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # `kvprop --target pkg.mod:f` finds modules where `python -m` would
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise TargetError(f"target {target!r}: cannot import {module_name!r} ({e})") from e
    except Exception as e:  # noqa: BLE001 - the module's own code failed: say so, it is the user's input
        raise TargetError(f"target {target!r}: importing {module_name!r} raised {type(e).__name__}: {e}") from e
    try:
        factory = getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"target {target!r}: module {module_name!r} has no attribute {attr!r}") from None
    if not callable(factory):
        raise ConfigError(
            f"target {target!r}: {attr!r} is a {type(factory).__name__}, not a callable "
            f"factory(config: AllocatorConfig) -> (allocator, view)"
        )
    return factory


def check_built(target: str, built) -> tuple:
    """What a factory returned, if it is (allocator, view) with the calls the engine and the
    checks make; else a ConfigError naming what is missing (a wiring mistake, not a bug found)."""
    expected = "factory(config) must return (allocator, view)"
    if not isinstance(built, tuple) or len(built) != 2:
        raise ConfigError(f"target {target!r}: {expected}, got {type(built).__name__}: {built!r:.200}")
    allocator, view = built
    for what, obj, names in (("allocator", allocator, FACADE_CALLS), ("view", view, VIEW_CALLS + VIEW_FIELDS)):
        missing = [n for n in names if not hasattr(obj, n)]
        if missing:
            raise ConfigError(
                f"target {target!r}: {expected}; the {what} ({type(obj).__name__}) lacks {missing} "
                f"(docs/targets.md lists what each must answer)"
            )
    return allocator, view


def _call_factory(target: str, factory, *args, **kwargs):
    """The factory's result; a ConfigError is its refusal of this configuration, any other
    exception says the target cannot be used (a TargetError naming it, never kvprop's error)."""
    try:
        return factory(*args, **kwargs)
    except (ConfigError, TargetError):
        raise
    except Exception as e:  # noqa: BLE001 - the target's own code failed
        raise TargetError(f"target {target!r}: its factory raised {type(e).__name__}: {str(e)[:500]}") from e


def build_engine(config, variant=None, target=None, device=None, hooks=None, canary: bool = False) -> Engine:
    """The engine over ``target``'s allocator (kvprop's own, with ``variant``, by default); with
    ``canary`` the engine carries the canary fault (``kvprop.targets.canary``)."""
    from kvprop.targets.canary import with_canary

    if target in (None, "kvprop"):
        from kvprop.targets.kvprop import build_kvprop_engine

        return build_kvprop_engine(config, variant, device=device, hooks=hooks, wrap=with_canary if canary else None)
    if variant not in (None, "correct"):
        raise ConfigError(f"variant {variant!r} applies to the kvprop target only, not to target {target!r}")
    factory = load_factory(target)
    if getattr(factory, "engine_target", False):  # it builds the whole engine (its own scheduler)
        return _call_factory(target, factory, config, device=device, hooks=hooks, canary=canary)
    allocator, view = check_built(target, _call_factory(target, factory, config.allocator))
    if config.allocator.enable_kv_cache_events and not hasattr(allocator, "take_events"):
        raise ConfigError(
            f"target {target!r}: the configuration enables KV cache events, but the allocator has no "
            f"take_events() (docs/targets.md); it can run only with enable_kv_cache_events=False"
        )
    engine_cls = getattr(allocator, "engine_class", Engine)
    if canary:
        engine_cls = with_canary(engine_cls)
    return engine_cls(config, allocator, view, device=device, hooks=hooks)
