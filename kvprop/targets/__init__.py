"""Targets: the allocator an engine drives, with the read-only view its invariants read.

A target is named ``kvprop`` (the default: kvprop's own allocator, or one of its bug
variants), ``vllm`` (vLLM's own ``KVCacheManager``) or ``package.module:factory`` — any
callable ``factory(config: AllocatorConfig) -> (allocator, view)``. The allocator answers
the manager-facade calls of ``kvprop.kv_cache_manager.KVCacheManager``; the view answers
the calls of ``kvprop.view.AllocatorView``. ``docs/targets.md`` documents both.
"""

from __future__ import annotations

import importlib
import os
import sys

from kvprop.engine import Engine
from kvprop.errors import ConfigError
from kvprop.variants import CORRECT
from kvprop.variants import make_engine as make_variant_engine

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


def make_engine(config, variant=None, target=None, device=None, hooks=None) -> Engine:
    if target in (None, "kvprop"):
        return make_variant_engine(config, variant, device=device, hooks=hooks)
    if variant not in (None, CORRECT.name):
        raise ConfigError(f"variant {variant!r} applies to the kvprop target only, not to target {target!r}")
    allocator, view = load_factory(target)(config.allocator)
    engine_cls = getattr(allocator, "engine_class", Engine)
    return engine_cls(config, allocator, view, device=device, hooks=hooks)
