"""Targets: the allocator an engine drives, with the read-only view its invariants read.

A target is named ``kvprop`` (the default: kvprop's own allocator, or one of its bug
variants), ``vllm`` (vLLM's own ``KVCacheManager``), ``vllm-scheduler`` (vLLM's own
``Scheduler`` in charge of the steps, ``kvprop.targets.vllm.scheduler``) or
``package.module:factory``. ``protocol`` is the contract — the calls every target answers,
the capabilities it may declare — and the registry every command resolves a name through;
``docs/targets.md`` documents both.

Bug variants are a target concern (``variants``), not part of the allocator. This layer
may import allocator, sim and check.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from typing import TYPE_CHECKING

import attrs

from kvprop.capabilities import NONE, Capabilities, Shapes
from kvprop.errors import ConfigError, TargetError
from kvprop.targets.protocol import (
    NAMES,
    REGISTRY,
    Built,
    Target,
    check_declared,
    check_needed,
    complete_view,
    is_builtin,
    resolve,
)

if TYPE_CHECKING:
    from kvprop.sim.engine import Engine  # imported where an engine is built: naming a target loads no torch

__all__ = ["NAMES", "REGISTRY", "build_engine", "check_name", "is_builtin", "load_factory", "load_target", "shapes_of"]


def check_name(target) -> None:
    """``target`` has the form of a target name (checked without importing anything)."""
    resolve(target)


def load_target(target) -> Target:
    """The declaration of ``target``: a registered one, or what a user's path names — a
    ``Target`` declaration, or a bare factory, which declares nothing. Importing happens here,
    in a supervised worker; any way it cannot be loaded is a ConfigError or a TargetError that
    says why."""
    described = resolve(target)
    if described.name in REGISTRY:
        return described
    module_name, _, attr = target.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # `kvprop --target pkg.mod:f` finds modules where `python -m` would
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise TargetError(f"target {target!r}: cannot import {module_name!r} ({e})") from e
    except Exception as e:  # noqa: BLE001 - the module's own code failed: say so, it is the user's input
        raise TargetError(f"target {target!r}: importing {module_name!r} raised {type(e).__name__}: {e}") from e
    try:
        named = getattr(module, attr)  # the attribute the user named, not a capability probe
    except AttributeError:
        raise ConfigError(f"target {target!r}: module {module_name!r} has no attribute {attr!r}") from None
    if isinstance(named, Target):
        if not callable(named.factory):
            raise ConfigError(f"target {target!r}: its Target's factory is a {type(named.factory).__name__}")
        return named
    if not callable(named):
        raise ConfigError(
            f"target {target!r}: {attr!r} is a {type(named).__name__}, not a callable "
            f"factory(config: AllocatorConfig) -> Built(allocator, view, capabilities) nor a Target declaration"
        )
    return Target(target, named, described.summary)


def load_factory(target):
    """The factory ``target`` names (imported in a supervised worker)."""
    return factory_of(load_target(target))


def factory_of(described: Target):
    """A declaration's factory: the callable itself, or the one its ``module:attribute`` names."""
    if callable(described.factory):
        return described.factory
    return named(described.factory)


def named(path: str):
    """What ``package.module:attribute`` names (a registered target's factory, shapes or start-up check)."""
    module_name, _, attr = path.partition(":")
    return getattr(importlib.import_module(module_name), attr)


@functools.cache
def shapes_of(target) -> Shapes:
    """The configurations ``target`` declares it builds (every one for kvprop's own and for a
    bare factory); for a release-dependent target, computed from the release installed (this
    imports it)."""
    shapes = load_target(target).shapes
    if isinstance(shapes, str):
        shapes = named(shapes)()
    return shapes


def check_built(target: str, built, declared: Capabilities | None = None) -> Built:
    """What a factory returned, as a ``Built`` held to its declaration: a ``Built`` carries its
    own, a plain ``(allocator, view)`` pair the one ``declared`` beside the factory (a
    ``Target``'s), or nothing beyond the required calls. A ConfigError names what is wrong or
    missing (a wiring mistake, not a bug found)."""
    if isinstance(built, tuple) and len(built) == 2:
        built = Built(*built)
    if not isinstance(built, Built):
        raise ConfigError(
            f"target {target!r}: factory(config) must return Built(allocator, view, capabilities) or "
            f"(allocator, view), got {type(built).__name__}: {built!r:.200}"
        )
    if declared is not None and built.capabilities is NONE:
        built = attrs.evolve(built, capabilities=declared)
    return check_declared(target, built)


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
    from kvprop.sim.engine import Engine
    from kvprop.targets.canary import with_canary

    described = load_target(target)
    if described.name == "kvprop":
        from kvprop.targets.kvprop import build_kvprop_engine

        return build_kvprop_engine(config, variant, device=device, hooks=hooks, wrap=with_canary if canary else None)
    if variant not in (None, "correct"):
        raise ConfigError(f"variant {variant!r} applies to the kvprop target only, not to target {target!r}")
    if described.startup is not None:  # the engine's own start-up validation, before anything is built
        named(described.startup)(config)
    factory = factory_of(described)
    if described.own_scheduler:  # it builds the whole engine, its own scheduler in charge
        return _call_factory(target, factory, config, device=device, hooks=hooks, canary=canary)
    built = check_built(target, _call_factory(target, factory, config.allocator), described.capabilities)
    check_needed(target, built.capabilities, config)
    engine_cls = with_canary(Engine) if canary else Engine
    view = complete_view(built.view, built.capabilities)
    return engine_cls(config, built.allocator, view, device=device, hooks=hooks, capabilities=built.capabilities)
