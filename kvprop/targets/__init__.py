"""Targets: the allocator an engine drives, with the read-only view its invariants read.

A target is named ``kvprop`` (the default: kvprop's own allocator, or one of its bug
variants), ``vllm`` (vLLM's own ``KVCacheManager``) or ``package.module:factory`` — any
callable ``factory(config: AllocatorConfig) -> (allocator, view)``. The allocator answers
the manager-facade calls of ``kvprop.allocator.manager.KVCacheManager``; the view answers
the calls of ``kvprop.allocator.view.AllocatorView``. ``docs/targets.md`` documents both.

Bug variants are a target concern (``variants``), not part of the allocator. This layer
may import allocator, sim and check.
"""

from __future__ import annotations

import importlib
import os
import sys

from kvprop.errors import ConfigError
from kvprop.sim.engine import Engine

BUILTIN = {"vllm": "kvprop.targets.vllm:make_target"}


def load_factory(target: str):
    path = BUILTIN.get(target, target)
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"target must be 'kvprop', 'vllm' or 'package.module:factory', got {target!r}")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # `kvprop --target pkg.mod:f` finds modules where `python -m` would
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"target {target!r}: cannot import {module_name!r} ({e})") from e
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"target {target!r}: module {module_name!r} has no attribute {attr!r}") from None


def build_engine(config, variant=None, target=None, device=None, hooks=None) -> Engine:
    """The engine over ``target``'s allocator (kvprop's own, with ``variant``, by default)."""
    if target in (None, "kvprop"):
        from kvprop.targets.kvprop import build_kvprop_engine

        return build_kvprop_engine(config, variant, device=device, hooks=hooks)
    if variant not in (None, "correct"):
        raise ConfigError(f"variant {variant!r} applies to the kvprop target only, not to target {target!r}")
    allocator, view = load_factory(target)(config.allocator)
    engine_cls = getattr(allocator, "engine_class", Engine)
    return engine_cls(config, allocator, view, device=device, hooks=hooks)
