"""Targets loaded by path: any ``factory(config) -> (allocator, view)`` plugs into the engine.

``tests/example_target.py`` is the worked example of docs/targets.md: kvprop's own
allocator behind a path, so a walk through it must match the built-in target exactly,
and its buggy twin must be found through the path just as the variant is.
"""

from __future__ import annotations

import sys

import pytest

from kvprop.allocator.kv_cache_manager import KVCacheManager
from kvprop.allocator.specs import AllocatorConfig, EngineConfig, FullAttention, SlidingWindow
from kvprop.allocator.view import AllocatorView
from kvprop.check.checker import Checker, drain
from kvprop.errors import ConfigError, TargetError
from kvprop.search.walk import run_walk
from kvprop.targets import build_engine, load_factory

EXAMPLE = "tests.example_target:make_target"
BUGGY = "tests.example_target:make_buggy_target"
CONFIG = EngineConfig(AllocatorConfig((FullAttention(4), SlidingWindow(4, 8)), 16), connector="sync")


def test_path_target_drives_the_engine_to_completion():
    checker = Checker()
    engine = build_engine(CONFIG, target=EXAMPLE, hooks=checker)
    assert type(engine.allocator) is KVCacheManager and type(engine.view) is AllocatorView
    engine.add_request(list(range(9)), 3)
    engine.add_request(list(range(5)) + [7, 7], 2)
    assert drain(engine, checker) > 0
    assert not engine.requests
    assert engine.view.num_free_blocks == CONFIG.allocator.usable_blocks


@pytest.mark.parametrize("seed", range(12))
def test_walk_through_a_path_target_matches_the_builtin_target(seed):
    builtin, by_path = run_walk(seed), run_walk(seed, target=EXAMPLE)
    assert by_path.failure == builtin.failure
    assert (by_path.steps_run, by_path.events) == (builtin.steps_run, builtin.events)
    assert by_path.trace.target == EXAMPLE


def test_bug_behind_a_path_target_is_found():
    for seed in range(500):
        result = run_walk(seed, target=BUGGY)
        if result.failure is not None:
            break
    assert result.failure is not None, "no walk of 500 found the per-group allocation bug behind the path target"
    assert result.failure.kind == "block-in-two-groups"


@pytest.mark.parametrize(
    ("target", "says"),
    [
        ("tests.example_target", "'package.module:factory'"),
        (":make_target", "'package.module:factory'"),
        ("tests.example_target:", "'package.module:factory'"),
        ("tests.no_such_module:make_target", "cannot import 'tests.no_such_module'"),
        ("tests.example_target:no_such_factory", "has no attribute 'no_such_factory'"),
    ],
)
def test_bad_target_path_is_a_config_error_that_says_what_is_wrong(target, says):
    with pytest.raises((ConfigError, TargetError)) as info:
        build_engine(CONFIG, target=target)
    assert repr(target) in str(info.value) and says in str(info.value)


def test_variant_with_a_path_target_is_a_config_error():
    with pytest.raises(ConfigError, match="applies to the kvprop target only"):
        build_engine(CONFIG, variant="interleaved-external-alloc", target=EXAMPLE)


def test_load_factory_returns_the_callable():
    from tests import example_target

    assert load_factory(EXAMPLE) is example_target.make_target


def test_vllm_target_without_vllm_says_how_to_install(monkeypatch):
    """Where vLLM is absent (or, here, made unimportable) the built-in 'vllm' target
    explains how to build an environment that has it."""
    from kvprop.targets.vllm import loading

    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setattr(loading, "_VLLM", None)
    with pytest.raises(ConfigError, match=r"make vllm-env VLLM_VERSION=0\.24\.0"):
        build_engine(CONFIG, target="vllm")
