"""kvprop's configuration in SGLang's terms (``kvprop.targets.sglang.shape``): no SGLang needed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvprop.allocator.specs import AllocatorConfig, EngineConfig, FullAttention, Mamba, SlidingWindow
from kvprop.errors import ConfigError
from kvprop.targets.sglang.config import SglangConfig
from kvprop.targets.sglang.shape import sglang_config


def config(*groups, num_blocks: int = 16, budget: int = 5, **engine) -> EngineConfig:
    return EngineConfig(allocator=AllocatorConfig(tuple(groups), num_blocks), token_budget=budget, **engine)


def test_a_block_is_a_page_and_the_budget_a_whole_page_chunk():
    assert sglang_config(config(FullAttention(4))) == SglangConfig(
        page_size=4, pool_tokens=64, chunked_prefill_size=8, swa_pool_tokens=48
    )


def test_a_sliding_window_group_makes_a_full_and_swa_hybrid():
    got = sglang_config(config(FullAttention(2), SlidingWindow(2, 6)))
    assert (got.sliding_window, got.pool_tokens, got.swa_pool_tokens) == (6, 32, 24)


def test_an_swa_pool_sglang_refuses_at_start_up_is_refused():
    with pytest.raises(ConfigError, match="SGLang refuses an SWA pool of 8 tokens for a window of 6"):
        sglang_config(config(FullAttention(2), SlidingWindow(2, 6), num_blocks=5))


def test_a_state_group_has_no_sglang_counterpart_here():
    with pytest.raises(ConfigError, match="full attention and sliding windows only"):
        sglang_config(config(FullAttention(4), Mamba(4, "align", 0)))


def test_a_connector_is_refused_with_what_is_allowed():
    with pytest.raises(ConfigError, match="takes no KV connector"):
        sglang_config(config(FullAttention(4), connector="sync"))


def test_fuzz_on_sglang_without_sglang_installed_exits_2_with_the_way_out(tmp_path):
    """kvprop's own environment has no SGLang: the target is refused before any walk runs."""
    try:
        import sglang  # noqa: F401

        pytest.skip("SGLang is installed in this environment")
    except ImportError:
        pass
    out = subprocess.run(
        [sys.executable, "-m", "kvprop", "fuzz", "--target", "sglang", "--max-runs", "1", "--workers", "1",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert (out.returncode, "make sglang-env" in out.stderr, "Traceback" in out.stderr) == (2, True, False)
