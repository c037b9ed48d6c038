"""kvprop's own allocator as a target: the reference allocator, or one of its bug variants."""

from __future__ import annotations

from kvprop.allocator.kv_cache_manager import KVCacheManager
from kvprop.allocator.specs import AllocatorConfig, EngineConfig
from kvprop.allocator.view import AllocatorView
from kvprop.sim.engine import Engine
from kvprop.targets.variants import get_variant


def make_allocator(config: AllocatorConfig, variant: str | None = None) -> KVCacheManager:
    v = get_variant(variant)
    return v.allocator(config, v.parts)


def build_kvprop_engine(
    config: EngineConfig, variant: str | None = None, device: str | None = None, hooks=None, wrap=None
) -> Engine:
    """The engine over kvprop's allocator with ``variant`` switched on (None or 'correct': no bug);
    ``wrap`` may replace the engine class (the canary does)."""
    v = get_variant(variant)
    allocator = v.allocator(config.allocator, v.parts)
    engine_cls = wrap(v.engine) if wrap else v.engine
    return engine_cls(config, allocator, AllocatorView(allocator), device=device, hooks=hooks)
