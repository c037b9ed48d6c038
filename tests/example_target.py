"""A custom target: an allocator and its view, loaded by path like any external allocator.

    kvprop fuzz --target tests.example_target:make_target      (from the repository root)

A target is ``factory(config: AllocatorConfig) -> Built(allocator, view, capabilities)``;
docs/targets.md lists the calls each must answer and the capabilities it may declare
(kvprop's allocator and view offer every one). This one wraps kvprop's own allocator, so it behaves
exactly like the default target; ``make_buggy_target`` wraps the pre-fix per-group
allocation, so the harness has something to find through a path-loaded target too.
"""

from __future__ import annotations

import attrs

from kvprop.allocator.specs import AllocatorConfig
from kvprop.allocator.view import AllocatorView
from kvprop.targets.kvprop import make_allocator
from kvprop.targets.protocol import EVERY, Built


def make_target(config: AllocatorConfig):
    allocator = make_allocator(config)
    return Built(allocator, AllocatorView(allocator), EVERY)


def make_buggy_target(config: AllocatorConfig):
    allocator = make_allocator(config, variant="interleaved-external-alloc")
    return Built(allocator, AllocatorView(allocator), EVERY)


class _WithoutEvents:
    """kvprop's allocator behind a facade that predates KV cache events."""

    def __init__(self, allocator):
        self._allocator = allocator

    def __getattr__(self, name):
        if name == "take_events":
            raise AttributeError(name)
        return getattr(self._allocator, name)


def make_target_without_events(config: AllocatorConfig):
    allocator = make_allocator(config)
    return Built(_WithoutEvents(allocator), AllocatorView(allocator), attrs.evolve(EVERY, kv_events=False))


def make_stale_map_target(config: AllocatorConfig):
    """kvprop's allocator with a bug found within a few examples: eviction leaves the block in
    the cache map (the ``evict-keeps-hash`` variant)."""
    allocator = make_allocator(config, variant="evict-keeps-hash")
    return Built(allocator, AllocatorView(allocator), EVERY)


def make_plain_target(config: AllocatorConfig):
    """kvprop's allocator as a plain (allocator, view) pair: it declares nothing optional."""
    allocator = make_allocator(config)
    return allocator, AllocatorView(allocator)
