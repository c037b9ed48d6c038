"""``--target sglang``: kvprop's operations, drivers and checks over SGLang's own scheduler loop;
skipped where SGLang is absent (never in ``make test-sglang``, which CI runs).

The data oracle's tests break SGLang's state through SGLang's own objects (a KV buffer written
behind the tree's back, a window slot freed through the allocator) and expect the kind.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import attrs
import pytest

sglang = __import__("sglang") if os.environ.get("KVPROP_REQUIRE_SGLANG") else pytest.importorskip("sglang")

from helpers import mutate  # noqa: E402

from kvprop.allocator.specs import AllocatorConfig, EngineConfig, FullAttention, SlidingWindow  # noqa: E402
from kvprop.check import sglang as sglang_checks  # noqa: E402
from kvprop.check.checker import Checker  # noqa: E402
from kvprop.check.kinds import KINDS  # noqa: E402
from kvprop.errors import Violation  # noqa: E402
from kvprop.search import trace as tr  # noqa: E402
from kvprop.search.agree import agree  # noqa: E402
from kvprop.search.execute import execute, run  # noqa: E402
from kvprop.search.harness import Harness  # noqa: E402
from kvprop.search.walk import operations, start  # noqa: E402
from kvprop.targets import build_engine, shapes_of  # noqa: E402

pytestmark = pytest.mark.sglang
RUST_CORE = importlib.util.find_spec("sglang.srt.mem_cache.rust_tree_core")
needs_rust_core = pytest.mark.skipif(RUST_CORE is None, reason="this SGLang has only the Python tree core")


def config(block_size: int = 1, window: int | None = None, num_blocks: int = 48, budget: int = 8) -> EngineConfig:
    groups = (FullAttention(block_size),) + ((SlidingWindow(block_size, window),) if window else ())
    return EngineConfig(allocator=AllocatorConfig(groups, num_blocks), token_budget=budget, vocab=4)


def engine_for(cfg: EngineConfig):
    checker = Checker(full_every=1)
    return build_engine(cfg, target="sglang", hooks=checker), checker


def drain(engine, checker, limit: int = 200) -> None:
    for _ in range(limit):
        if not engine.requests:
            return
        engine.step()
        checker.check_all(engine)
    raise AssertionError(f"requests still live after {limit} steps: {sorted(engine.requests)}")


PROMPT = [0, 1, 2, 3] * 4  # 16 tokens: whole pages at page size 1 and 4


@pytest.mark.parametrize("block_size", [1, 4])
def test_a_request_runs_to_its_end_through_sglang(block_size):
    engine, checker = engine_for(config(block_size))
    record = engine.add_request(PROMPT, 3)
    drain(engine, checker)
    assert (record.status.value, engine.retired, engine.scheduler.tree_cache.evictable_size()) == (
        "finished",
        ["r0"],
        16 + 3 - 1 if block_size == 1 else 16,  # what was computed, in whole pages
    )


def test_a_second_request_reads_the_first_ones_cached_prefix():
    engine, checker = engine_for(config())
    engine.add_request(PROMPT, 1)
    drain(engine, checker)
    engine.add_request([*PROMPT, 3, 3], 1)
    report = engine.step()
    assert report.scheduled == {"r1": 2}


def test_finish_makes_the_model_sample_eos():
    engine, checker = engine_for(config())
    engine.add_request(PROMPT, 50)
    engine.step()
    engine.finish("r0")
    report = engine.step()
    assert (report.finished, engine.retired) == (["r0"], ["r0"])


def test_an_aborted_running_request_ends_as_aborted():
    engine, checker = engine_for(config())
    record = engine.add_request(PROMPT, 50)
    engine.step()
    engine.abort("r0")
    engine.step()
    assert (record.status.value, engine.requests) == ("aborted", {})


def _overwrite_cached(engine) -> None:
    """The sixth slot of the first request's cached prompt, overwritten in SGLang's KV buffer."""
    tree = engine.scheduler.tree_cache
    (node,) = sglang_checks.tree_root(tree).children.values()
    engine._full[int(sglang_checks.node_value(tree, node)[5])] = 12345.0


def test_the_data_oracle_catches_a_cached_slot_overwritten_behind_the_tree():
    engine, checker = engine_for(config())
    engine.add_request(PROMPT, 1)
    drain(engine, checker)
    _overwrite_cached(engine)
    engine.add_request([*PROMPT, 3], 1)
    with pytest.raises(Violation) as e:
        engine.step()
    assert e.value.kind == "sglang-kv-data"


def test_the_tree_data_check_catches_a_cached_slot_overwritten():
    engine, checker = engine_for(config())
    engine.add_request(PROMPT, 1)
    drain(engine, checker)
    _overwrite_cached(engine)
    with pytest.raises(Violation) as e:
        checker.check_full(engine)
    assert e.value.kind == "sglang-cached-kv-data"


def test_the_window_oracle_catches_a_window_slot_freed_under_a_live_request():
    engine, checker = engine_for(config(window=4, budget=16))
    engine.add_request(PROMPT, 20)
    engine.step()  # the prefill, in one chunk
    sched = engine.scheduler
    req = sched.request("r0")
    last = int(sched.req_to_token_pool.req_to_token[engine.release.req_pool_idx(req), len(PROMPT) - 1])
    sched.allocator.free_swa(sched.sg.torch.tensor([last]))  # inside the window of the next decode
    with pytest.raises(Violation) as e:
        engine.step()
    assert e.value.kind == "sglang-kv-data"


def test_the_window_oracle_reads_the_oldest_position_sglang_attends():
    """SGLang's token attends the W positions before it (``window_positions``): freeing the
    oldest of them under a live request is caught at its next decode."""
    engine, checker = engine_for(config(window=4, budget=16))
    engine.add_request(PROMPT, 20)
    engine.step()  # the prefill, in one chunk; the next decode computes position 16
    sched = engine.scheduler
    row = sched.req_to_token_pool.req_to_token[engine.release.req_pool_idx(sched.request("r0"))]
    sched.allocator.free_swa(sched.sg.torch.tensor([int(row[len(PROMPT) - 4])]))
    with pytest.raises(Violation) as e:
        engine.step()
    assert (e.value.kind, "position 12 of the sliding-window layer" in str(e.value)) == ("sglang-kv-data", True)


def _first_find(cfg: EngineConfig, seeds: range):
    for seed in seeds:
        failure, _ = _walk(cfg, seed)
        if failure is not None:
            return seed, failure.kind
    return None


@pytest.mark.skipif(version("sglang") != "0.5.23", reason="the mutated line is 0.5.23's")
def test_a_mutant_matching_a_window_one_position_short_is_found_from_scratch(monkeypatch):
    """SGLang's match validator accepts a prefix whose window holds one live position too few;
    the walks find a request reading the oldest position of its window from a freed slot."""
    from sglang.srt.mem_cache.unified_cache.components.swa import SWAComponent

    line = 'return state["len"] >= sliding_window_size'
    mutate(monkeypatch, SWAComponent, "create_match_validator", line, line + " - 1")
    assert _first_find(config(1, window=4, num_blocks=48), range(12)) == (1, "sglang-kv-data")


@pytest.mark.parametrize("block_size", [1, 4])
def test_window_walks_stay_clean(block_size):
    """Seeded walks over SGLang's full + sliding-window cache, every check after every operation
    and step: 8 walks of up to 150 operations per page size."""
    assert _first_find(config(block_size, window=4, num_blocks=64 // block_size), range(8)) is None


def _walk(cfg: EngineConfig, seed: int, max_ops: int = 150):
    begun = attrs.evolve(start(seed, max_ops, shapes=shapes_of("sglang")), config=cfg)
    harness = Harness(cfg, target="sglang")
    taken: list = []
    return run(harness, operations(begun, harness, taken), drain=True), harness


@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_full_attention_walks_stay_clean(block_size):
    """Seeded walks of kvprop's whole alphabet over SGLang's full-attention cache, every check
    after every operation and step: 8 walks of up to 150 operations per page size."""
    failures = []
    for seed in range(8):
        failure, _ = _walk(config(block_size, num_blocks=64 // block_size, budget=4 * block_size), seed)
        if failure is not None:
            failures.append((seed, failure.message))
    assert failures == []


@pytest.mark.parametrize("target", ["sglang", pytest.param("sglang-rust", marks=needs_rust_core)])
def test_kvprop_fuzz_runs_walks_on_sglang_and_reports_them(tmp_path, target):
    """Four walks of a fixed seed through the command line, on either tree core: steps ran, and
    they were clean."""
    out = subprocess.run(
        [sys.executable, "-m", "kvprop", "fuzz", "--target", target, "--max-runs", "4", "--workers", "1",
         "--seed", "3", "--out", str(tmp_path), "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    summary = json.loads(out.stdout)
    ran = (out.returncode, summary["target"], summary["verdict"], summary["runs"], summary["steps"] > 0)
    assert ran == (0, target, "clean", 4, True), out.stderr[-2000:]


@pytest.mark.skipif(version("sglang") != "0.5.23", reason="the file list is 0.5.23's")
def test_coverage_measures_the_tree_its_components_the_allocators_and_the_kv_path():
    from kvprop.front.coverage import scope

    measured = scope("sglang")
    names = sorted(os.path.relpath(f, measured.root) for f in measured.files)
    assert names == [
        "allocation.py",
        "allocator/base.py",
        "allocator/paged.py",
        "allocator/swa.py",
        "allocator/token.py",
        "base_prefix_cache.py",
        "common.py",
        "memory_pool.py",
        "swa_memory_pool.py",
        "unified_cache/components/base.py",
        "unified_cache/components/full.py",
        "unified_cache/components/swa.py",
        "unified_cache/unified_tree_core.py",
        "unified_radix_cache.py",
    ]


@needs_rust_core
def test_the_rust_tree_core_agrees_with_the_python_core_step_for_step():
    """``kvprop agree --target sglang-rust``: the same walks on both cores, checks off, compared
    after every operation (rows, cached slots, pool totals) and by what each step did."""
    result = agree("sglang-rust", range(30))
    assert (result.walks > 0, result.disagreement) == (True, None)


@needs_rust_core
@pytest.mark.skipif(version("sglang") != "0.5.23", reason="the mutated line is 0.5.23's")
def test_the_core_differential_finds_a_python_core_mutant_from_scratch(monkeypatch):
    """The window match validator one position short, in the Python core alone: the cores
    schedule a request's prefill differently."""
    from sglang.srt.mem_cache.unified_cache.components.swa import SWAComponent

    line = 'return state["len"] >= sliding_window_size'
    mutate(monkeypatch, SWAComponent, "create_match_validator", line, line + " - 1")
    found = agree("sglang-rust", range(12)).disagreement
    assert (found.seed, found.what) == (8, "outcome")


# every kind an SGLang run can end in: its own sentences, liveness, and the target's death or hang
SGLANG_KINDS = ",".join(["liveness", "target-crash", "target-hang", *(k for k in KINDS if k.startswith("sglang-"))])


def test_every_find_of_a_campaign_replays_in_a_fresh_process(tmp_path):
    """A campaign runs each walk in a fork of one worker; every find it saves reproduces its
    kind when a fresh process replays it (300 walks of a fixed seed, every SGLang kind known so
    the campaign goes on past each find)."""
    kvprop = [sys.executable, "-m", "kvprop"]
    fuzz = ["fuzz", "--target", "sglang", "--max-runs", "300", "--workers", "1", "--seed", "11"]
    out = subprocess.run(
        [*kvprop, *fuzz, "--known", SGLANG_KINDS, "--out", str(tmp_path), "--json"],
        capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    finds = sorted(tmp_path.glob("*.found.json"))
    kinds = [json.loads(f.read_text())["failure"]["kind"] for f in finds]
    replays = [subprocess.run([*kvprop, "replay", str(f)], capture_output=True, text=True, timeout=600) for f in finds]
    reproduced = [(r.returncode, f"REPRODUCED {kind} " in r.stdout) for r, kind in zip(replays, kinds)]
    assert (out.returncode, len(finds) > 0, reproduced) == (0, True, [(1, True)] * len(finds)), out.stderr[-2000:]


# SGLang's finds (docs/findings.md, "Findings in SGLang"): each trace, the kind it breaks and the
# releases it affects, as kvprop bisect found them. On the installed release the replay
# reproduces the kind where the release is affected and runs clean where it is not.
ROOT = Path(__file__).parent.parent
RELEASES = ("0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23")
FINDS = {
    "swa-grouped-free-remap": ("tests/data/sglang", "sglang-kv-data", RELEASES[:1]),
    "swa-window-rematch-assert": ("tests/data/sglang", "target-crash", RELEASES[:2]),
    "swa-window-keep-short": ("tests/data/sglang", "sglang-pool-conservation", RELEASES[:5]),
    "swa-own-prefix-wait": ("findings/sglang/swa-own-prefix-wait", "liveness", RELEASES),
}


def _trace_of(name: str) -> Path:
    folder = ROOT / FINDS[name][0]
    return folder / ("trace.json" if folder.name == name else f"{name}.json")


@pytest.mark.parametrize("name", sorted(FINDS))
def test_a_find_reproduces_exactly_on_the_releases_it_affects(name):
    _, kind, affected = FINDS[name]
    failure = execute(tr.load(_trace_of(name)), target="sglang")
    expected = kind if version("sglang") in affected else None
    assert (failure.kind if failure else None) == expected
