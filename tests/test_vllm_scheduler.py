"""vLLM's own scheduler through kvprop (``--target vllm-scheduler``); skipped where vLLM is absent.

Run inside an environment built by ``make vllm-env VLLM_VERSION=...``::

    .venv-vllm-0.24.0/bin/python -m pytest -m vllm tests/test_vllm_scheduler.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
# make test-vllm (and so CI) sets KVPROP_REQUIRE_VLLM: there a missing vLLM fails, never skips
vllm = __import__("vllm") if os.environ.get("KVPROP_REQUIRE_VLLM") else pytest.importorskip("vllm")

from helpers import add_op as add  # noqa: E402
from helpers import checkpoint_find, imported_modules, report_find, reported  # noqa: E402
from packaging.version import Version  # noqa: E402

from kvprop.allocator.specs import AllocatorConfig, EngineConfig, FullAttention, SlidingWindow  # noqa: E402
from kvprop.check.checker import Checker, drain  # noqa: E402
from kvprop.errors import ConfigError  # noqa: E402
from kvprop.front.report import run_reproducer  # noqa: E402
from kvprop.search import trace as tr  # noqa: E402
from kvprop.search.execute import execute  # noqa: E402
from kvprop.search.harness import Harness  # noqa: E402
from kvprop.search.walk import plan, run_walk  # noqa: E402
from kvprop.sim.events import EV_LOAD_FAIL, EV_PREEMPT, EV_SPEC_ACCEPT, EV_SPEC_REJECT  # noqa: E402
from kvprop.sim.request import Status  # noqa: E402
from kvprop.targets import build_engine  # noqa: E402
from kvprop.targets.vllm.releases import scheduler_refusal  # noqa: E402

pytestmark = pytest.mark.vllm
RELEASE = Version(vllm.__version__).release[:2]

HYBRID = (FullAttention(4), SlidingWindow(4, 8))


def engine_for(config, checker=None):
    return build_engine(config, target="vllm-scheduler", hooks=checker or Checker())


def runnable_seeds(count: int, start: int = 0):
    """Walk seeds whose configuration this target drives (the others are refused, never run)."""
    seeds, seed = [], start
    while len(seeds) < count:
        if scheduler_refusal(plan(seed).config) is None:
            seeds.append(seed)
        seed += 1
    return seeds


def test_vllms_scheduler_runs_a_workload_to_completion_with_every_check():
    checker = Checker()
    engine = engine_for(EngineConfig(AllocatorConfig(HYBRID, 24), token_budget=8), checker)
    for prompt in (range(10), list(range(8)) + [9, 9, 9], range(5)):
        engine.add_request(list(prompt), 3)
    drain(engine, checker)
    assert (engine.view.num_free_blocks, engine.requests, engine.scheduler.requests) == (23, {}, {})


def test_a_shared_prefix_is_a_hit_in_vllms_scheduler():
    checker = Checker()
    engine = engine_for(EngineConfig(AllocatorConfig((FullAttention(4),), 16), token_budget=64), checker)
    engine.add_request(list(range(9)), 2)
    engine.step()
    engine.add_request(list(range(9)) + [7], 2)
    report = engine.step()
    assert report.scheduled == {"r0": 1, "r1": 2}  # r1 reuses r0's two full blocks: 8 of its 10 tokens


def test_vllm_preempts_by_its_own_policy_under_pressure():
    checker = Checker()
    engine = engine_for(EngineConfig(AllocatorConfig((FullAttention(2),), 9), token_budget=16), checker)
    for seed in range(3):
        engine.add_request([seed] * 5, 6)  # three requests of up to 11 tokens: 6 blocks each, 8 usable
    drain(engine, checker)
    assert (engine.events[EV_PREEMPT] > 0, engine.view.num_free_blocks) == (True, 8)


def known_kinds() -> set:
    """What walks find on this release, each triaged in docs/findings.md (the tests below pin them)."""
    kinds = set()
    if RELEASE < (0, 24):
        kinds.add("block-in-two-groups")
    # in every one, a one-token prompt reloaded (connector-handoff, or liveness without caching);
    # to 0.30.0 a finished load behind a request that cannot fit, from 0.33.0 a speculative
    # step's reservation, in 0.34.0 a failed load at the head of the block holders (liveness)
    kinds |= {"liveness", "connector-handoff"}
    # in every one, with events on, a key two blocks hold announced per block (a set forgets it
    # at the first eviction), and where the CPU tier announces its keys, those it keeps through a
    # reset's AllBlocksCleared
    kinds.add("router-forgets-resident")
    if (0, 24) <= RELEASE < (0, 30):
        kinds.add("data-mismatch")  # the deepest group's hit taken for all groups
    if RELEASE >= (0, 30):
        kinds.add("events-reannounce-unheld")  # the full report of a window's skipped positions
    if RELEASE >= (0, 33):
        kinds.add("data-mismatch")  # the two prefill-checkpoint finds
        kinds.add("target-crash")  # the full report of a hit inside a block
    return kinds


def test_walks_find_nothing_but_the_triaged_bugs():
    """Twelve walks that run (five on 0.22.1, which has no prefix-cache retention and refuses
    every shape the sampler gives an interval): a release may refuse a shape itself (0.23.0:
    retention without a sliding window, and its offloading connector asserts that every group
    is full attention or a window), which is passed over, within 60 seeds."""
    wanted, results = (12 if RELEASE >= (0, 23) else 5), []
    for seed in runnable_seeds(60):
        results.append(run_walk(seed, target="vllm-scheduler"))
        if sum(r.steps_run > 0 for r in results) == wanted:
            break
    assert {r.failure.kind for r in results if r.failure} <= known_kinds()
    assert sum(r.steps_run > 0 for r in results) == wanted


def test_the_canary_is_found_through_vllms_scheduler():
    found = [run_walk(seed, target="vllm-scheduler", canary=True).failure for seed in runnable_seeds(10)]
    assert any(f is not None for f in found)


def test_an_error_in_kvprops_checks_is_not_the_targets_crash(monkeypatch):
    engine = engine_for(EngineConfig(AllocatorConfig(HYBRID, 24), token_budget=8))

    def broken(*args):
        raise RuntimeError("a bug in kvprop's checker")

    monkeypatch.setattr(engine.hooks, "before_allocation", broken)
    engine.add_request(list(range(6)), 2)
    with pytest.raises(RuntimeError, match="a bug in kvprop's checker"):
        engine.step()


def test_lookahead_slots_are_refused_with_the_reason():
    config = EngineConfig(AllocatorConfig(HYBRID, 24), token_budget=8, lookahead=1)
    with pytest.raises(ConfigError, match="lookahead slots are not driven"):
        engine_for(config)


def test_drafts_reach_vllms_scheduler_and_its_verification():
    checker = Checker()
    config = EngineConfig(AllocatorConfig(HYBRID, 40), token_budget=16, speculative_tokens=3)
    engine = engine_for(config, checker)
    for prompt in (range(6), range(3, 12)):
        engine.add_request(list(prompt), 8)
    drain(engine, checker)
    seen = (engine.events[EV_SPEC_ACCEPT] + engine.events[EV_SPEC_REJECT] > 0, engine.view.num_free_blocks)
    assert seen == (True, 39)


def test_outputs_are_the_same_with_and_without_drafts():
    def outputs(drafts):
        config = EngineConfig(AllocatorConfig(HYBRID, 40), token_budget=16, speculative_tokens=drafts)
        engine = engine_for(config)
        request = engine.add_request([1, 2, 3, 1, 2], 7)
        while engine.requests:
            engine.step()
        return request.tokens

    assert outputs(3) == outputs(0)


def test_a_padded_decode_waits_forever_under_a_budget_below_one_plus_k():
    """Found by ``kvprop fuzz --target vllm-scheduler`` on 0.33.0 (docs/findings.md): from 0.30.0 vLLM pads a
    request whose hit leaves one token to 1 + K rows and schedules nothing when they exceed the
    step's budget, so with max_num_batched_tokens 1 and K = 1 (which vLLM's config accepts for
    n-gram drafting) r1 never runs. The target refuses such budgets; built directly, it shows."""
    from kvprop.errors import Violation
    from kvprop.targets.vllm.scheduler import SchedulerEngine

    checker = Checker()
    config = EngineConfig(AllocatorConfig((FullAttention(4),), 3), token_budget=1, speculative_tokens=1)
    engine = SchedulerEngine(config, hooks=checker)
    engine.add_request([1, 2, 1, 2], 1)
    engine.add_request([1, 2, 1, 2, 0], 1)
    try:
        drain(engine, checker)
        outcome = None
    except Violation as v:
        outcome = (v.kind, v.requests)
    assert outcome == (("liveness", ("r1",)) if RELEASE >= (0, 30) else None)


# ---- vLLM's offloading connector, scheduler side, with kvprop as its worker ------------------


def full(bs):
    return {"kind": "full", "block_size": bs}


def scheduler_trace(groups, num_blocks, token_budget, connector, steps, drafts=0) -> tr.Trace:
    config = {
        "groups": groups,
        "num_blocks": num_blocks,
        "enable_caching": True,
        "retention_interval": None,
        "enable_kv_cache_events": False,
        "token_budget": token_budget,
        "lookahead": 0,
        "connector": connector,
        "vocab": 4,
        "speculative_tokens": drafts,
    }
    return tr.from_dict(
        {"format": "kvprop-trace/1", "target": "vllm-scheduler", "config": config, "steps": steps, "drain": True}
    )


LARGE = {"op": "AddLargeRequest", "parent": 0, "seed": 0}

# Minimised by `kvprop fuzz --target vllm-scheduler` on 0.23.0 (walk seed 395): two full-attention
# groups, vLLM's offloading connector (loads completing in the step); r6's hit and external
# blocks are taken group by group, so one group's new block is another group's hit.
CROSS_GROUP = scheduler_trace(
    [full(4), full(4)],
    17,
    11,
    "sync",
    [
        add(0, 0, 1, 1),
        {"op": "Step", "times": 1},
        LARGE,
        add(1, 0, 2, 1),
        add(1, 6, 5, 3),
        {"op": "Step", "times": 3},
        add(1, 0, 1, 4),
        LARGE,
        add(2, 7, 1, 1),
        add(1, 0, 1, 1),
    ],
)
# Minimised on 0.24.0 (walk seed 32), the same on 0.33.0: a load that fails is recomputed, but
# its request stays among the scheduler's in-flight prefills, whose reserved blocks then refuse
# its own retry.
LOST_RESERVATION = scheduler_trace(
    [full(1)],
    4,
    2,
    "async",
    [
        LARGE,
        {"op": "Step", "times": 1},
        {"op": "ResetPrefixCache"},
        LARGE,
        {"op": "Step", "times": 2},
        {"op": "FinishLoad", "index": 0, "ok": 0},
    ],
)
# Minimised on 0.24.0 (walk seed 484): a failed load of a sliding-window request is recomputed
# from its first invalid block, but the window's skipping already nulled the block before it.
NULL_IN_WINDOW = scheduler_trace(
    [{"kind": "sliding_window", "block_size": 8, "window": 2}],
    13,
    45,
    "async",
    [
        add(0, 0, 1, 2),
        LARGE,
        add(0, 0, 1, 1),
        add(0, 41, 1, 1),
        {"op": "Step", "times": 4},
        {"op": "FinishLoad", "index": 0, "ok": 0},
    ],
)

# Minimised on 0.33.0 (kvprop fuzz --target vllm-scheduler --seed 14 --known ..., walk seed
# 146323210), the same on every release from 0.22.1: r1's 8 loadable tokens make the window
# (6 tokens, blocks of 2) skip block 0 at admission; the load fails, recovery truncates the
# computed count to the first invalid block (2 tokens), and the recomputed tokens attend to
# block 0, which is the null block.
NULL_IN_WINDOW_EVERYWHERE = scheduler_trace(
    [{"kind": "sliding_window", "block_size": 2, "window": 6}],
    7,
    9,
    "async",
    [
        add(0, 0, 9, 1),
        {"op": "Step", "times": 1},
        {"op": "ResetPrefixCache"},
        add(0, 0, 1, 1),
        {"op": "Step", "times": 2},
        {"op": "FinishLoad", "index": 0, "ok": 0},
    ],
)

# Minimised on 0.33.0 (kvprop fuzz --target vllm-scheduler --seed 5, walk seed 1017301979), the
# same on every release from 0.23.0: a pure state-space model (one Mamba group, blocks of 3, two
# drafts). r4's local hit is the state after 12 tokens and the CPU tier holds the state after 18,
# so admission nulls every entry below index 5 and loads block 5. The load fails; recovery
# truncates the computed count to the first invalid block, 15 tokens, whose state would be in
# entry 4, the null block, and the request continues from it.
STATE_AFTER_FAILED_LOAD = scheduler_trace(
    [{"kind": "mamba", "block_size": 3, "mode": "align", "speculative_blocks": 2}],
    22,
    9,
    "async",
    [
        LARGE,
        add(0, 23, 1, 6),
        LARGE,
        add(0, 14, 7, 4),
        add(0, 2, 6, 3),
        {"op": "Step", "times": 8},
        add(3, 14, 1, 1),
        {"op": "Step", "times": 1},
        {"op": "FinishLoad", "index": 0, "ok": 0},
    ],
    drafts=2,
)

# Minimised on 0.24.0 (kvprop fuzz --target vllm-scheduler --seed 15, walk seed 595420774), the
# same on 0.25.1: two full-attention groups and a Mamba group with a connector. r1 is preempted
# after its first block; when it is admitted again the Mamba group still hits its state after 8
# tokens but the full-attention groups hit nothing (their block went to r0). With a connector
# and a Mamba group, 0.24.0's scheduler takes the deepest group's hit as the local hit
# (``num_new_local_computed_tokens = max(per_group_hits)``, "should be the FA hit length"), so
# the attention groups count 8 tokens as computed in fresh blocks nobody wrote; the cached
# block then reads back wrong. 0.30.0 reconciles divergent hits (``hit_diverged``).
DEEPEST_HIT = scheduler_trace(
    [full(8), full(8), {"kind": "mamba", "block_size": 8, "mode": "align", "speculative_blocks": 0}],
    13,
    32,
    "async",
    [LARGE, add(0, 24, 2, 1)],
)

# Minimised on 0.25.1 (a soak with --seed 16, walk seed 3557685456), the same from 0.22.1 to
# 0.25.1: one Mamba group with blocks of 16 and a token budget of 1. A prefill chunk that does
# not reach the last block boundary is rounded down to a block boundary
# (``_mamba_block_aligned_split``: ``num_new_tokens // block_size * block_size``), which is 0
# tokens when the budget is below a block, every step. 0.30.0 advances inside the block instead.
STATE_CHUNK_STARVES = scheduler_trace(
    [{"kind": "mamba", "block_size": 16, "mode": "align", "speculative_blocks": 0}],
    3,
    1,
    "off",
    [LARGE],
)

# Minimised on 0.30.0 (a soak with --seed 16, walk seed 3441756), the same from 0.22.1 to 0.30.0:
# three full-attention groups of block size 3, 12 usable blocks, a token budget of 1. r4 is
# admitted with an asynchronous load of its last block while r3, ahead of it in the waiting
# queue, is skipped; the load completes, but r4 waits behind r3 holding 9 blocks, and r3 needs
# 6 of the 3 left: the waiting loop stops at r3 every step and never reaches r4.
LOADED_BEHIND_BLOCKED = scheduler_trace(
    [full(3), full(3), full(3)],
    13,
    1,
    "sync",
    [
        {**add(0, 0, 3, 1), "seed": 2},
        add(0, 3, 10, 1),
        {**add(0, 10, 3, 1), "seed": 2},
        add(0, 0, 1, 1),
        add(0, 4, 9, 1),
    ],
)

# Minimised on 0.33.0 (walk seed 32), the same on every release from 0.23.0: a one-token prompt
# whose token is in the CPU tier is loaded, set back to "recompute the last token" (0 computed),
# looked up as new and loaded again, into its own block that the first load cached: forever.
ONE_TOKEN_RELOAD = scheduler_trace(
    [full(1)],
    3,
    1,
    "sync",
    [{"op": "AddLargeRequest", "parent": 0, "seed": 3}, {**add(0, 1, 1, 1), "seed": 3}],
)


# Minimised on 0.33.0 (kvprop fuzz --target vllm-scheduler --seed 0): r1's prefix is in the
# CPU tier, so it is admitted through an asynchronous load, which 0.33.0 admits only if its
# blocks fit besides the blocks one speculative decode step needs (_spec_decode_step_blocks,
# 3 here); a request as long as the pool allows then never fits, with the pool empty.
SPEC_STEP_RESERVATION = scheduler_trace([full(2)], 5, 5, "sync", [add(0, 0, 1, 5), add(0, 0, 4, 1)], drafts=4)


def outcome(trace):
    failure = execute(trace, target="vllm-scheduler")
    return failure and failure.kind


@pytest.mark.skipif(RELEASE < (0, 23), reason="0.22.1 has no prefix-cache retention, which the trace sets")
def test_the_checks_read_the_junction_the_offloading_connector_raised():
    """From 0.34.0 the connector's lookup raises a request's shared-prefix junction where a
    sliding window cut its hit, and vLLM's manager retains by it. A 0.34.0 soak found this
    trace with the junction kvprop had mirrored from the local lookup: index 0 of r4's window
    expected kept, which the raised junction thins (``cached-block-lost-hash``, ours)."""
    assert outcome(tr.load(Path(__file__).parent / "data" / "connector-raised-junction.json")) is None


def test_the_cross_group_bug_reaches_vllms_offloading_connector_before_the_fix():
    assert outcome(CROSS_GROUP) == ("block-in-two-groups" if RELEASE < (0, 24) else None)


def test_a_one_token_prompt_is_loaded_again_and_again():
    assert outcome(ONE_TOKEN_RELOAD) == "connector-handoff"


def test_a_one_token_prompt_is_loaded_again_and_again_without_prefix_caching():
    """The same loop with caching off, found by a 0.34.0 soak (minimised from 111 operations):
    nothing is cached, so no block changes hands, and the request never finishes: its one token
    is loaded again and again, which the find's signature names."""
    failure = execute(
        tr.load(Path(__file__).parent / "data" / "one-token-reload-uncached.json"), target="vllm-scheduler"
    )
    assert (failure.kind, failure.exception) == ("liveness", "load")


@pytest.mark.skipif(RELEASE < (0, 33), reason="prefill checkpoints follow 0.33.0's rules from 0.33.0 only")
def test_a_checkpoint_overwrites_the_running_state_in_0_33():
    assert outcome(checkpoint_find("over-running-state", "vllm-scheduler")) == "data-mismatch"


@pytest.mark.skipif(RELEASE < (0, 33), reason="prefill checkpoints follow 0.33.0's rules from 0.33.0 only")
def test_a_checkpoint_chunk_runs_past_the_block_its_hit_ends_inside_in_0_33():
    assert outcome(checkpoint_find("past-block", "vllm-scheduler")) == "data-mismatch"


@pytest.mark.skipif(
    RELEASE < (0, 33), reason="0.30.0's hits inside a block follow other rules (the target refuses them)"
)
def test_a_hit_inside_a_block_keyed_in_the_same_step_copies_it_unwritten_in_0_33():
    """tests/test_same_step_copy.py's find: the copy runs before the forward pass computes its source."""
    assert outcome(tr.load(Path(__file__).parent / "data" / "copy-before-compute.json")) == "data-mismatch"


def test_a_load_reserves_a_speculative_step_the_pool_cannot_spare_from_0_33():
    assert outcome(SPEC_STEP_RESERVATION) == ("liveness" if RELEASE >= (0, 33) else None)


# The offloading connector's worker fails no load before 0.34.0 (it asserts every transfer
# succeeded) and reports one by its request from 0.34.0 (``failed_recving``; the scheduler then
# recomputes the whole request, ``_handle_failed_recving``). Neither reaches the scheduler's
# block-level recovery (``_update_requests_with_invalid_blocks``), which only connectors whose
# workers report invalid blocks reach: these traces, found when kvprop's worker reported blocks
# to the offloading connector's scheduler side, are inputs that pairing never receives.
BLOCK_LEVEL_FINDS = ["LOST_RESERVATION", "NULL_IN_WINDOW", "NULL_IN_WINDOW_EVERYWHERE", "STATE_AFTER_FAILED_LOAD"]
REPORTS_FAILED_LOADS = RELEASE >= (0, 34)


@pytest.mark.parametrize("name", BLOCK_LEVEL_FINDS)
def test_a_failed_load_through_the_offloading_connector_never_reaches_block_level_recovery(name):
    trace = globals()[name]
    if name == "STATE_AFTER_FAILED_LOAD" and RELEASE < (0, 23):
        pytest.skip("0.22.1 takes no connector with a Mamba group (its scheduler asserts so)")
    reached: set = set()
    failure = execute(trace, target="vllm-scheduler", events=reached)
    failed_before_0_34 = EV_LOAD_FAIL in reached and not REPORTS_FAILED_LOADS
    assert (failure, failed_before_0_34) == (None, False)


@pytest.mark.skipif(not REPORTS_FAILED_LOADS, reason="before 0.34.0 the offloading worker fails no load")
def test_failed_loads_of_models_with_several_groups_reach_the_scheduler_from_0_34():
    """Reported by request, a failed load no longer needs block ids unique across groups: the
    hybrid shapes' failed loads (those of the first 150 seeds the target runs) run, and
    only the triaged kinds are found."""
    hybrid = [
        seed
        for seed in runnable_seeds(150)
        if plan(seed).config.connector == "async" and len(plan(seed).config.allocator.groups) > 1
    ]
    failed_loads, kinds = 0, set()
    for seed in hybrid:
        reached: set = set()
        failure = execute(plan(seed), target="vllm-scheduler", events=reached)
        failed_loads += EV_LOAD_FAIL in reached
        kinds |= {failure.kind} if failure else set()
    assert (failed_loads >= 5, kinds <= known_kinds()) == (True, True)


def test_a_failed_load_left_among_the_block_holders_starves_a_finished_load_in_0_34():
    """Found by a 0.34.0 soak (minimised from 108 operations to 10): r3's load fails, and the
    scheduler frees its blocks (``_update_waiting_for_remote_kv``) but leaves it at the head of
    the queue of requests that hold blocks (``kv_holding_waiting``), which is always drained
    first and stops at the first request that cannot be allocated. r3 cannot be until r4, whose
    load finished behind it, runs and gives its blocks back; r4 is never reached. Before 0.34.0
    the offloading worker fails no load."""
    trace = tr.load(Path(__file__).parent / "data" / "failed-load-among-block-holders.json")
    assert outcome(trace) == ("liveness" if RELEASE >= (0, 34) else None)


def under_the_fail_policy(trace):
    return attrs.evolve(trace, config=attrs.evolve(trace.config, load_failure_policy="fail"))


@pytest.mark.parametrize("name", ["LOST_RESERVATION", "NULL_IN_WINDOW", "NULL_IN_WINDOW_EVERYWHERE"])
def test_a_failed_load_under_vllms_default_policy_ends_its_request_and_nothing_else(name):
    """Under vLLM's default policy, "fail", a failed load ends its request (FINISHED_ERROR), and
    every check holds."""
    assert outcome(under_the_fail_policy(globals()[name])) is None


@pytest.mark.skipif(not REPORTS_FAILED_LOADS, reason="before 0.34.0 the offloading worker fails no load")
def test_a_request_vllm_ends_for_a_failed_load_is_retired_as_failed():
    trace = under_the_fail_policy(LOST_RESERVATION)
    harness = Harness(trace.config, target="vllm-scheduler", device="cpu")
    for op in trace.steps:
        harness.apply(op)
    harness.apply(tr.op_from_dict({"op": "Step", "times": 1}, "step"))
    engine = harness.engine
    assert ([r.status for r in engine.retired], engine.requests, engine.events["async load failure"]) == (
        [Status.FINISHED, Status.FAILED],
        {},
        1,
    )


@pytest.mark.skipif(RELEASE < (0, 23), reason="0.22.1 takes no connector with a Mamba group (its scheduler asserts so)")
def test_the_deepest_group_hit_counts_attention_tokens_nobody_computed_in_0_24_and_0_25():
    expected = "data-mismatch" if (0, 24) <= RELEASE < (0, 30) else None
    assert outcome(DEEPEST_HIT) == expected


@pytest.mark.skipif(RELEASE >= (0, 30), reason="0.30.0 starts with a state block wider than the budget")
def test_vllm_refuses_to_start_with_a_state_block_wider_than_the_budget_before_0_30():
    """The find this configuration gave (a prefill that never starts) rests on a configuration
    vLLM refuses at start-up (VllmConfig.validate_block_size): a refusal, never a find."""
    message = r"In Mamba cache align mode, block_size \(16\) must be <= max_num_batched_tokens \(1\)"
    with pytest.raises(ConfigError, match=message):
        outcome(STATE_CHUNK_STARVES)


@pytest.mark.skipif(RELEASE < (0, 30), reason="before 0.30.0 vLLM refuses this configuration at start-up")
def test_a_state_block_wider_than_the_budget_advances_inside_the_block_from_0_30():
    assert outcome(STATE_CHUNK_STARVES) is None


def test_a_loaded_request_waits_forever_behind_one_that_cannot_fit_before_0_33():
    assert outcome(LOADED_BEHIND_BLOCKED) == ("liveness" if RELEASE < (0, 33) else None)


@pytest.mark.skipif(RELEASE >= (0, 24), reason="the cross-group bug was fixed in 0.24.0")
def test_the_walker_finds_the_cross_group_bug_through_the_connector_from_scratch():
    connector_seeds = [s for s in runnable_seeds(400) if plan(s).config.connector != "off"]
    kinds = {run_walk(seed, target="vllm-scheduler").failure for seed in connector_seeds}
    assert "block-in-two-groups" in {f.kind for f in kinds if f is not None}


def test_the_shapes_it_declares_for_this_release_are_almost_never_refused():
    """The sampler draws what this release's scheduler target declares it builds
    (``vllm.shapes.scheduler_shapes``): at most 5% of the draws are refused."""
    import random

    from kvprop.search.alphabet import RandomChooser, sample_config
    from kvprop.targets import shapes_of

    shapes = shapes_of("vllm-scheduler")
    configs = [sample_config(RandomChooser(random.Random(seed)), shapes) for seed in range(1000)]
    refused = [why for config in configs if (why := scheduler_refusal(config)) is not None]
    assert len(refused) <= 50, refused[:3]


def test_bisect_names_the_release_of_this_environment_affected_where_the_find_is():
    """``kvprop bisect`` over this environment alone (its folder is the prefix plus the release):
    the failed load left among the block holders is a find of 0.34.0 only."""
    release = vllm.__version__
    trace = Path(__file__).parent / "data" / "failed-load-among-block-holders.json"
    args = ["bisect", str(trace), "--releases", f"{release}..{release}", "--envs", sys.prefix[: -len(release)]]
    run = subprocess.run([sys.executable, "-m", "kvprop", *args, "--json"], capture_output=True, text=True, timeout=900)
    result = json.loads(run.stdout)
    expected = ([release], []) if RELEASE >= (0, 34) else ([], [release])
    assert (result["affected"], result["passes"]) == expected, run.stderr


# ---- kvprop report on the scheduler: reproducers that need only vLLM ----------------------------


@pytest.mark.skipif(RELEASE < (0, 34), reason="the offloading worker reports failed loads from 0.34.0")
def test_the_report_of_a_liveness_find_is_a_script_whose_drain_never_ends_without_kvprop(tmp_path):
    code, out = reported(tmp_path, tr.load(Path(__file__).parent / "data" / "failed-load-among-block-holders.json"))
    run = run_reproducer(out)
    last = run.stderr.strip().splitlines()[-1]
    assert (code, run.returncode, last.startswith("AssertionError: liveness: 2 request(s) still unfinished")) == (
        0,
        1,
        True,
    )


@pytest.mark.skipif(RELEASE < (0, 34), reason="the offloading worker reports failed loads from 0.34.0")
def test_a_scheduler_reproducer_imports_only_vllm_torch_and_the_standard_library(tmp_path):
    _, out = reported(tmp_path, tr.load(Path(__file__).parent / "data" / "failed-load-among-block-holders.json"))
    modules = imported_modules((out / "repro.py").read_text())
    assert modules == {"collections", "inspect", "json", "os", "sys", "tempfile", "torch", "vllm"}


@pytest.mark.skipif(RELEASE < (0, 34), reason="the offloading worker reports failed loads from 0.34.0")
def test_the_report_of_a_scheduler_find_lists_its_steps_and_the_failed_load(tmp_path):
    _, out = reported(tmp_path, tr.load(Path(__file__).parent / "data" / "failed-load-among-block-holders.json"))
    lines = (out / "REPORT.md").read_text().splitlines()
    assert (lines[0], "- the worker's load for `r3` fails (reported by request)" in lines) == (
        f"# vLLM {vllm.__version__}: with arrivals stopped, every request ends and every block returns (broken)",
        True,
    )


def test_the_report_of_a_block_handed_to_a_load_checks_each_allocation_for_external_tokens(tmp_path):
    code, out = reported(tmp_path, ONE_TOKEN_RELOAD)
    last = run_reproducer(out).stderr.strip().splitlines()[-1]
    said = "AssertionError: block 2 handed to the connector for 'r1' group 0 is not its own alone and uncached"
    assert (code, last.startswith(said)) == (0, True)


@pytest.mark.skipif(RELEASE < (0, 30), reason="the full report is new in 0.30.0")
def test_the_report_of_an_event_find_replays_the_events_a_router_would(tmp_path):
    code, out = reported(tmp_path, report_find("skipped-positions", target="vllm-scheduler"))
    last = run_reproducer(out).stderr.strip().splitlines()[-1]
    assert (code, last.startswith("AssertionError: a hit's block announced again (BlockStored)")) == (0, True)


@pytest.mark.skipif(RELEASE >= (0, 33), reason="0.33.0 reserves what the requests ahead of a load need")
def test_the_report_of_a_loaded_request_waiting_behind_a_blocked_one_fails_before_0_33(tmp_path):
    code, out = reported(tmp_path, LOADED_BEHIND_BLOCKED)
    assert (code, run_reproducer(out).returncode) == (0, 1)


@pytest.mark.skipif(RELEASE < (0, 34), reason="the offloading worker reports failed loads from 0.34.0")
def test_the_report_draws_the_pool_before_the_failing_operation_and_at_the_find(tmp_path):
    import xml.etree.ElementTree as ET

    _, out = reported(tmp_path, tr.load(Path(__file__).parent / "data" / "failed-load-among-block-holders.json"))
    panels = {e.get("data-panel") for e in ET.fromstring((out / "failing-step.svg").read_text()).iter()}
    linked = "![the pool and the block tables before and after the failing operation](failing-step.svg)"
    assert (panels >= {"before", "after"}, linked in (out / "REPORT.md").read_text()) == (True, True)


@pytest.mark.skipif(not (0, 24) <= RELEASE < (0, 30), reason="the deepest group's hit is counted in 0.24 and 0.25")
def test_the_report_of_a_data_find_checks_what_each_pass_attends_to(tmp_path):
    code, out = reported(tmp_path, DEEPEST_HIT)
    last = run_reproducer(out).stderr.strip().splitlines()[-1]
    said = "AssertionError: r1 group 1 attends to position 0 in block 11, which holds position 24 of group 0"
    assert (code, last.startswith(said)) == (0, True)


@pytest.mark.skipif(RELEASE < (0, 33), reason="hits inside a block follow 0.33.0's rules from 0.33.0 only")
def test_the_report_of_a_copy_before_compute_reads_the_copied_block_as_the_pass_does(tmp_path):
    trace = attrs.evolve(tr.load(Path(__file__).parent / "data" / "copy-before-compute.json"), target="vllm-scheduler")
    code, out = reported(tmp_path, trace)
    last = run_reproducer(out).stderr.strip().splitlines()[-1]
    assert (code, last.startswith("AssertionError: r7 group 0 attends to position 3 in block 2")) == (0, True)
