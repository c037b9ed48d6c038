"""kvprop's own allocator as a target: the reference allocator, or one of its bug variants."""

from __future__ import annotations

from kvprop.allocator.manager import KVCacheManager
from kvprop.allocator.specs import AllocatorConfig, EngineConfig
from kvprop.allocator.view import AllocatorView
from kvprop.sim.engine import Engine
from kvprop.targets.variants import get_variant


def make_allocator(config: AllocatorConfig, variant: str | None = None) -> KVCacheManager:
    v = get_variant(variant)
    return v.allocator(config, v.parts)


def build_kvprop_engine(
    config: EngineConfig, variant: str | None = None, device: str | None = None, hooks=None
) -> Engine:
    """The engine over kvprop's allocator with ``variant`` switched on (None or 'correct': no bug)."""
    v = get_variant(variant)
    allocator = v.allocator(config.allocator, v.parts)
    return v.engine(config, allocator, AllocatorView(allocator), device=device, hooks=hooks)
