"""Every violation kind is registered once, worded in one function, and can fire."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest
from helpers import engine

from kvprop.allocator.block_pool import Block
from kvprop.allocator.specs import FullAttention, SlidingWindow
from kvprop.check import moments
from kvprop.check.checker import Checker, drain
from kvprop.check.kinds import KINDS
from kvprop.errors import TargetCrash, Violation
from kvprop.sim.request import Status

PACKAGE = Path(__file__).resolve().parent.parent / "kvprop"


def raised_kinds() -> dict[str, set[str]]:
    """kind -> the functions (module:function) that construct a Violation of that kind."""
    where = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for func in ast.walk(tree):
            if not isinstance(func, ast.FunctionDef):
                continue
            for node in ast.walk(func):
                if (
                    isinstance(node, ast.Call)
                    and getattr(node.func, "id", None) == "Violation"
                    and node.args
                    and isinstance(node.args[0], ast.Constant)
                ):
                    where[node.args[0].value].add(f"{path.relative_to(PACKAGE)}:{func.name}")
    return where


def test_every_raised_kind_is_registered():
    assert sorted(set(raised_kinds()) - set(KINDS)) == []


def test_every_registered_kind_is_raised_somewhere():
    assert sorted(set(KINDS) - set(raised_kinds())) == []


def test_each_kind_is_raised_by_exactly_one_function():
    assert {k: sorted(f) for k, f in raised_kinds().items() if len(f) > 1} == {}


def test_every_kind_is_raised_by_the_check_layer():
    assert {k for k, f in raised_kinds().items() if any(not w.startswith("check/") for w in f)} == set()


# ---- every kind fires: build a sound state by real calls, break one thing, name the kind ----
#
# Each case starts from a state the checker passes, breaks one thing, runs the check that
# owns the sentence and asserts the kind it reports. Where a kind is judged both by the full
# sweep and by the incremental mirror, the same corruption goes through both paths.

# Kinds no state reaches, with why; the coverage test below holds this list to the truth.
UNREACHABLE: set = set()

GROUPS = (FullAttention(4), SlidingWindow(4, 8))
SHARED = [1, 2, 3, 1, 2, 3, 1, 2]  # two full blocks r0 and r1 share


def sound_engine(**engine_kwargs):
    """Three running requests over a 24-block pool, checked sound.

    r0 and r1 share two cached prefix blocks per group (ref_cnt 2); r2 holds two cached blocks
    of its own per group; every request's last block is partial and uncached; 9 blocks are free.
    """
    eng = engine(GROUPS, 24, **engine_kwargs)
    eng.add_request(SHARED + [3], 4)
    eng.add_request(SHARED + [0, 0], 4)
    eng.add_request([3, 3, 0, 0, 3, 3, 0, 0, 1], 4)
    eng.step()
    Checker().check_full(eng)
    return eng


def pool(eng):
    return eng.allocator.pool


def manager(eng, group):
    return eng.allocator.coordinator.managers[group]


def table(eng, rid, group):
    """The allocator's own table (block objects), to corrupt in place."""
    return manager(eng, group).req_to_blocks[rid]


# ---- block-level corruptions: each breaks one thing and returns the block ids it touched ----


def bump_ref_cnt(eng):
    block = table(eng, "r0", 0)[2]  # r0's own partial block, ref_cnt 1
    block.ref_cnt += 1
    return [block.block_id]


def unlink_free_block(eng):
    block = pool(eng).free_queue.head.next  # free, ref_cnt 0, now out of the queue
    pool(eng).free_queue.remove(block)
    return [block.block_id]


def break_backward_link(eng):
    queue = pool(eng).free_queue
    block = queue.head.next.next  # its prev skips the first free block
    block.prev = queue.head
    return [block.block_id]


def link_twin_of_free_block(eng):
    """A second record of a free block's id linked into the queue (the same object twice
    would make the queue a cycle)."""
    queue = pool(eng).free_queue
    twin = Block(queue.head.next.block_id)
    queue.append(twin)
    return [twin.block_id]


def overcount_free(eng):
    pool(eng).free_queue.num_free += 1
    return []


def free_null_block(eng):
    pool(eng).free_queue.append(pool(eng).null_block)
    return [pool(eng).null_block.block_id]


def swap_groups_in_one_table(eng):
    """r1's first group-0 and group-1 blocks change places: each shared block is then held
    once in each group, with ref_cnt still equal to its holders."""
    t0, t1 = table(eng, "r1", 0), table(eng, "r1", 1)
    t0[0], t1[0] = t1[0], t0[0]
    return [t0[0].block_id, t1[0].block_id]


def repeat_in_table(eng):
    t = table(eng, "r0", 0)
    dropped, t[2] = t[2], t[0]
    return [t[0].block_id, dropped.block_id]


def evict_shared_block(eng):
    block = table(eng, "r0", 0)[0]  # cached, held by r0 and r1
    pool(eng)._evict(block)
    return [block.block_id]


def count_null_block(eng):
    pool(eng).null_block.ref_cnt -= 1  # released as if a table had held it
    return [pool(eng).null_block.block_id]


def cache_null_block(eng):
    pool(eng).null_block.key = table(eng, "r0", 0)[0].key
    return [pool(eng).null_block.block_id]


def drop_map_entry(eng):
    block = table(eng, "r2", 0)[0]  # cached, r2's alone
    entry = pool(eng).cached[block.key]
    del entry[block.block_id]
    if not entry:
        del pool(eng).cached[block.key]
    return [block.block_id]


def rekey_without_map(eng):
    """The block's key changes; the map keeps it under the old one."""
    block = table(eng, "r2", 0)[0]
    block.key = (block.key[0] ^ 1, block.key[1])
    return [block.block_id]


def cache_for_missing_group(eng):
    block = table(eng, "r2", 0)[2]  # uncached partial block
    pool(eng).cache_block(block, 12345, len(GROUPS) + 5)
    return [block.block_id]


def link_foreign_block(eng):
    """A block id the pool does not have is linked into the free queue (count kept in step)."""
    queue = pool(eng).free_queue
    last, foreign = queue.tail.prev, Block(eng.view.num_blocks)
    foreign.prev, foreign.next = last, queue.tail
    last.next = queue.tail.prev = foreign
    queue.num_free += 1
    return [last.block_id]  # the real block whose link changed


def overwrite_cached_data(eng):
    block = table(eng, "r2", 0)[0]  # cached, and part of running r2's computed prefix
    eng.memory.data[block.block_id, 0] = 12345
    return [block.block_id]


BLOCK_CASES = [
    ("ref-cnt-mismatch", bump_ref_cnt),
    ("free-queue-membership", unlink_free_block),
    ("free-queue-links", break_backward_link),
    ("free-queue-repeat", link_twin_of_free_block),
    ("free-count", overcount_free),
    ("null-block-free", free_null_block),
    ("null-block-count", count_null_block),
    ("block-in-two-groups", swap_groups_in_one_table),
    ("duplicate-in-table", repeat_in_table),
    ("shared-uncached-block", evict_shared_block),
    ("null-block-cached", cache_null_block),
    ("cache-map-missing", drop_map_entry),
    ("cache-map-stale", rekey_without_map),
    ("cache-key-group", cache_for_missing_group),
    ("conservation", link_foreign_block),
    ("data-mismatch", overwrite_cached_data),
]

# What the incremental path reports where it differs from the full sweep for the same corruption.
INCREMENTAL_REPORTS = {
    # The mirror never walks the queue, so it cannot see an id twice; it sees one more free
    # block counted than it tracks.
    "free-queue-repeat": "free-count",
    # The mirror's conservation test (num_blocks - 1 - len(free) in use) is the same arithmetic
    # as the free-count test just before it, so incrementally conservation can never fire
    # first: a block outside the pool counted as free reads as free-count.
    "conservation": "free-count",
}


@pytest.mark.parametrize(("kind", "corrupt"), [pytest.param(k, c, id=k) for k, c in BLOCK_CASES])
def test_full_sweep_reports_block_kind(kind, corrupt):
    eng = sound_engine()
    corrupt(eng)
    with pytest.raises(Violation) as info:
        Checker().check_full(eng)
    assert info.value.kind == kind


@pytest.mark.parametrize(("kind", "corrupt"), [pytest.param(k, c, id=k) for k, c in BLOCK_CASES])
def test_incremental_check_reports_block_kind(kind, corrupt):
    eng = sound_engine()
    checker = Checker(full_every=64)
    checker.check_all(eng)  # builds the mirror
    assert checker.mirror is not None
    pool(eng).changed.update(corrupt(eng))
    with pytest.raises(Violation) as info:
        checker.check_all(eng)
    assert checker.num_checks % checker.full_every, "this check must be incremental, not a full sweep"
    assert info.value.kind == INCREMENTAL_REPORTS.get(kind, kind)


@pytest.mark.parametrize("incremental", [False, True], ids=["full", "incremental"])
def test_negative_ref_cnt_is_reported_before_the_holder_count(incremental):
    """A negative ref_cnt is named for what it is, not as a mismatch with the holder count."""
    eng = sound_engine()
    checker = Checker(full_every=64)
    checker.check_all(eng)
    block = pool(eng).free_queue.head.next
    block.ref_cnt = -1
    pool(eng).changed.add(block.block_id)
    with pytest.raises(Violation) as info:
        checker.check_all(eng) if incremental else checker.check_full(eng)
    assert info.value.kind == "negative-ref-cnt"


# ---- tables against requests (invariant 6), by the full sweep ------------------------------


def table_for_waiting_request(eng):
    waiting = eng.add_request([2, 2, 2, 2, 2], 4)  # no step admits it
    manager(eng, 0).req_to_blocks[waiting.request_id] = []


def drop_cached_count(eng):
    del manager(eng, 1).num_cached_block["r0"]


def over_allocate(eng):
    """A fourth block for r0, whose 10 tokens fit in three (the pool's accounting stays right)."""
    manager(eng, 0).allocate_new_blocks("r0", 16)


def skip_attended_blocks(eng):
    """The sliding-window group nulls and frees blocks as if 100 tokens were computed (r0 has 9)."""
    manager(eng, 1).remove_skipped_blocks("r0", 100)


def overcount_cached(eng):
    manager(eng, 0).num_cached_block["r0"] = 4


def evict_counted_block(eng):
    """r2's first block, counted as cached, is evicted (map and key agree, it is r2's alone)."""
    pool(eng)._evict(table(eng, "r2", 0)[0])


TABLE_CASES = [
    ("table-without-admission", table_for_waiting_request),
    ("admitted-without-table", drop_cached_count),
    ("table-length", over_allocate),
    ("null-in-attended-range", skip_attended_blocks),
    ("cached-count", overcount_cached),
    ("cached-block-lost-hash", evict_counted_block),
]


@pytest.mark.parametrize(("kind", "corrupt"), [pytest.param(k, c, id=k) for k, c in TABLE_CASES])
def test_full_sweep_reports_table_kind(kind, corrupt):
    eng = sound_engine()
    corrupt(eng)
    with pytest.raises(Violation) as info:
        Checker().check_full(eng)
    assert info.value.kind == kind


@pytest.mark.parametrize(("kind", "corrupt"), [pytest.param(k, c, id=k) for k, c in TABLE_CASES])
def test_incremental_check_reports_table_kind(kind, corrupt):
    """Between full sweeps a table is judged again when its entries, its cached count, its
    request's progress or the key of a block it holds changed: here never its progress."""
    eng = sound_engine()
    checker = Checker(full_every=64)
    checker.check_all(eng)  # builds the mirror and judges every table once
    corrupt(eng)
    with pytest.raises(Violation) as info:
        checker.check_all(eng)
    assert checker.num_checks % checker.full_every, "this check must be incremental, not a full sweep"
    assert info.value.kind == kind


# ---- the in-step hooks and liveness: each scenario sets up, then returns the action that fails ----


def decode_engine():
    """r0 prefilled 8 tokens into two blocks under a checker; its next step decodes position 8,
    which needs a third block."""
    eng = engine([FullAttention(4)], 8, hooks=Checker())
    eng.add_request(SHARED, 4)
    eng.step()
    return eng


def before_write(eng, corrupt):
    """Run ``corrupt`` after the step's allocations (checked) and before its writes."""
    execute = eng._execute

    def corrupted(report):
        corrupt(eng)
        execute(report)

    eng._execute = corrupted


def allocation_without_blocks():
    eng = decode_engine()
    eng.allocator.allocate_slots = lambda request, n, **kw: ([],)  # says yes, allocates nothing
    return eng.step


def null_block_at_write():
    eng = decode_engine()
    before_write(eng, lambda e: table(e, "r0", 0).__setitem__(2, pool(e).null_block))
    return eng.step


def shared_block_at_write():
    eng = decode_engine()

    def share(e):
        table(e, "r0", 0)[2].ref_cnt += 1  # the fresh, uncached block about to take position 8

    before_write(eng, share)
    return eng.step


def cached_at_handoff():
    eng = engine([FullAttention(4)], 8, hooks=Checker(), connector="sync")
    eng.connector.publish_prefix(SHARED + [3])
    allocate = eng.allocator.allocate_slots
    # The allocator ignores delay_cache_blocks: blocks an external load will fill are cached at once.
    eng.allocator.allocate_slots = lambda request, n, **kw: allocate(request, n, **{**kw, "delay_cache_blocks": False})
    eng.add_request(SHARED + [3], 4)
    return eng.step


def freed_during_load():
    eng = engine([FullAttention(4)], 8, hooks=Checker(), connector="async")
    eng.connector.publish_prefix(SHARED + [3])
    request = eng.add_request(SHARED + [3], 4)
    eng.step()
    assert request.status is Status.LOADING
    eng.allocator.coordinator.free(request.request_id)  # blocks dropped while the load still writes them
    return lambda: eng.finish_load(request.request_id, ok=True)


def request_lost_by_scheduler():
    checker = Checker()
    eng = engine([FullAttention(4)], 8, hooks=checker)
    request = eng.add_request(SHARED, 4)
    eng.step()
    eng.running.remove(request)  # still running and holding blocks, but never scheduled again
    return lambda: drain(eng, checker, max_steps=5)


def output_sampled_from_another_prefix():
    checker = Checker()
    eng = engine([FullAttention(4)], 8, hooks=checker, pipeline_depth=2)
    request = eng.add_request(SHARED, 4)
    eng.step()
    eng.step()  # the prefill's output is back: its token appended
    request.tokens[-1] = (request.tokens[-1] + 1) % eng.config.vocab  # an output sampled from another prefix
    return lambda: checker.check_all(eng)


def continued_on_load_in_flight():
    eng = engine([FullAttention(4)], 8, hooks=Checker(), connector="async")
    eng.connector.publish_prefix(SHARED + [3])
    request = eng.add_request(SHARED + [3], 4)
    eng.step()
    assert request.status is Status.LOADING
    # the scheduler takes the load for landed: the next step continues the request on it
    request.num_computed_tokens += request.pending_external
    request.pending_external = 0
    request.status = Status.LOADED
    eng.loaded.append(request)
    return eng.step


def two_loads():
    """Two requests whose prefixes the tier holds: r0's load takes 2 of the 6 blocks its 24
    tokens need, leaving 5 free; r1's would take 2 more, leaving 3 of the 4 r0 still needs."""
    eng = engine([FullAttention(4)], 8, hooks=Checker(), connector="async")
    first, second = [0, 1, 2, 3, 0, 1, 2, 3], [3, 3, 2, 2, 1, 1, 0, 0]
    eng.connector.publish_prefix(first)
    eng.connector.publish_prefix(second)
    eng.add_request(first + [1, 0] * 8, 1)
    eng.add_request(second + [2], 1)
    return eng


def second_load_without_room():
    eng = two_loads()
    eng.reserved_for_loads = lambda request: 0  # r1's load is admitted with no room kept for r0's
    return eng.step


def saving_engine():
    """r0 prefilled 6 tokens under a checker with connector "async": its full first block is
    cached and a save of it is in flight; its next step decodes position 6 into its second block."""
    eng = engine([FullAttention(4)], 8, hooks=Checker(), connector="async")
    eng.add_request(SHARED[:6], 4)
    eng.step()
    assert len(eng.connector.saves) == 1
    return eng


def save_reads_written_block():
    eng = saving_engine()
    job = next(iter(eng.connector.saves.values()))
    second = eng.allocator.get_block_ids("r0")[0][1]
    job.entries.append((job.entries[0][0] + 1, 0, second))  # the save also reads the block r0 decodes into
    return eng.step


def unheld_block_offered():
    eng = engine([FullAttention(4)], 8, hooks=Checker(), connector="async")
    eng.connector.publish_prefix(SHARED + [3])
    request = eng.add_request(SHARED + [3], 4)
    eng.connector.tier[request.block_hashes[1]][0] = (-1,) * 4  # a key kept whose data never arrived
    return eng.step


ENGINE_CASES = [
    ("table-too-short", allocation_without_blocks),
    ("write-to-null-block", null_block_at_write),
    ("write-to-shared-block", shared_block_at_write),
    ("connector-handoff", cached_at_handoff),
    ("connector-write-unowned", freed_during_load),
    ("liveness", request_lost_by_scheduler),
    ("output-not-continuation", output_sampled_from_another_prefix),
    ("proceeds-before-load", continued_on_load_in_flight),
    ("load-room-short", second_load_without_room),
    ("write-during-save", save_reads_written_block),
    ("tier-offers-unsaved", unheld_block_offered),
]


@pytest.mark.parametrize(("kind", "scenario"), [pytest.param(k, s, id=k) for k, s in ENGINE_CASES])
def test_engine_reports_kind(kind, scenario):
    act = scenario()  # setting up raises nothing
    with pytest.raises(Violation) as info:
        act()
    assert info.value.kind == kind


def test_engine_scenarios_without_corruption_run_clean():
    """Each engine scenario above, left alone, steps and drains with every check passing."""
    eng = decode_engine()
    eng.step()  # the decode the write-hook cases corrupt
    drain(eng, eng.hooks)
    for mode in ("sync", "async"):
        eng = engine([FullAttention(4)], 8, hooks=Checker(), connector=mode)
        eng.connector.publish_prefix(SHARED + [3])
        request = eng.add_request(SHARED + [3], 4)
        eng.step()  # the hand-off
        if mode == "async":
            eng.finish_load(request.request_id, ok=True)  # the load write
        drain(eng, eng.hooks, max_steps=20)
    eng = two_loads()
    assert eng.step().admitted == ["r0"]  # r1's load waits for the room r0's still needs
    drain(eng, eng.hooks)
    eng = saving_engine()
    eng.step()  # the decode the save case corrupts
    drain(eng, eng.hooks)
    assert eng.connector.saves == {}


# ---- refusals (invariant 8): the snapshot check and the incremental changed-block check ----


def register_table(eng, request, kwargs):
    manager(eng, 0).req_to_blocks[request.request_id] = []


def touch_hits(eng, request, kwargs):
    pool(eng).touch(kwargs["new_computed_blocks"][0])  # touched before the capacity check


def evict_hit(eng, request, kwargs):
    pool(eng)._evict(kwargs["new_computed_blocks"][0][-1])  # a hit, free and cached, loses its key


def rotate_free_queue(eng, request, kwargs):
    queue = pool(eng).free_queue
    head = queue.head.next
    queue.remove(head)
    queue.append(head)


# (corruption, kind from the snapshot check, kind from the incremental check): the incremental
# check compares tables the same way but sees any other change only as a changed block.
REFUSAL_CASES = [
    (register_table, "refusal-changed-table", "refusal-changed-table"),
    (touch_hits, "refusal-changed-ref-cnt", "refusal-changed-state"),
    (evict_hit, "refusal-changed-cache", "refusal-changed-state"),
    (rotate_free_queue, "refusal-changed-queue", "refusal-changed-state"),
]


def refused_admission(checker, corrupt):
    """An engine whose next step refuses an admission, with ``corrupt`` run inside the refusal.

    r0 (8 tokens, one to produce) finishes in the first step, leaving its two cached blocks
    free; r1 keeps three. Next step r1 takes a fourth, and r2, which hits r0's blocks but
    needs five blocks in all, finds three free."""
    eng = engine([FullAttention(4)], 8, hooks=checker)
    eng.add_request(SHARED, 1)
    eng.add_request([3, 3, 0, 0, 3, 3, 0, 0, 3, 3, 0, 0], 4)
    eng.step()
    refused = eng.add_request(SHARED + [0] * 12, 1)
    allocate = eng.allocator.allocate_slots

    def refusing(request, n, **kwargs):
        result = allocate(request, n, **kwargs)
        if result is None and request is refused:
            corrupt(eng, request, kwargs)
        return result

    eng.allocator.allocate_slots = refusing
    return eng


@pytest.mark.parametrize(("corrupt", "kind"), [pytest.param(c, k, id=k) for c, k, _ in REFUSAL_CASES])
def test_snapshot_refusal_check_reports_kind(corrupt, kind):
    checker = Checker(full_every=1)  # not incremental: a snapshot before every allocation
    eng = refused_admission(checker, corrupt)
    assert not checker.incremental(eng)
    with pytest.raises(Violation) as info:
        eng.step()
    assert info.value.kind == kind


@pytest.mark.parametrize(("corrupt", "kind"), [pytest.param(c, k, id=f"{c.__name__}-{k}") for c, _, k in REFUSAL_CASES])
def test_incremental_refusal_check_reports_kind(corrupt, kind):
    checker = Checker(full_every=64)
    eng = refused_admission(checker, corrupt)
    assert checker.incremental(eng)
    with pytest.raises(Violation) as info:
        eng.step()
    assert info.value.kind == kind


def test_refused_admission_without_corruption_passes():
    """The refusal scenario is sound on both paths: the corruption alone makes each case fail."""
    for checker in (Checker(full_every=1), Checker(full_every=64)):
        eng = refused_admission(checker, lambda *_: None)
        report = eng.step()
        assert report.admitted == [] and report.scheduled == {"r1": 1}
        checker.check_full(eng)


# ---- every kind is produced above ----------------------------------------------------------

EXERCISED = (
    {k for k, _ in BLOCK_CASES}
    | set(INCREMENTAL_REPORTS.values())
    | {k for k, _ in TABLE_CASES}
    | {k for k, _ in ENGINE_CASES}
    | {k for _, a, b in REFUSAL_CASES for k in (a, b)}
    | {"negative-ref-cnt"}
)


# Kinds whose states only an engine's own code builds, produced by that engine's tests instead
# (they run where the engine is installed, never skipped in CI).
ELSEWHERE = {
    **{
        kind: "tests/test_sglang_scheduler.py"
        for kind in (
            "sglang-pool-conservation",
            "sglang-running-totals",
            "sglang-lock-ref",
            "sglang-slot-held-twice",
            "sglang-idle-leak",
        )
    },
    **{kind: "tests/test_sglang_target.py" for kind in ("sglang-kv-data", "sglang-cached-kv-data")},
}


def test_every_kind_is_produced_by_a_test_here():
    assert EXERCISED <= set(KINDS)
    assert EXERCISED.isdisjoint(UNREACHABLE)
    assert set(KINDS) - EXERCISED - set(ELSEWHERE) == UNREACHABLE


def test_every_kind_produced_elsewhere_is_named_by_its_tests():
    here = Path(__file__).parent
    named = {kind for kind, path in ELSEWHERE.items() if f'"{kind}"' in (here.parent / path).read_text()}
    assert named == set(ELSEWHERE)


# ---- decisions (10), cached counts (6) and idle bookkeeping (12): a one-line bug, found by a walk ----

DECISION_CASES = [
    ("capacity-overcount", "spurious-refusal"),
    ("hit-stops-early", "hit-too-short"),
    ("free-keeps-cached-count", "freed-request-remains"),
    ("hits-recached", "cached-count-behind"),
    ("accepts-negative-external", "misuse-accepted"),
]


@pytest.mark.parametrize(("variant", "kind"), DECISION_CASES)
def test_decision_and_bookkeeping_kinds_fire_on_a_walk(variant, kind, monkeypatch):
    from kvprop.allocator import guards
    from kvprop.search.walk import plan, run_walk

    monkeypatch.setattr(guards, "ENABLED", False)  # hits-recached would trip the pool's own guard first
    # with KV cache events on, the key hits-recached caches again is announced twice first
    seeds = [s for s in range(500) if not plan(s).config.allocator.enable_kv_cache_events]
    failure = next(f for f in (run_walk(seed, variant=variant).failure for seed in seeds) if f is not None)
    assert failure.kind == kind


def _admitting_engine():
    from kvprop.check.checker import Checker

    checker = Checker()
    eng = engine([FullAttention(2)], 6, hooks=checker, token_budget=64)
    eng.add_request([1, 2, 3, 4, 5], 1)
    eng.step()
    checker.check_all(eng)
    eng.add_request([1, 2, 3, 4, 5, 6, 7], 1)
    return eng


def test_an_allocation_beyond_the_pool_that_raises_is_a_target_crash_naming_the_rule(monkeypatch):
    eng = _admitting_engine()
    monkeypatch.setattr(eng.allocator.coordinator, "count_blocks_to_allocate", lambda *a: 0)
    eng.add_request([3, 3, 3, 3, 3, 3, 3, 3], 1)
    with pytest.raises(TargetCrash) as info:
        eng.step()
    assert (info.value.call, "an allocation the pool cannot hold is refused" in str(info.value)) == (
        "allocate_slots",
        True,
    )


def test_an_allocation_granted_beyond_the_pool_is_accepted_beyond_capacity():
    from types import SimpleNamespace

    from kvprop.check import decisions

    with pytest.raises(Violation) as info:  # needs 5 blocks, 2 free, none freed: granted all the same
        decisions.allocation_decision(SimpleNamespace(request_id="r0"), (5, 5, 2, 0), accepted=True)
    assert info.value.kind == "accepted-beyond-capacity"


def test_a_hit_longer_than_the_cache_holds_is_hit_too_long(monkeypatch):
    eng = _admitting_engine()
    real = eng.allocator.get_computed_blocks
    monkeypatch.setattr(eng.allocator, "get_computed_blocks", lambda r: (real(r)[0], real(r)[1] + 2))
    with pytest.raises(Violation) as info:
        eng.step()
    assert info.value.kind == "hit-too-long"


def test_a_hit_covering_the_last_token_says_the_last_token_is_always_computed(monkeypatch):
    eng = _admitting_engine()
    monkeypatch.setattr(eng.allocator, "get_computed_blocks", lambda r: ([], r.num_tokens))
    with pytest.raises(Violation) as info:
        eng.step()
    assert (info.value.kind, "its last token is always computed" in str(info.value)) == ("hit-too-long", True)


def test_a_refused_malformed_call_that_changed_state_is_misuse_changed_state(monkeypatch):
    eng = _admitting_engine()
    eng.step()
    assert eng.retired, "a request must have ended for a second free"

    def free_then_refuse(request):
        eng.allocator.pool.get_new_blocks(1)
        raise RuntimeError("not admitted")

    monkeypatch.setattr(eng.allocator, "free", free_then_refuse)
    with pytest.raises(Violation) as info:
        eng.misuse("free-twice", 0)
    assert info.value.kind == "misuse-changed-state"


EXERCISED |= {k for _, k in DECISION_CASES} | {"accepted-beyond-capacity", "hit-too-long", "misuse-changed-state"}


# ---- the event stream (13): events lost or invented on the way out of a sound engine -------


def _engine_with_events():
    from kvprop.allocator.specs import AllocatorConfig, EngineConfig
    from kvprop.targets.kvprop import build_kvprop_engine

    checker = Checker()
    config = EngineConfig(AllocatorConfig(GROUPS, 24, enable_kv_cache_events=True))
    eng = build_kvprop_engine(config, device="cpu", hooks=checker)
    eng.add_request(SHARED + [3], 4)
    eng.step()
    return eng, checker


def test_events_that_never_reach_the_router_are_events_diverge():
    eng, checker = _engine_with_events()
    eng.allocator.take_events()  # lost on the way out
    with pytest.raises(Violation) as info:
        checker.check_all(eng)
    assert info.value.kind == "events-diverge"


@pytest.mark.parametrize(
    ("event", "kind"),
    [("Removed", "events-unknown-removal"), ("Reannounced", "events-reannounce-unheld")],
)
def test_an_event_naming_a_key_never_stored_is_caught(event, kind):
    from kvprop.allocator import events

    eng, checker = _engine_with_events()
    eng.allocator.pool.events.append(getattr(events, event)((7, 0)))
    with pytest.raises(Violation) as info:
        checker.check_all(eng)
    assert info.value.kind == kind


EXERCISED |= {"events-diverge", "events-unknown-removal", "events-reannounce-unheld"}


# ---- a router's set (17): what a router keeping the events as a set believes ----------------


def test_a_key_stored_twice_and_removed_once_is_forgotten_by_a_routers_set():
    from kvprop.allocator.events import Removed, Stored

    eng, checker = _engine_with_events()
    checker.check_all(eng)
    key = min(key for key, _ in eng.view.cache_map_items())
    eng.allocator.pool.events.extend([Stored(key), Removed(key)])  # a count still holds the key
    with pytest.raises(Violation) as info:
        checker.check_all(eng)
    assert info.value.kind == "router-forgets-resident"


class EmptyTier:
    """An offload tier that holds nothing and announces its keys."""

    publishes = True

    @staticmethod
    def holds(key) -> bool:
        return False


def test_a_key_announced_on_a_tier_that_lacks_it_is_advertised_absent():
    from kvprop.allocator.events import CPU, Stored

    eng, checker = _engine_with_events()
    eng.offload_tier = EmptyTier  # what an engine playing an offload tier's lookup offers
    eng.allocator.pool.events.append(Stored((7, 0), CPU))
    with pytest.raises(Violation) as info:
        checker.check_all(eng)
    assert info.value.kind == "router-advertises-absent"


EXERCISED |= {"router-forgets-resident", "router-advertises-absent"}


# ---- state groups (7): the state a step continues from, and where it writes the next ------


def _state_engine():
    from kvprop.allocator.specs import Mamba

    checker = Checker()
    eng = engine([FullAttention(4), Mamba(4)], 24, hooks=checker, token_budget=4)
    eng.add_request([1, 2, 3, 1, 2, 3, 1, 2, 3], 4)
    eng.step()
    checker.check_all(eng)
    return eng, checker


def test_a_state_overwritten_between_steps_is_state_source_mismatch():
    eng, _ = _state_engine()
    running = eng.target_calls.get_block_ids("r0")[1][0]
    eng.memory.write([running * 4], [12345])
    with pytest.raises(Violation) as info:
        eng.step()
    assert info.value.kind == "state-source-mismatch"


def test_a_state_written_into_the_null_block_is_state_write_unowned(monkeypatch):
    eng, _ = _state_engine()
    real = eng.allocator.get_block_ids
    monkeypatch.setattr(eng.allocator, "get_block_ids", lambda rid: (real(rid)[0], [*real(rid)[1][:-1], 0]))
    with pytest.raises(Violation) as info:
        eng.step()
    assert info.value.kind == "state-write-unowned"


def test_a_running_state_outside_the_table_is_state_not_held(monkeypatch):
    eng, checker = _state_engine()
    monkeypatch.setattr(eng, "state_block", lambda request, g: 7)  # a block r0's table does not hold
    with pytest.raises(Violation) as info:
        checker.check_full(eng)
    assert info.value.kind == "state-not-held"


EXERCISED |= {"state-source-mismatch", "state-write-unowned", "state-not-held"}


def test_an_allocation_that_cuts_a_table_is_table_rewritten():
    """Invariant 14 (tables only grow), read from a real engine: a granted allocation may
    append and null entries, never cut or replace one."""
    eng, _ = _state_engine()
    moments.tables_extended(eng.view, "r0", [[3, 4, 5]], [[0, 4, 5, 6]])
    with pytest.raises(Violation) as info:
        moments.tables_extended(eng.view, "r0", [[3, 4, 5]], [[3, 4]])
    assert info.value.kind == "table-rewritten"


def test_an_allocation_that_replaces_an_entry_is_table_rewritten():
    eng, _ = _state_engine()
    with pytest.raises(Violation) as info:
        moments.tables_extended(eng.view, "r0", [[3, 4, 5]], [[3, 7, 5]])
    assert info.value.kind == "table-rewritten"


EXERCISED |= {"table-rewritten"}
