"""SGLang's own scheduler loop and KV cache through ``kvprop.targets.sglang``; skipped where SGLang is absent.

Run inside an environment built by ``make sglang-env SGLANG_VERSION=...``::

    .venv-sglang-0.5.23/bin/python -m pytest -m sglang tests/test_sglang_scheduler.py

Each test runs on the installed release. Every step of every test is followed by every oracle
that applies (``kvprop.check.sglang.check_all``), so a life that ends idle has passed them all along the way.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

# make test-sglang (and so CI) sets KVPROP_REQUIRE_SGLANG: there a missing SGLang fails, never skips
sglang = __import__("sglang") if os.environ.get("KVPROP_REQUIRE_SGLANG") else pytest.importorskip("sglang")

from kvprop.check import sglang as oracles  # noqa: E402
from kvprop.errors import ConfigError, RequestError, Violation  # noqa: E402
from kvprop.targets.sglang.config import SglangConfig  # noqa: E402
from kvprop.targets.sglang.loading import check_release, import_sglang  # noqa: E402
from kvprop.targets.sglang.release import Release  # noqa: E402
from kvprop.targets.sglang.scheduler import SglangScheduler  # noqa: E402

pytestmark = pytest.mark.sglang

CONFIGS = {
    "page1": SglangConfig(),
    "page4": SglangConfig(page_size=4),
    "swa": SglangConfig(sliding_window=4),
    "swa-page4": SglangConfig(sliding_window=4, page_size=4),
}
FULL_ATTENTION = ["page1", "page4"]
PREFIX = list(range(10, 34))  # 24 tokens, whole pages at page size 1 and 4


def drain(sched, limit: int = 400) -> list:
    """Step, checking every oracle after each step, until the scheduler is fully idle."""
    results = []
    for _ in range(limit):
        result = sched.step()
        oracles.check_all(sched)
        results.append(result)
        if result.mode == "idle" and sched.is_fully_idle():
            return results
    raise AssertionError(f"not idle after {limit} steps")


def scheduled(results, rid: str) -> list[int]:
    return [n for r in results for who, n in r.scheduled if who == rid and r.mode == "extend"]


def finished(results) -> list[str]:
    return [rid for r in results for rid in r.finished]


def busy(name: str) -> SglangScheduler:
    """Two requests sharing a prefix, both decoding: the tree has locked and unlocked nodes."""
    sched = SglangScheduler(CONFIGS[name])
    sched.add_request("A", PREFIX + [40, 41, 42, 43], 8)
    sched.add_request("B", PREFIX + [50] * 8, 8)
    for _ in range(4):
        sched.step()
    oracles.check_all(sched)
    return sched


# ---- whole lives ----------------------------------------------------------------------

# The tokens B's first prefill computes after A (same 24-token prefix, 28 tokens, chunked 16 +
# 12) has finished. Full attention reuses the whole prefix (32 - 24). With a 4-token window at
# page size 1 the match ends where A's sliding-window KV was last kept whole, at its first
# chunk's end (32 - 16); at page size 4 SGLang keeps the window's pages and the prefix is reused.
SHARED_PREFILL = {"page1": 8, "page4": 8, "swa": 16, "swa-page4": 8}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_chunked_request_then_one_sharing_its_prefix_end_idle(name):
    sched = SglangScheduler(CONFIGS[name])
    sched.add_request("A", PREFIX + [40, 41, 42, 43], 3)
    first = drain(sched)
    sched.add_request("B", PREFIX + [50] * 8, 3)
    second = drain(sched)
    assert (scheduled(first, "A"), scheduled(second, "B"), finished(first + second)) == (
        [16, 12],
        [SHARED_PREFILL[name]],
        ["A", "B"],
    )


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_waiting_request_aborted_is_never_admitted_and_ends_idle(name):
    sched = SglangScheduler(CONFIGS[name])
    sched.add_request("A", PREFIX + [40], 4)
    sched.step()
    sched.add_request("W", PREFIX + [41], 4)
    sched.abort("W")
    results = drain(sched)
    assert ([rid for r in results for rid in r.admitted], finished(results)) == ([], ["A"])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_request_aborted_between_chunks_is_released_and_ends_idle(name):
    sched = SglangScheduler(CONFIGS[name])
    sched.add_request("C", PREFIX + list(range(200, 240)), 3)  # 64 tokens: four 16-token chunks
    first = sched.step()
    oracles.check_all(sched)
    sched.abort("C")
    results = drain(sched)
    assert (first.scheduled, results[0].finished, sched.request("C")) == ((("C", 16),), ("C",), None)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_running_request_aborted_finishes_on_its_next_step_and_ends_idle(name):
    sched = SglangScheduler(CONFIGS[name])
    sched.add_request("R", PREFIX, 20)
    sched.step()  # first chunk: no token
    sched.step()  # second chunk: the first token
    req = sched.request("R")
    sched.abort("R")
    results = drain(sched)
    # the decode step it was aborted before samples one more token, then releases it
    assert (results[0].finished, len(req.output_ids)) == (("R",), 2)


@pytest.mark.parametrize("name", FULL_ATTENTION)
def test_a_retracted_request_rematches_its_cached_prompt_and_finishes(name):
    page = CONFIGS[name].page_size
    sched = SglangScheduler(CONFIGS[name])
    prompt = PREFIX + [61] * 6
    sched.add_request("P", PREFIX, 1)
    drain(sched)  # the prefix is cached: C and D each prefill their 6 own tokens in one step
    sched.add_request("C", PREFIX + [60] * 6, 6)
    sched.add_request("D", prompt, 6)
    for _ in range(3):
        sched.step()
        oracles.check_all(sched)
    sched.retract("D")
    results = drain(sched)
    outputs_then = 3  # the prefill's token and two decodes
    # its prefill cached the prompt's whole pages; retraction inserts nothing more
    recompute = len(prompt) + outputs_then - len(prompt) // page * page
    assert (results[0].retracted, results[1].admitted, scheduled(results, "D"), sorted(finished(results))) == (
        ("D",),
        ("D",),
        [recompute],
        ["C", "D"],
    )


@pytest.mark.parametrize("name", ["page1", "swa"])
def test_a_small_pool_evicts_the_least_recent_cached_node_for_a_new_request(name):
    config = SglangConfig(pool_tokens=48, sliding_window=CONFIGS[name].sliding_window)
    sched = SglangScheduler(config)
    sched.add_request("A", list(range(100, 130)), 2)  # cached as two nodes: the 16-token chunk, then 15
    drain(sched)
    cached = sched.tree_cache.full_evictable_size() if config.swa else sched.tree_cache.evictable_size()
    sched.add_request("B", list(range(200, 230)), 2)  # needs 30 slots, 17 are free: A's second node goes
    drain(sched)
    sched.add_request("A2", list(range(100, 130)), 1)
    again = drain(sched)
    assert (cached, scheduled(again, "A2")) == (31, [30 - 16])


def test_reset_prefix_cache_empties_the_tree_when_idle_and_refuses_while_busy():
    sched = SglangScheduler(CONFIGS["page1"])
    sched.add_request("A", PREFIX, 2)
    sched.step()
    refused = sched.reset_prefix_cache()
    drain(sched)
    done = sched.reset_prefix_cache()
    oracles.check_all(sched)
    assert (refused, done, sched.tree_cache.evictable_size(), sched.allocator.available_size()) == (False, True, 0, 96)


# ---- each oracle fires on a state broken through SGLang's own objects ------------------


def take_slot(sched) -> None:
    """A page taken from the (full) token allocator behind the tree's back."""
    allocator = getattr(sched.allocator, "full_attn_allocator", sched.allocator)
    allocator.alloc(sched.config.page_size)


def _kind(check, sched) -> str:
    with pytest.raises(Violation) as caught:
        check(sched)
    return caught.value.kind


@pytest.mark.parametrize("name", list(CONFIGS))
def test_conservation_fires_on_a_slot_taken_behind_the_trees_back(name):
    sched = busy(name)
    take_slot(sched)
    assert _kind(oracles.check_conservation, sched) == "sglang-pool-conservation"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_totals_fire_on_an_edited_running_total(name):
    sched = busy(name)
    tree = sched.tree_cache
    if hasattr(tree, "tree_core"):
        tree.tree_core.component_evictable_size_[oracles.FULL] += 1
    else:
        tree.evictable_size_ += 1
    assert _kind(oracles.check_totals, sched) == "sglang-running-totals"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_lock_refs_fire_on_a_bumped_lock_ref(name):
    sched = busy(name)
    tree = sched.tree_cache
    node = oracles._nodes(tree)[0]
    if hasattr(tree, "tree_core"):
        node.component(oracles.FULL).lock_ref += 1
    else:
        node.lock_ref += 1
    assert _kind(oracles.check_lock_refs, sched) == "sglang-lock-ref"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_slot_check_fires_on_a_tree_slot_freed_behind_its_back(name):
    sched = busy(name)
    node = oracles._nodes(sched.tree_cache)[0]
    value = oracles.node_value(sched.tree_cache, node)
    sched.allocator.free(value[: sched.config.page_size])
    assert _kind(oracles.check_slots_disjoint, sched) == "sglang-slot-held-twice"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_idle_check_fires_on_a_slot_leaked_at_idle(name):
    sched = SglangScheduler(CONFIGS[name])
    sched.add_request("A", PREFIX, 2)
    drain(sched)
    take_slot(sched)
    assert _kind(oracles.check_idle, sched) == "sglang-idle-leak"


# ---- each oracle stays clean on a seeded random run of the correct SGLang --------------

# a longer soak: KVPROP_SGLANG_OPERATIONS=2000 make test-sglang (the seeds stay the same)
_OPERATIONS = os.environ.get("KVPROP_SGLANG_OPERATIONS", "300")
if not _OPERATIONS.isdigit() or int(_OPERATIONS) < 1:
    raise pytest.UsageError(
        f"KVPROP_SGLANG_OPERATIONS takes a positive whole number of operations, got {_OPERATIONS!r}"
    )
OPERATIONS = int(_OPERATIONS)
CHECKS = {
    "conservation": oracles.check_conservation,
    "totals": oracles.check_totals,
    "lock-refs": oracles.check_lock_refs,
    "slots": oracles.check_slots_disjoint,
}


def random_run(sched, seed: int, check) -> dict:
    """``OPERATIONS`` random operations (add, abort, retract, reset, step; most are steps) over
    four shared prefixes, then a drain; ``check`` after every step, SGLang's idle check at the
    end. Returns how often each thing happened, so a run that did nothing shows."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 900) for _ in range(rng.randrange(8, 40))] for _ in range(4)]
    counts = {"admitted": 0, "finished": 0, "retracted": 0, "aborts": 0, "resets": 0}
    next_id = 0
    for _ in range(OPERATIONS):
        op = rng.random()
        live = [rid for rid in list(sched._requests)]
        if op < 0.25:
            prompt = rng.choice(prefixes) + [rng.randrange(3, 900) for _ in range(rng.randrange(1, 30))]
            sched.add_request(f"r{next_id}", prompt, rng.randrange(1, 30))
            next_id += 1
        elif op < 0.30 and live:
            sched.abort(rng.choice(live))
            counts["aborts"] += 1
        elif op < 0.34 and live:
            sched.retract(rng.choice(live))
        elif op < 0.35:
            counts["resets"] += sched.reset_prefix_cache()
        else:
            result = sched.step()
            check(sched)
            counts["admitted"] += len(result.admitted)
            counts["finished"] += len(result.finished)
            counts["retracted"] += len(result.retracted)
    for result in drain(sched, limit=50 * OPERATIONS):  # the queue left by the operations, one by one
        counts["finished"] += len(result.finished)
        counts["retracted"] += len(result.retracted)
    oracles.check_idle(sched)
    return counts


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_random_run_stays_clean(name, check):
    sched = SglangScheduler(SglangConfig(**{**_fields(CONFIGS[name]), "pool_tokens": 160, "max_running_requests": 16}))
    counts = random_run(sched, seed=0, check=CHECKS[check])
    assert (counts["finished"] > 0, counts["retracted"] > 0, counts["aborts"] > 0) == (True, True, True)


def _fields(config: SglangConfig) -> dict:
    import attrs

    return attrs.asdict(config)


@pytest.mark.skipif(
    Release.of(import_sglang()).tree_core_selector == "none", reason="the release has only the Python tree core"
)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_random_run_on_the_rust_tree_core_stays_clean(name):
    config = SglangConfig(
        **{**_fields(CONFIGS[name]), "pool_tokens": 160, "max_running_requests": 16, "tree_core": "rust"}
    )
    sched = SglangScheduler(config)
    counts = random_run(sched, seed=1, check=oracles.check_all)
    assert (oracles.walkable(sched), counts["finished"] > 0) == (False, True)


# ---- the release's facets ------------------------------------------------------------------

# The release each yes/no facet turned on in (off after it where marked "until"), read from SGLang's source
TURNED_ON = {
    "kv_record_lifelong": (0, 5, 19),
    "fill_cursors": (0, 5, 22),
    "tree_lock": (0, 5, 22),
    "evicted_seqlen_by_component": (0, 5, 21),
    "private_swa_helper": (0, 5, 22),
    "counts_swa_transient": (0, 5, 20),
    "checkpoint_api": (0, 5, 22),
    "aborts_finish_handle": (0, 5, 20),
    "abort_releases_mm_inputs": (0, 5, 22),
    "chunk_abort_reason_on_req": (0, 5, 22),
    "chunk_abort_redispatch": (0, 5, 20),
    "evict_for_alloc": (0, 5, 19),
    "filters_running_each_step": (0, 5, 23),
    "priority_takes_processed_tokens": (0, 5, 20),
    "chunk_limit": (0, 5, 21),
    "empty_running_clears_full": (0, 5, 22),
    "no_token_full_only_with_work": (0, 5, 22),
    "budget_gate": (0, 5, 23),
    "allocator_budget": (0, 5, 21),
    "paged_torch_path": (0, 5, 22),
    "triton_by_platform": (0, 5, 22),
    "swa_allocator_takes_req_pool": (0, 5, 20),
    "checker_reads_chunked_req": (0, 5, 20),
    "byte_accounting": (0, 5, 19),
    "aux_cache_allocator": (0, 5, 19),
}
UNTIL = {
    "retract_takes_server_args": (0, 5, 18),
    "tree_context_takes_chunk_size": (0, 5, 21),
    "observer_reads_batches": (0, 5, 21),
}


def test_each_facet_read_from_the_api_is_the_one_its_release_carries():
    import attrs

    release = Release.of(import_sglang())
    at = release.release
    want = {name: at >= since for name, since in TURNED_ON.items()}
    want |= {name: at <= last for name, last in UNTIL.items()}
    want["exclude_keyword"] = "reqs_to_exclude" if at >= (0, 5, 22) else "chunked_req_to_exclude"
    want["tree_core_selector"] = "none" if at < (0, 5, 19) else "env" if at < (0, 5, 21) else "params"
    got = {k: v for k, v in attrs.asdict(release).items() if k not in ("version", "release")}
    assert got == want


# ---- configuration -----------------------------------------------------------------------


def test_a_chunk_size_off_the_page_grid_is_a_config_error():
    with pytest.raises(ConfigError, match="chunked_prefill_size \\(10\\) must be a multiple of page_size \\(4\\)"):
        SglangConfig(page_size=4, chunked_prefill_size=10)


def test_a_release_outside_the_supported_range_is_a_config_error():
    with pytest.raises(ConfigError, match="SGLang 0.5.17 is outside the releases kvprop drives \\(0.5.18 to 0.5.23\\)"):
        check_release("0.5.17")


def test_an_sglang_that_does_not_import_is_a_config_error_saying_how_to_get_one():
    code = (
        "import sys; sys.modules['sglang'] = None\n"
        "from kvprop.targets.sglang.loading import import_sglang\n"
        "try:\n    import_sglang()\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert (out.split(" ")[0], "`make sglang-env SGLANG_VERSION=0.5.23`" in out) == ("ConfigError", True)


def test_a_generation_the_pool_cannot_hold_is_clipped_as_sglang_clips_it_at_arrival():
    """``init_req_max_new_tokens``: 68 prompt tokens in a pool of 96 leave room for 26 (without
    the clip such a request waits at the head of the queue forever, blocking every other)."""
    sched = SglangScheduler(CONFIGS["page1"])
    req = sched.add_request("r0", list(range(3, 71)), 27)
    assert req.sampling_params.max_new_tokens == 26


def test_a_prompt_sglang_refuses_at_arrival_is_not_made():
    """``validate_input_length``: a prompt of ``max_req_input_len`` (95 - 5) tokens or more ends
    at arrival in SGLang, so kvprop never makes it."""
    sched = SglangScheduler(CONFIGS["page1"])
    with pytest.raises(RequestError) as info:
        sched.add_request("r0", list(range(3, 93)), 1)
    assert "max_req_input_len 90" in str(info.value)
