"""The target contract (``kvprop.targets.protocol``): declared capabilities, declared shapes,
the registry, and no capability discovered by probing a target's objects."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import attrs
import pytest

from kvprop.allocator.specs import AllocatorConfig, EngineConfig, FullAttention, Mamba
from kvprop.allocator.view import AllocatorView
from kvprop.capabilities import ANY_SHAPE, EVERY, NONE, Capabilities, Shapes
from kvprop.errors import ConfigError
from kvprop.search.alphabet import RandomChooser, sample_config
from kvprop.search.walk import run_walk
from kvprop.search.walk import start as walk_start
from kvprop.targets import build_engine, check_built
from kvprop.targets.kvprop import make_allocator
from kvprop.targets.protocol import REGISTRY, VLLM_CAPABILITIES, Built, CompletedView, check_declared

ROOT = Path(__file__).resolve().parent.parent
CONFIG = EngineConfig(AllocatorConfig((FullAttention(4),), 16))


def kvprop_allocator():
    allocator = make_allocator(CONFIG.allocator)
    return allocator, AllocatorView(allocator)


def test_kvprop_targets_lists_the_registry_with_what_each_declares():
    r = subprocess.run([sys.executable, "-m", "kvprop", "targets", "--json"], capture_output=True, text=True, cwd=ROOT)
    listed = {row["name"]: row["capabilities"] for row in json.loads(r.stdout)}
    expected = {name: list(t.capabilities.declared()) for name, t in REGISTRY.items()}
    assert (r.returncode, listed) == (0, expected)


def test_vllm_registers_every_capability_but_whole_tables_key_lookup_a_fixed_null_count_and_deferred_frees():
    expected = {"raw_tables", "key_lookup", "null_count_fixed", "deferred_frees"}
    assert set(EVERY.declared()) - set(VLLM_CAPABILITIES.declared()) == expected


def test_a_plain_pair_declares_nothing():
    assert check_built("t", kvprop_allocator()).capabilities == NONE


def test_a_declared_capability_whose_calls_are_missing_is_refused():
    allocator, view = kvprop_allocator()
    with pytest.raises(ConfigError, match=r"declares change_log, but its view \(_BareView\) lacks \['take_changes'"):
        check_declared("t", Built(allocator, _BareView(view), Capabilities(change_log=True)))


class _BareView:
    """Every required call of a view, answered by kvprop's, and nothing more."""

    def __init__(self, view=None):
        self._view = view

    def __getattr__(self, name):
        from kvprop.targets.protocol import VIEW_CALLS, VIEW_FIELDS

        if name in VIEW_CALLS + VIEW_FIELDS and self._view is not None:
            return getattr(self._view, name)
        raise AttributeError(name)


def test_an_undeclared_report_reads_empty_even_where_the_view_has_it():
    allocator, view = kvprop_allocator()
    completed = CompletedView(view, NONE)
    assert (completed.extra_keys(), completed.further_keys(1), completed.pending_copies(), completed.num_evictions) == (
        {},
        [],
        [],
        0,
    )


def test_an_engine_over_a_plain_pair_makes_no_optional_call():
    engine = build_engine(CONFIG, target="tests.example_target:make_plain_target")
    assert (engine.tells_steps, engine.copies_blocks, type(engine.view).__name__) == (False, False, "CompletedView")


def test_an_engine_over_kvprops_allocator_makes_every_optional_call():
    engine = build_engine(CONFIG)
    assert (engine.capabilities, engine.tells_steps, engine.copies_blocks) == (EVERY, True, True)


# hits inside a block: a hash unit below the block size, full attention beside a state group
PARTIAL_HITS = EngineConfig(AllocatorConfig((FullAttention(4), Mamba(4)), 16, hash_unit=2))
PLAIN = "tests.example_target:make_plain_target"


def undeclared(config: EngineConfig, target: str) -> str:
    """The capabilities a refusal of ``config`` on ``target`` names as undeclared."""
    with pytest.raises(ConfigError) as refused:
        build_engine(config, target=target)
    return re.search(r"does not declare ([a-z_, ]+), which this configuration needs", str(refused.value)).group(1)


def test_a_plain_pair_on_a_state_group_with_caching_is_refused_naming_step_notice():
    config = EngineConfig(AllocatorConfig((FullAttention(4), Mamba(4)), 16))
    assert undeclared(config, PLAIN) == "step_notice"


def test_a_plain_pair_on_hits_inside_a_block_is_refused_naming_each_capability_they_need():
    assert undeclared(PARTIAL_HITS, PLAIN) == "step_notice, block_copies, keys_inside_blocks, pending_copies"


def test_a_refusal_for_an_undeclared_capability_says_how_to_declare_it():
    config = EngineConfig(AllocatorConfig((FullAttention(4), Mamba(4)), 16))
    with pytest.raises(ConfigError, match=re.escape("Built(allocator, view, Capabilities(step_notice=True))")):
        build_engine(config, target=PLAIN)


def test_a_target_declaring_the_capabilities_builds_hits_inside_a_block():
    engine = build_engine(PARTIAL_HITS, target="tests.example_target:make_target")
    assert (engine.tells_steps, engine.copies_blocks) == (True, True)


def test_a_walk_on_a_plain_pair_counts_a_shape_needing_a_capability_as_refused():
    def caches_states(seed):
        config = walk_start(seed).config.allocator
        return config.enable_caching and any(isinstance(g, Mamba) for g in config.groups)

    result = run_walk(next(s for s in range(100) if caches_states(s)), target=PLAIN)
    assert (result.steps_run, result.failure, "step_notice" in (result.refused or "")) == (0, None, True)


def draws(shapes: Shapes, n: int = 1000) -> list[EngineConfig]:
    return [sample_config(RandomChooser(random.Random(seed)), shapes) for seed in range(n)]


def test_every_shape_allowed_draws_what_no_declaration_draws():
    assert draws(ANY_SHAPE, 200) == [sample_config(RandomChooser(random.Random(seed))) for seed in range(200)]


def test_the_sampler_draws_only_the_declared_shapes():
    one_full = Shapes(frozenset({"full"}), 1, kv_events=False, eagle=False, hits_inside_blocks=False, retention=False)
    seen = Counter()
    for config in draws(one_full):
        a = config.allocator
        seen["one full-attention group"] += a.groups == (FullAttention(a.block_size),)
        seen["events"] += a.enable_kv_cache_events
        seen["eagle"] += a.eagle
        seen["hash unit below the block"] += a.unit != a.block_size
        seen["retention"] += a.retention_interval not in (None, 0)
    assert dict(seen) == {
        "one full-attention group": 1000,
        "events": 0,
        "eagle": 0,
        "hash unit below the block": 0,
        "retention": 0,
    }


def test_shapes_without_lookahead_or_eagle_and_with_a_budget_for_the_drafts_are_drawn_so():
    shapes = Shapes(lookahead=False, eagle=False, drafts_within_budget=True)  # vLLM's scheduler target's
    bad = [c for c in draws(shapes) if c.lookahead or c.allocator.eagle or c.token_budget < 1 + c.speculative_tokens]
    assert bad == []


def test_shapes_without_checkpoints_or_a_state_group_beside_a_connector_are_drawn_so():
    shapes = Shapes(checkpoints=False, state_with_connector=False)
    bad = [
        c
        for c in draws(shapes)
        for g in c.allocator.groups
        if isinstance(g, Mamba) and (g.checkpoint is not None or c.connector != "off")
    ]
    assert bad == []


def test_a_state_group_is_drawn_only_where_declared():
    no_state = attrs.evolve(ANY_SHAPE, group_kinds=frozenset({"full", "sliding_window", "chunked_local"}))
    assert [c for c in draws(no_state) if any(isinstance(g, Mamba) for g in c.allocator.groups)] == []


# ---- no capability is discovered by probing a target's objects -----------------------------

# Every hasattr/getattr left in kvprop/, by file, with why it is not a capability probe. A new
# one fails this test until it is declared instead, or added here with its reason.
PROBES_LEFT = {
    "kvprop/front/cli.py": (4, "argparse's namespace and a command's function by its name"),
    "kvprop/front/values.py": (1, "the OS's affinity call"),
    "kvprop/front/agree_command.py": (1, "argparse's namespace"),
    "kvprop/front/ray_fuzz.py": (1, "the stream Ray's output is sent to, standing in for stdout"),
    "kvprop/search/store.py": (1, "a Redis command by its name"),
    "kvprop/front/commands.py": (2, "argparse's namespace"),
    "kvprop/front/fuzz_command.py": (2, "argparse's namespace"),
    "kvprop/front/coverage.py": (1, "a module's __file__"),
    "kvprop/front/report.py": (2, "the fields of the installed vLLM release's spec dataclasses"),
    "kvprop/repro/vllm_record.py": (4, "the installed vLLM release's API, which differs between releases"),
    "kvprop/repro/vllm_script.py": (3, "dataclass fields written as constructor calls; the reproducer's own API check"),
    "kvprop/repro/scheduler_runner.py": (
        6,
        "the reproducer's own reads of the scheduler's output and the connector's jobs, which differ by release",
    ),
    "kvprop/check/sglang.py": (
        3,
        "SGLang's tree classes differ: RadixCache totals itself, UnifiedRadixCache per component in a core",
    ),
    "kvprop/targets/sglang/release.py": (1, "SGLang's API per release, each facet read from what the release defines"),
    "kvprop/targets/sglang/engine.py": (1, "the bound method of SGLang's tree an observer wraps"),
    "kvprop/targets/vllm/specs.py": (
        3,
        "where the installed vLLM release registers its KV cache specs, and how it names roles",
    ),
    "kvprop/repro/script_events.py": (1, "the reproducer's read of an event's group, which events carry from 0.30.0"),
    "kvprop/repro/vllm_scheduler_record.py": (1, "the engine's operations, wrapped by name to record them"),
    "kvprop/targets/vllm/recipe.py": (1, "one of vLLM's start-up checks, run by the name it is recorded under"),
    "kvprop/repro/minimise.py": (2, "fields of kvprop's own operations and group specs"),
    "kvprop/search/alphabet.py": (2, "kvprop's own operation classes (ready, WEIGHTS)"),
    "kvprop/sim/target_calls.py": (1, "the facade call the engine names, one of the required calls"),
    "kvprop/allocator/options.py": (1, "the configuration field an option declares"),
    "kvprop/capabilities.py": (2, "the declaration's own fields"),
    "kvprop/targets/__init__.py": (2, "the attribute the user named; what a registered target names (named)"),
    "kvprop/targets/protocol.py": (5, "a declaration held to its word once at build; the completed view's forwarding"),
    "kvprop/targets/vllm/config.py": (3, "the installed vLLM release's API"),
    "kvprop/targets/vllm/loading.py": (1, "whether vLLM's block hasher is already set up in this process"),
    "kvprop/targets/vllm/manager.py": (6, "the installed vLLM release's API, which differs between releases"),
    "kvprop/targets/vllm/offload.py": (8, "the installed vLLM release's API"),
    "kvprop/targets/vllm/releases.py": (4, "the installed vLLM release's API, which differs between releases"),
    "kvprop/targets/vllm/scheduler.py": (3, "the installed vLLM release's API"),
    "kvprop/targets/vllm/batches.py": (2, "the installed vLLM release's API"),
    "kvprop/targets/vllm/view.py": (5, "the installed vLLM release's API, which differs between releases"),
}


def test_no_capability_is_probed_beyond_the_stated_places():
    found = {}
    for path in sorted((ROOT / "kvprop").rglob("*.py")):
        count = len(re.findall(r"\b(?:hasattr|getattr)\(", path.read_text()))
        if count:
            found[str(path.relative_to(ROOT))] = count
    assert found == {path: count for path, (count, _) in PROBES_LEFT.items()}
