"""The minimiser's configuration candidates: the shapes that let the same bug, found at several
block sizes and group counts, shrink towards one trace."""

from __future__ import annotations

from kvprop.allocator.specs import AllocatorConfig, EngineConfig, FullAttention, SlidingWindow
from kvprop.repro.minimise import _simpler_configs


def _shapes(config: EngineConfig) -> list[tuple]:
    return [
        (tuple((g.kind, g.block_size) for g in c.allocator.groups), c.allocator.num_blocks)
        for c in _simpler_configs(config)
        if c is not None
    ]


def test_the_minimiser_tries_every_groups_blocks_smaller_with_the_pool_holding_the_same_tokens():
    config = EngineConfig(AllocatorConfig((FullAttention(4), SlidingWindow(4, 8)), 10), token_budget=8)
    smaller = [s for s in _shapes(config) if len(s[0]) == 2 and s[0][0][1] < 4]
    assert smaller == [
        ((("full", 1), ("sliding_window", 1)), 40),
        ((("full", 2), ("sliding_window", 2)), 20),
        ((("full", 3), ("sliding_window", 3)), 14),
    ]


def test_the_minimiser_tries_one_group_fewer_with_its_share_of_the_pool():
    config = EngineConfig(AllocatorConfig((FullAttention(2), FullAttention(2), FullAttention(2)), 30), token_budget=8)
    fewer = [s for s in _shapes(config) if len(s[0]) == 2 and s[0][0][1] == 2]
    assert fewer == [((("full", 2), ("full", 2)), 30)] * 3 + [((("full", 2), ("full", 2)), 20)] * 3
