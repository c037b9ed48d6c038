"""vLLM's own allocator through kvprop (``--target vllm``); skipped where vLLM is absent.

Run inside an environment built by ``make vllm-env VLLM_VERSION=...``::

    .venv-vllm-0.23.0/bin/python -m pytest -m vllm
    .venv-vllm-0.24.0/bin/python -m pytest -m vllm

Expectations follow the installed release: up to 0.23.x vLLM allocates a request's hit
and external blocks group by group, so one group's new blocks can evict another group's
untouched hits (the motivating bug); 0.24.0 has the two-phase fix (vLLM PR #44409).
"""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
# make test-vllm (and so CI) sets KVPROP_REQUIRE_VLLM: there a missing vLLM fails, never skips
vllm = __import__("vllm") if os.environ.get("KVPROP_REQUIRE_VLLM") else pytest.importorskip("vllm")

import attrs  # noqa: E402
from helpers import checkpoint_find, imported_modules, motivating_trace, report_find, reported  # noqa: E402
from hypothesis import Phase, settings  # noqa: E402
from hypothesis.stateful import run_state_machine_as_test  # noqa: E402
from packaging.version import Version  # noqa: E402

from kvprop.allocator.specs import (  # noqa: E402
    AllocatorConfig,
    EngineConfig,
    FullAttention,
    Mamba,
    SlidingWindow,
    without_checkpoints,
)
from kvprop.check import invariants as inv  # noqa: E402
from kvprop.errors import ConfigError, TargetCrash, Violation  # noqa: E402
from kvprop.front.report import run_reproducer  # noqa: E402
from kvprop.repro.minimise import minimise  # noqa: E402
from kvprop.search import profiles  # noqa: E402
from kvprop.search import trace as tr  # noqa: E402
from kvprop.search.agree import agree  # noqa: E402
from kvprop.search.execute import execute  # noqa: E402
from kvprop.search.machine import failure_trace, machine_for  # noqa: E402
from kvprop.search.walk import plan, run_walk  # noqa: E402
from kvprop.sim.request import Request  # noqa: E402
from kvprop.targets import build_engine  # noqa: E402
from kvprop.targets.vllm.manager import make_target  # noqa: E402
from kvprop.targets.vllm.releases import release_rules  # noqa: E402

pytestmark = pytest.mark.vllm

RELEASE = Version(vllm.__version__).release[:2]
FIXED = RELEASE >= (0, 24)
HAS_BUG = not FIXED
NULL = 0
# What the per-group allocation bug shows first: the in-step check right after
# allocate_slots sees one physical block live in two groups.
BUG_KIND = "block-in-two-groups"
needs_bug = pytest.mark.skipif(FIXED, reason=f"vLLM {vllm.__version__} has the two-phase fix")
needs_fix = pytest.mark.skipif(HAS_BUG, reason=f"vLLM {vllm.__version__} predates the two-phase fix")


def req(request_id, tokens, block_size, max_new_tokens=4):
    return Request(request_id, list(tokens), max_new_tokens, block_size, 100_000)


def prefill(allocator, request, num_external=0):
    """Admit ``request`` the way the scheduler does: local hit, external tokens, the rest."""
    hits, num_hit, request.shared_prefix_boundary = allocator.get_computed_blocks(request)
    result = allocator.allocate_slots(
        request,
        request.num_tokens - num_hit - num_external,
        num_new_computed_tokens=num_hit,
        new_computed_blocks=hits,
        num_external_computed_tokens=num_external,
    )
    assert result is not None
    request.num_computed_tokens = request.num_tokens
    return hits, num_hit


def hit_ids(hits):
    return tuple([b.block_id for b in group] for group in hits)


# ---- reference scenarios (docs/reference-scenarios.md) ------------------------------------


def test_motivating_scenario_block_ids_per_release():
    """Full + sliding window (16 tokens), block size 4, 13 blocks: B hits A's 16 tokens in both
    groups, with the hit blocks at the free-queue head, and takes 8 external tokens."""
    allocator, view = make_target(AllocatorConfig((FullAttention(4), SlidingWindow(4, 16)), 13))
    a, c = req("A", range(16), 4), req("C", range(1000, 1008), 4)
    prefill(allocator, a)
    prefill(allocator, c)
    assert allocator.get_block_ids("A") == ([1, 2, 3, 4], [5, 6, 7, 8])
    assert [view.cache_key(b) for b in (1, 5)] == [(a.block_hashes[0], 0), (a.block_hashes[0], 1)]
    allocator.free(a)
    allocator.free(c)
    assert view.free_queue_ids() == [4, 3, 2, 1, 8, 7, 6, 5, 10, 9, 12, 11]

    b = req("B", list(range(16)) + list(range(2000, 2012)), 4)
    hits, num_hit, _ = allocator.get_computed_blocks(b)
    assert num_hit == 16 and hit_ids(hits) == ([1, 2, 3, 4], [5, 6, 7, 8])
    assert (
        allocator.allocate_slots(
            b, 4, num_new_computed_tokens=num_hit, new_computed_blocks=hits, num_external_computed_tokens=8
        )
        is not None
    )
    tables = inv.gather_tables(view)
    if FIXED:
        assert allocator.get_block_ids("B") == ([1, 2, 3, 4, 6, 5, 12], [NULL, NULL, 7, 8, 10, 9, 11])
        assert all(view.ref_cnt(i) == 1 for i in range(1, 13))
        inv.check_blocks(view, tables, view.ref_cnts(), view.cache_keys())
    else:
        assert allocator.get_block_ids("B") == ([1, 2, 3, 4, 8, 7, 10], [NULL, NULL, 7, 8, 6, 5, 9])
        assert view.ref_cnt(7) == view.ref_cnt(8) == 2
        with pytest.raises(Violation, match=BUG_KIND) as info:
            inv.check_blocks(view, tables, view.ref_cnts(), view.cache_keys())
        assert set(info.value.blocks) <= {7, 8} and info.value.groups == (0, 1)


def test_full_attention_free_order_per_release():
    """11 blocks of 16: A = 3 full blocks + a partial one, B = the same 3 + another tail; free
    A then B. 0.24 puts hashless blocks at the head; 0.23 puts everything at the tail."""
    allocator, view = make_target(AllocatorConfig((FullAttention(16),), 11))
    common = [i for i in range(3) for _ in range(16)]
    a, b = req("A", common + [3] * 7, 16), req("B", common + [4] * 5, 16)
    prefill(allocator, a)
    hits, num_hit = prefill(allocator, b)
    assert hit_ids(hits) == ([1, 2, 3],) and num_hit == 48
    assert allocator.get_block_ids("B") == ([1, 2, 3, 5],)
    assert [view.ref_cnt(i) for i in (1, 2, 3)] == [2, 2, 2]
    allocator.free(a)
    allocator.free(b)
    assert view.free_queue_ids() == ([5, 4, 6, 7, 8, 9, 10, 3, 2, 1] if FIXED else [6, 7, 8, 9, 10, 4, 5, 3, 2, 1])
    assert view.free_queue_ids_backward() == view.free_queue_ids()[::-1]

    again = req("C", common + [5] * 3, 16)
    hits, num_hit = prefill(allocator, again)
    assert hit_ids(hits) == ([1, 2, 3],) and len(allocator.get_block_ids("C")[0]) == 4


def test_decode_grows_the_vllm_request_and_names_its_new_hashes():
    """Tokens appended to the kvprop request reach vLLM's request: the partial block fills
    without allocating; crossing a boundary allocates one block and caches the full one
    under kvprop's hash of it."""
    allocator, view = make_target(AllocatorConfig((FullAttention(4),), 8))
    r = req("D", range(6), 4)
    prefill(allocator, r)
    assert allocator.get_block_ids("D") == ([1, 2],) and view.cache_key(2) is None
    for token in (6, 7):
        r.append_token(token)
        assert allocator.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1
    assert allocator.get_block_ids("D") == ([1, 2],)
    assert view.cache_key(2) == (r.block_hashes[1], 0) and view.num_cached_blocks(0, "D") == 2
    r.append_token(8)
    assert allocator.allocate_slots(r, 1) is not None
    assert allocator.get_block_ids("D") == ([1, 2, 3],)
    assert sorted(block_id for _, block_id in view.cache_map_items()) == [1, 2]


def test_engine_on_vllm_runs_to_completion_with_every_check():
    """A small workload through kvprop's engine (scheduler, sync connector, checks) drains clean."""
    from kvprop.check.checker import Checker, drain

    checker = Checker()
    config = EngineConfig(
        AllocatorConfig((FullAttention(4), SlidingWindow(4, 8)), 24), token_budget=8, connector="sync"
    )
    engine = build_engine(config, target="vllm", hooks=checker)
    for prompt in (range(10), list(range(8)) + [9, 9, 9], range(5)):
        engine.add_request(list(prompt), 3)
    drain(engine, checker)
    assert engine.view.num_free_blocks == 23 and not engine.view.request_ids(0)


@pytest.mark.parametrize("watched", [False, True], ids=["snapshots", "watched-blocks"])
def test_incremental_checks_find_what_full_sweeps_find(monkeypatch, watched):
    """The view's change tracking loses nothing, by snapshots (small pools) or by watching
    vLLM's blocks (large pools; here every pool): every walk ends the same way (same kind of
    violation at the same step; which block is named first may differ) with incremental
    checks as with a full sweep at every check."""
    from kvprop.targets.vllm import manager, view

    monkeypatch.setattr(view, "WATCH_FROM_BLOCKS", 0 if watched else 10**9)

    def outcomes():
        results = (run_walk(seed, target="vllm") for seed in range(40))
        return [(r.steps_run, r.failure and (r.failure.kind, r.failure.step)) for r in results]

    incremental = outcomes()
    declared = manager.capabilities()
    monkeypatch.setattr(manager, "capabilities", lambda: attrs.evolve(declared, change_log=False))  # full sweeps
    assert outcomes() == incremental


# ---- the state machine --------------------------------------------------------------------


def ci_settings(**overrides) -> settings:
    """The ``ci`` profile without making it every later test's default."""
    profiles.register()
    return settings(settings.get_profile("ci"), **overrides)


@needs_bug
@pytest.mark.slow
def test_state_machine_finds_the_bug_from_scratch():
    machine = machine_for(target="vllm")
    # No shrinking here: Hypothesis shrinks a vLLM failure for minutes; the walker test
    # below shrinks with kvprop's own minimiser instead.
    with pytest.raises(Violation, match=BUG_KIND):
        run_state_machine_as_test(machine, settings=ci_settings(max_examples=5000, phases=[Phase.generate]))
    # What Hypothesis found is a plain kvprop trace: it replays without Hypothesis.
    trace = failure_trace(machine)
    failure = execute(trace, target="vllm")
    assert failure is not None and failure.kind == BUG_KIND


@needs_fix
@pytest.mark.slow
def test_state_machine_finds_nothing_but_the_triaged_bugs_on_the_fixed_release():
    """Clean, or stopped by one of the release's triaged finds (docs/findings.md): in every one a key
    two blocks hold announced per block (tests/test_vllm_router.py), from 0.30.0 the full report of a
    window's skipped positions, from 0.33.0 the checkpoint and report finds."""
    triaged = {"router-forgets-resident"}
    if RELEASE >= (0, 30):
        triaged.add("events-reannounce-unheld")
    if RELEASE >= (0, 33):
        triaged |= {"data-mismatch", "target-crash"}
    machine = machine_for(target="vllm")
    try:
        run_state_machine_as_test(machine, settings=ci_settings())
    except (Violation, TargetCrash):
        pass  # judged below, by what the machine recorded
    found = {e.kind if isinstance(e, Violation) else "target-crash" for _, _, e, _ in machine.failures}
    assert found <= triaged, machine.failures


# ---- the walker, the minimiser and replay ------------------------------------------------

# The walker's first counterexample on vLLM 0.23.0, minimised by kvprop (seed 150, 72 -> 5
# operations; the duplicate block appears in the final drain, when the sync connector
# offers blocks it offloaded earlier as external tokens).
MINIMISED_ON_0_23 = {
    "format": "kvprop-trace/1",
    "engine": "walk",
    "seed": 150,
    "variant": None,
    "target": "vllm",
    "config": {
        "groups": [{"kind": "full", "block_size": 4}, {"kind": "full", "block_size": 4}],
        "num_blocks": 31,
        "enable_caching": True,
        "token_budget": 1,
        "lookahead": 0,
        "connector": "sync",
        "vocab": 4,
    },
    "steps": [
        {"op": "AddLargeRequest", "parent": 0, "seed": 0},
        {"op": "AddRequest", "parent": 0, "cut": 31, "extra": 1, "seed": 0, "max_new_tokens": 1},
        {"op": "AddRequest", "parent": 0, "cut": 2, "extra": 10, "seed": 0, "max_new_tokens": 1},
        {"op": "AddRequest", "parent": 0, "cut": 0, "extra": 1, "seed": 0, "max_new_tokens": 1},
        {"op": "AddRequest", "parent": 3, "cut": 1, "extra": 1, "seed": 0, "max_new_tokens": 1},
    ],
    "drain": True,
    "failure": None,
}
WALK_SEEDS = 2000


def test_recorded_counterexample_replays_per_release():
    """The minimised 0.23.0 counterexample fails the same way on a buggy release and passes
    on a fixed one: a regression test for the upstream fix."""
    trace = tr.from_dict(json.loads(json.dumps(MINIMISED_ON_0_23)))
    failure = execute(trace, target="vllm")
    if FIXED:
        assert failure is None
    else:
        assert failure is not None and failure.kind == BUG_KIND, failure


def first_failing_walk(seeds: int):
    for seed in range(seeds):
        result = run_walk(seed, target="vllm")
        if result.failure is not None:
            return result
    return None


@needs_bug
@pytest.mark.slow
def test_walker_finds_shrinks_and_replays_the_bug():
    result = first_failing_walk(WALK_SEEDS)
    assert result is not None, f"no walk of {WALK_SEEDS} failed on vLLM {vllm.__version__}"
    assert result.failure.kind == BUG_KIND
    best = minimise(attrs.evolve(result.trace, failure=result.failure), target="vllm")
    assert best.failure.kind == BUG_KIND and len(best.steps) < len(result.trace.steps)
    # Durable: it survives the JSON round trip and replays without Hypothesis.
    replayed = tr.from_dict(json.loads(json.dumps(tr.to_dict(best))))
    failure = execute(replayed, target="vllm")
    assert failure is not None and failure.kind == BUG_KIND and failure.step == best.failure.step


@needs_fix
@pytest.mark.slow
def test_walker_is_clean_on_the_fixed_release():
    """Without prefill checkpoints and the full report: their bugs are pinned below. A walk may stop
    at a key two blocks hold, announced per block, which a router's set forgets (every release;
    pinned in tests/test_vllm_router.py)."""
    for seed in range(300):
        trace = plan(seed)
        config = without_checkpoints(trace.config)
        config = attrs.evolve(config, allocator=attrs.evolve(config.allocator, kv_cache_report_mode="incremental"))
        try:
            failure = execute(attrs.evolve(trace, config=config), target="vllm")
        except ConfigError:
            continue  # a shape this release's target refuses
        assert failure is None or failure.kind == "router-forgets-resident", (seed, failure)


@pytest.mark.skipif(RELEASE < (0, 30), reason="the full report is new in 0.30.0")
def test_the_full_report_announces_positions_a_window_skipped_from_0_30():
    trace = report_find("skipped-positions")
    assert [getattr(execute(trace, target=t), "kind", None) for t in ("vllm", None)] == [
        "events-reannounce-unheld",
        None,
    ]


@pytest.mark.skipif(RELEASE < (0, 33), reason="hits inside a block follow 0.33.0's rules from 0.33.0 only")
def test_the_full_report_of_a_hit_inside_a_block_crashes_in_0_33():
    trace = report_find("inside-a-block")
    assert [getattr(execute(trace, target=t), "kind", None) for t in ("vllm", None)] == ["target-crash", None]


@pytest.mark.skipif(RELEASE < (0, 33), reason="prefill checkpoints follow 0.33.0's rules from 0.33.0 only")
def test_a_checkpoint_overwrites_the_running_state_in_0_33():
    """docs/findings.md: the manager reserves no column before the prefill's end and moves the
    scratch block the worker then writes the checkpoint into to the running state."""
    trace = checkpoint_find("over-running-state")
    assert [getattr(execute(trace, target=t), "kind", None) for t in ("vllm", None)] == ["data-mismatch", None]


@pytest.mark.skipif(
    RELEASE < (0, 33), reason="0.30.0's hits inside a block follow other rules (the target refuses them)"
)
def test_a_hit_inside_a_block_keyed_in_the_same_step_copies_it_unwritten_in_0_33():
    """docs/findings.md: the manager copies a block the forward pass has not yet computed."""
    trace = tr.load(Path(__file__).parent / "data" / "copy-before-compute.json")
    assert [getattr(execute(trace, target=t), "kind", None) for t in ("vllm", None)] == ["data-mismatch", None]


# ---- retention and step-for-step agreement with kvprop's model -------------------------------


@pytest.mark.parametrize("interval", [None, 0, 8])
def test_the_retention_interval_reaches_vllms_coordinator(interval):
    config = AllocatorConfig((FullAttention(4), SlidingWindow(4, 8)), 32, retention_interval=interval)
    if RELEASE < (0, 23) and interval is not None:
        with pytest.raises(ConfigError, match="no prefix-cache retention"):
            make_target(config)
        return
    allocator, _ = make_target(config)
    assert getattr(allocator.manager.coordinator, "retention_interval", None) == interval


@pytest.mark.parametrize("log_stats", [True, False])
def test_the_statistics_setting_reaches_vllms_manager(log_stats):
    allocator, _ = make_target(AllocatorConfig((FullAttention(4),), 8, log_stats=log_stats))
    assert allocator.manager.log_stats is log_stats


def test_the_residency_metrics_sample_every_block_of_vllms_pool():
    allocator, _ = make_target(AllocatorConfig((FullAttention(4),), 8, kv_cache_metrics=True))
    assert allocator.manager.block_pool.metrics_collector.sample_rate == 1.0


def test_the_eagle_drop_reaches_vllms_manager():
    allocator, _ = make_target(AllocatorConfig((FullAttention(4),), 8, eagle=True))
    assert allocator.manager.use_eagle is True


@pytest.mark.skipif(RELEASE >= (0, 33), reason="0.33.0 looks one block past the candidate, as kvprop models")
def test_the_eagle_drop_in_a_hybrid_model_is_refused_before_0_33():
    with pytest.raises(ConfigError, match="no eagle_proof_margin"):
        make_target(AllocatorConfig((FullAttention(4), SlidingWindow(4, 8)), 16, eagle=True))


def eagle_seeds(count: int) -> list[int]:
    """Walk seeds the sampler gives the EAGLE drop (two groups only where the release's rules are 0.33.0's)."""
    seeds, seed = [], 0
    while len(seeds) < count:
        allocator = plan(seed).config.allocator
        if allocator.eagle and (RELEASE >= (0, 33) or len(allocator.groups) == 1):
            seeds.append(seed)
        seed += 1
    return seeds


def synchronous_seeds(count: int) -> list[int]:
    """The first walk seeds whose configuration has no batch in flight: the manager target draws
    none (kvprop's scheduler in front of it keeps in-flight counts vLLM's manager reads from its
    own scheduler's requests), so ``agree`` compares only these."""
    seeds, seed = [], 0
    while len(seeds) < count:
        if plan(seed).config.pipeline_depth == 1:
            seeds.append(seed)
        seed += 1
    return seeds


@needs_fix  # before 0.24.0 vLLM takes a hit's external blocks group by group, in its own order
def test_kvprop_and_vllm_agree_step_for_step():
    """The same walks on kvprop's allocator and on vLLM's leave the same tables, cache keys
    and free count after every operation (retention, junctions, windows and hits inside a block
    included; before 0.30.0 vLLM has no junction, so its walks run without retention and state
    groups; 0.30.0's hits inside a block follow other rules, so its walks end hits on blocks;
    from 0.30.0 kvprop runs as the release's known bugs: ``release_rules``)."""
    result = agree("vllm", synchronous_seeds(40), **release_rules(RELEASE))
    assert (result.disagreement, result.walks) == (None, 40)


@needs_fix
def test_kvprop_and_vllm_agree_step_for_step_with_the_eagle_drop():
    result = agree("vllm", eagle_seeds(20), **release_rules(RELEASE))
    assert (result.disagreement, result.walks) == (None, 20)


def test_the_shapes_it_declares_for_this_release_are_almost_never_refused():
    """The sampler draws what this release's manager target declares it builds
    (``vllm.shapes.release_shapes``): at most 5% of the draws are refused."""
    import random

    from kvprop.search.alphabet import RandomChooser, sample_config
    from kvprop.targets import shapes_of
    from kvprop.targets.vllm.releases import allocator_refusal

    shapes = shapes_of("vllm")
    configs = [sample_config(RandomChooser(random.Random(seed)), shapes) for seed in range(1000)]
    refused = [why for config in configs if (why := allocator_refusal(config.allocator)) is not None]
    assert len(refused) <= 50, refused[:3]


# One Mamba group in mode "align" whose block is wider than the token budget.
WIDE_STATE_BLOCK = EngineConfig(AllocatorConfig((Mamba(16, "align"),), 8), token_budget=1)


@pytest.mark.skipif(RELEASE >= (0, 30), reason="0.30.0 starts with a state block wider than the budget")
def test_the_manager_target_refuses_what_vllm_refuses_at_start_up():
    message = (
        r"refuses to start .* In Mamba cache align mode, block_size \(16\) must be <= max_num_batched_tokens \(1\)"
    )
    with pytest.raises(ConfigError, match=message):
        build_engine(WIDE_STATE_BLOCK, target="vllm")


@pytest.mark.skipif(RELEASE < (0, 30), reason="before 0.30.0 vLLM refuses to start with this configuration")
def test_the_manager_target_builds_what_vllm_starts_with():
    assert build_engine(WIDE_STATE_BLOCK, target="vllm").config == WIDE_STATE_BLOCK


# ---- kvprop report: reproducers that need only vLLM -------------------------------------------


@pytest.mark.skipif(RELEASE < (0, 33), reason="hits inside a block follow 0.33.0's rules from 0.33.0 only")
def test_the_report_of_a_crash_is_a_script_that_raises_vllms_exception_without_kvprop(tmp_path):
    code, out = reported(tmp_path, report_find("inside-a-block", target="vllm"))
    run = run_reproducer(out)
    assert (code, run.returncode, run.stderr.strip().splitlines()[-1]) == (0, 1, "IndexError: list index out of range")


@pytest.mark.skipif(RELEASE < (0, 33), reason="hits inside a block follow 0.33.0's rules from 0.33.0 only")
def test_the_report_of_a_crash_is_titled_by_the_release_and_the_exception_and_lists_the_groups(tmp_path):
    _, out = reported(tmp_path, report_find("inside-a-block", target="vllm"))
    lines = (out / "REPORT.md").read_text().splitlines()
    group = "- group 1: `MambaSpec` (block_size=16, mamba_cache_mode='align')"
    assert (lines[0], group in lines) == (f"# vLLM {vllm.__version__}: KVCacheManager raises IndexError", True)


@pytest.mark.skipif(RELEASE < (0, 33), reason="hits inside a block follow 0.33.0's rules from 0.33.0 only")
def test_a_reproducer_imports_only_vllm_torch_and_the_standard_library(tmp_path):
    _, out = reported(tmp_path, report_find("inside-a-block", target="vllm"))
    assert imported_modules((out / "repro.py").read_text()) == {"collections", "inspect", "os", "sys", "torch", "vllm"}


@pytest.mark.skipif(RELEASE < (0, 33), reason="hits inside a block follow 0.33.0's rules from 0.33.0 only")
def test_a_reproducer_on_a_release_whose_manager_lacks_a_keyword_it_passes_exits_2_before_any_call(tmp_path):
    """Another release's API is no answer either way: the script checks the calls it makes first."""
    _, out = reported(tmp_path, report_find("inside-a-block", target="vllm"))
    script = out / "repro.py"
    text = script.read_text()
    api = next(line for line in text.splitlines() if line.startswith("API = "))
    script.write_text(text.replace(api, api.replace("'delay_cache_blocks'", "'a_keyword_no_release_takes'")))
    run = run_reproducer(out)
    assert (run.returncode, "does not take manager.allocate_slots()" in run.stdout) == (2, True)


@needs_bug
def test_the_report_of_the_motivating_bug_asserts_a_block_in_two_groups(tmp_path):
    code, out = reported(tmp_path, attrs.evolve(motivating_trace(), target="vllm", variant=None))
    run = run_reproducer(out)
    last = run.stderr.strip().splitlines()[-1]
    assert (code, run.returncode, last.startswith("AssertionError: block ids in the block tables of more")) == (
        0,
        1,
        True,
    )


@needs_fix
def test_the_motivating_trace_has_nothing_to_report_on_a_fixed_release(tmp_path, capsys):
    code, out = reported(tmp_path, attrs.evolve(motivating_trace(), target="vllm", variant=None))
    assert (code, "does not fail" in capsys.readouterr().err, out.exists()) == (2, True, False)


@pytest.mark.skipif(RELEASE < (0, 33), reason="prefill checkpoints follow 0.33.0's rules from 0.33.0 only")
def test_a_find_vllms_state_alone_cannot_state_is_refused_naming_the_supported_kinds(tmp_path, capsys):
    code, out = reported(tmp_path, checkpoint_find("over-running-state", target="vllm"))
    err = capsys.readouterr().err
    assert (code, "'data-mismatch'" in err, "supported kinds: target-crash, " in err) == (
        2,
        True,
        True,
    )


def broken(kind: str, allocator) -> None:
    """One way to break each property a reproducer states, on request ``r0``'s first block."""
    pool, first = allocator.pool, allocator.manager.get_block_ids("r0")[0][0]
    if kind == "block-in-two-groups":
        allocator.manager.coordinator.single_type_managers[1].req_to_blocks["r0"].append(pool.blocks[first])
    elif kind == "ref-cnt-mismatch":
        pool.blocks[first].ref_cnt += 1
    elif kind == "free-queue-membership":
        pool.free_block_queue.popleft()  # out of the queue, its ref_cnt still 0
    else:  # free-count
        pool.free_block_queue.num_free_blocks += 1


def holds(kind: str, allocator) -> bool:
    from kvprop.repro.vllm_script import CHECKS

    null = allocator.pool.null_block.block_id
    scope = {"manager": allocator.manager, "live": ["r0"], "null": null, "collections": collections}
    try:
        exec(CHECKS[kind], scope)  # noqa: S102 - kvprop's own check source
    except AssertionError:
        return False
    return True


@pytest.mark.parametrize("kind", ["block-in-two-groups", "ref-cnt-mismatch", "free-queue-membership", "free-count"])
def test_each_property_a_reproducer_states_holds_on_a_sound_manager_and_fails_on_a_broken_one(kind):
    allocator, _ = make_target(AllocatorConfig((FullAttention(4), SlidingWindow(4, 8)), 16))
    prefill(allocator, req("r0", range(10), 4))
    sound = holds(kind, allocator)
    broken(kind, allocator)
    assert (sound, holds(kind, allocator)) == (True, False)
