"""The engine around the allocator: chunked prefill, decode, finish, preemption, aborts and
asynchronous external loads. Every invariant is checked inside and after every step."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import engine

from kvprop.allocator.specs import AllocatorConfig, EngineConfig, FullAttention, SlidingWindow
from kvprop.check.checker import Checker, drain
from kvprop.errors import ConfigError, RequestError, Violation
from kvprop.sim.events import EV_ABORT_LOAD, EV_LOAD_FAIL, EV_PREEMPT, EV_REHIT
from kvprop.sim.request import Status


@pytest.fixture
def checker():
    return Checker()


def step(eng, checker):
    """One engine step, then every invariant (the checker also runs inside the step as hooks)."""
    report = eng.step()
    checker.check_all(eng)
    return report


def table(eng, request):
    return eng.allocator.get_block_ids(request.request_id)


def all_free(eng) -> bool:
    return eng.allocator.num_free_blocks == eng.config.allocator.num_blocks - 1


# ---- chunked prefill and decode ---------------------------------------------------------


def test_chunked_prefill_under_a_token_budget(checker):
    """A 12-token prompt under a budget of 5 is prefilled in chunks 5, 5, 2; blocks are
    allocated only as the chunks need them."""
    eng = engine([FullAttention(4)], 20, hooks=checker, token_budget=5)
    r = eng.add_request(list(range(12)), 3)
    chunks, tables = [], []
    for _ in range(3):
        report = step(eng, checker)
        chunks.append(report.scheduled[r.request_id])
        tables.append(table(eng, r)[0])
    assert chunks == [5, 5, 2]
    assert tables == [[1, 2], [1, 2, 3], [1, 2, 3]]
    assert r.num_computed_tokens == 12 and r.num_tokens == 13  # first output token appended


def test_budget_is_shared_running_first_then_admission(checker):
    """Running requests are scheduled before waiting ones are admitted; the budget left over
    admits the next request with a partial first chunk."""
    eng = engine([FullAttention(4)], 20, hooks=checker, token_budget=8)
    a = eng.add_request(list(range(12)), 2)
    b = eng.add_request(list(range(50, 56)), 2)
    first = step(eng, checker)
    assert first.scheduled == {a.request_id: 8}
    assert b.status is Status.WAITING
    second = step(eng, checker)
    assert second.scheduled == {a.request_id: 4, b.request_id: 4}
    assert second.admitted == [b.request_id]


def test_decode_to_max_new_tokens_then_finish_frees_everything(checker):
    """One prefill step and one decode step per further token; at max_new_tokens the request
    finishes in the step that computes its last position, and every block returns."""
    eng = engine([FullAttention(2), SlidingWindow(2, 4)], 16, hooks=checker)
    r = eng.add_request([1, 2, 3, 4, 5], 3)
    scheduled = []
    for _ in range(3):
        report = step(eng, checker)
        scheduled.append(report.scheduled[r.request_id])
    assert scheduled == [5, 1, 1]
    assert report.finished == [r.request_id]
    assert r.status is Status.FINISHED
    assert r.num_tokens == 7  # 2 decoded tokens appended; the 3rd is sampled, never stored
    assert eng.requests == {}
    assert all_free(eng)
    assert table(eng, r) == ([], [])


def test_finish_early_frees_the_running_request(checker):
    """finish() (a stop string) ends a running request now and frees its blocks."""
    eng = engine([FullAttention(2)], 8, hooks=checker)
    r = eng.add_request([1, 2, 3], 5)
    step(eng, checker)
    eng.finish(r.request_id)
    checker.check_all(eng)
    assert r.status is Status.FINISHED and all_free(eng)


# ---- preemption -------------------------------------------------------------------------


def test_preemption_takes_the_last_admitted_and_it_later_rehits_its_blocks(checker):
    """With the pool full, A's decode needs a block: B (last admitted) is preempted - all
    blocks freed, progress reset, to the front of waiting ahead of C - and when readmitted
    B hits its own cached blocks [4, 5] again."""
    eng = engine([FullAttention(2)], 7, hooks=checker)
    a = eng.add_request([1, 2, 3, 4, 5], 4)
    b = eng.add_request([6, 7, 8, 9, 10], 4)
    step(eng, checker)
    assert (table(eng, a), table(eng, b)) == (([1, 2, 3],), ([4, 5, 6],))
    c = eng.add_request([20, 21, 22], 1)
    step(eng, checker)  # both decode into their partial blocks; no room to admit C
    assert c.status is Status.WAITING and eng.allocator.num_free_blocks == 0

    report = step(eng, checker)  # A needs a 4th block
    assert report.preempted == [b.request_id]
    assert b.status is Status.WAITING and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert list(eng.waiting) == [b, c]
    assert table(eng, b) == ([],)
    assert table(eng, a) == ([1, 2, 3, 6],)  # 6 was B's last cached block, at the queue head
    assert eng.events[EV_PREEMPT] == 1

    while b.status is Status.WAITING:
        step(eng, checker)
    assert table(eng, b)[0][:2] == [4, 5]
    assert eng.events[EV_REHIT] >= 1
    drain(eng, checker)


def test_preemption_victim_is_the_last_admitted_not_the_first(checker):
    """A, B, C running and the pool full; B (the middle one) needs a block: C, the last
    admitted, is preempted - not A ahead of B, and not B itself."""
    eng = engine([FullAttention(4)], 7, hooks=checker)
    a = eng.add_request([1, 2, 3, 4, 5], 3)  # room in its 2nd block for decode
    b = eng.add_request(list(range(10, 18)), 3)  # 8 tokens: the decode needs a 3rd block
    c = eng.add_request([30, 31, 32, 33, 34], 3)
    step(eng, checker)
    assert [table(eng, r)[0] for r in (a, b, c)] == [[1, 2], [3, 4], [5, 6]]
    report = step(eng, checker)
    assert report.preempted == [c.request_id]
    assert report.scheduled == {a.request_id: 1, b.request_id: 1}
    assert table(eng, b) == ([3, 4, 6],)  # C's freed blocks: 6 is hashless, at the head
    assert eng.running == [a, b] and list(eng.waiting) == [c]
    drain(eng, checker)


def test_a_lone_request_that_fits_is_never_preempted(checker):
    """A request admitted alone always fits (add_request bounds it), so it is never preempted."""
    eng = engine([FullAttention(2)], 5, hooks=checker)
    r = eng.add_request([1, 2, 3], 5)  # 3 + 5 tokens -> 4 blocks = the whole pool
    while eng.requests:
        assert step(eng, checker).preempted == []
    assert r.status is Status.FINISHED and all_free(eng)


def test_explicit_preempt_requires_a_running_request(checker):
    """preempt() frees a running request; a waiting one cannot be preempted."""
    eng = engine([FullAttention(2)], 8, hooks=checker)
    r = eng.add_request([1, 2, 3], 3)
    with pytest.raises(RequestError, match=r"preempt: request 'r0' is waiting, only running ones can be preempted"):
        eng.preempt(r.request_id)
    step(eng, checker)
    eng.preempt(r.request_id)
    checker.check_all(eng)
    assert r.status is Status.WAITING and all_free(eng) and eng.waiting[0] is r


# ---- abort in each state -----------------------------------------------------------------


def test_abort_waiting(checker):
    """Aborting a waiting request removes it; it never held blocks."""
    eng = engine([FullAttention(2)], 8, hooks=checker)
    r = eng.add_request([1, 2, 3], 3)
    eng.abort(r.request_id)
    checker.check_all(eng)
    assert r.status is Status.ABORTED and not eng.waiting and eng.requests == {}
    assert all_free(eng)


def test_abort_running(checker):
    """Aborting a running request frees all its blocks at once."""
    eng = engine([FullAttention(2), SlidingWindow(2, 4)], 12, hooks=checker)
    r = eng.add_request([1, 2, 3, 4, 5], 3)
    step(eng, checker)
    assert eng.allocator.num_free_blocks < 11
    eng.abort(r.request_id)
    checker.check_all(eng)
    assert r.status is Status.ABORTED and not eng.running and all_free(eng)


def test_abort_finished_is_an_unknown_request(checker):
    """A finished request is gone: aborting it names it as unknown."""
    eng = engine([FullAttention(2)], 8, hooks=checker)
    r = eng.add_request([1, 2, 3], 1)
    step(eng, checker)
    assert r.status is Status.FINISHED
    with pytest.raises(RequestError, match=r"unknown request 'r0'; live requests: \[\]"):
        eng.abort(r.request_id)


# ---- asynchronous external loads ----------------------------------------------------------


def async_engine(checker, variant=None):
    """Full + window 8 at block size 4; a remote node published the whole 14-token prompt,
    so admission loads 12 tokens (never the last one) asynchronously."""
    eng = engine([FullAttention(4), SlidingWindow(4, 8)], 20, variant=variant, hooks=checker, connector="async")
    prompt = list(range(14))
    eng.connector.publish_prefix(prompt)
    r = eng.add_request(prompt, 2)
    report = step(eng, checker)
    assert report.admitted == [r.request_id] and report.scheduled == {}
    assert r.status is Status.LOADING and r.pending_external == 12
    assert table(eng, r) == ([1, 2, 3], [0, 4, 5])
    return eng, r


def test_async_load_completes_then_the_rest_is_computed(checker):
    """On success the loaded tokens count as computed and get cached; the next step computes
    only the remaining 2 prompt tokens."""
    eng, r = async_engine(checker)
    eng.finish_load(r.request_id, ok=True)
    checker.check_all(eng)
    assert (r.status, r.num_computed_tokens, eng.loaded) == (Status.LOADED, 12, [r])
    assert eng.allocator.pool.blocks[1].key is not None
    report = step(eng, checker)
    assert (report.scheduled, r.status) == ({r.request_id: 2}, Status.RUNNING)
    drain(eng, checker)


def test_a_loaded_request_aborted_before_it_continues_frees_its_blocks(checker):
    eng, r = async_engine(checker)
    eng.finish_load(r.request_id, ok=True)
    eng.abort(r.request_id)
    checker.check_all(eng)
    assert (r.status, eng.loaded, all_free(eng)) == (Status.ABORTED, [], True)


def two_loads(checker, variant=None):
    """Two published 14-token prompts on 6 usable blocks of 4: each load takes 3 blocks and its
    request 4 in all (1 more to finish its prompt)."""
    eng = engine([FullAttention(4)], 7, variant=variant, hooks=checker, connector="async")
    first, second = list(range(14)), list(range(100, 114))
    for prompt in (first, second):
        eng.connector.publish_prefix(prompt)
    a, b = eng.add_request(first, 2), eng.add_request(second, 2)
    step(eng, checker)
    return eng, a, b


def test_a_second_load_waits_while_the_first_would_have_no_room_to_finish(checker):
    """After the first load the pool has 3 free blocks; the second would take all 3 and leave
    none of the 1 the first still needs."""
    eng, a, b = two_loads(checker)
    assert (a.status, b.status, eng.view.num_free_blocks) == (Status.LOADING, Status.WAITING, 3)
    assert drain(eng, checker) > 0


def test_a_load_admitted_without_room_for_the_first_to_finish_is_load_room_short(checker):
    with pytest.raises(Violation, match="load-room-short: the asynchronous load of 'r1' was admitted leaving 0"):
        two_loads(checker, "loads-unreserved")


def test_loads_admitted_without_room_to_finish_never_end(checker):
    eng, a, b = two_loads(Checker(enabled=False), "loads-unreserved")  # admitted unjudged
    assert (a.status, b.status, eng.view.num_free_blocks) == (Status.LOADING, Status.LOADING, 0)
    with pytest.raises(Violation, match="liveness: 2 requests still live after 3 drain steps, waiting for admission"):
        drain(eng, checker)


LOAD_AND_DECODE = Path(__file__).parent / "data" / "load-and-decode-preempt-each-other.json"


def test_a_load_waits_while_a_running_request_needs_its_next_drafts():
    """A walker's find: with drafts, a load admitted while a request decodes took the blocks
    its next verification step needed; each preempted the other one token from its end,
    forever. The engine keeps those blocks back while a request runs (``draft_step_blocks``)."""
    from kvprop.search.execute import execute
    from kvprop.search.trace import load

    assert execute(load(LOAD_AND_DECODE)) is None


def test_without_the_draft_reserve_that_walk_never_ends(monkeypatch):
    from kvprop.search.execute import execute
    from kvprop.search.trace import load
    from kvprop.sim.engine import Engine

    monkeypatch.setattr(Engine, "draft_step_blocks", lambda self: 0)
    assert execute(load(LOAD_AND_DECODE)).kind == "liveness"


def test_async_load_failure_frees_blocks_and_recomputes(checker):
    """On failure every block is freed, progress resets, the request goes to the front of
    waiting and is recomputed without the connector."""
    eng, r = async_engine(checker)
    eng.finish_load(r.request_id, ok=False)
    checker.check_all(eng)
    assert r.status is Status.WAITING and r.load_failed and r.num_computed_tokens == 0
    assert table(eng, r) == ([], []) and all_free(eng)
    assert eng.waiting[0] is r and eng.events[EV_LOAD_FAIL] == 1
    report = step(eng, checker)
    assert report.scheduled == {r.request_id: 14}
    assert r.status is Status.RUNNING
    drain(eng, checker)


def test_async_load_failure_under_the_fail_policy_ends_the_request(checker):
    """vLLM's default policy: the request ends with an error and gives every block back."""
    eng = engine([FullAttention(4)], 20, hooks=checker, connector="async", load_failure_policy="fail")
    prompt = list(range(14))
    eng.connector.publish_prefix(prompt)
    r = eng.add_request(prompt, 2)
    step(eng, checker)
    eng.finish_load(r.request_id, ok=False)
    checker.check_all(eng)
    assert (r.status, eng.requests, list(eng.waiting), all_free(eng), eng.events[EV_LOAD_FAIL]) == (
        Status.FAILED,
        {},
        [],
        True,
        1,
    )


@pytest.mark.parametrize("ok", [True, False])
def test_abort_during_async_load_defers_the_free(checker, ok):
    """An abort while loading marks the request aborting and keeps its blocks (the load
    still writes them); a second abort is a no-op; the free happens when the load resolves."""
    eng, r = async_engine(checker)
    held = table(eng, r)
    eng.abort(r.request_id)
    checker.check_all(eng)
    assert r.status is Status.ABORTING and eng.events[EV_ABORT_LOAD] == 1
    assert table(eng, r) == held
    assert all(eng.allocator.pool.blocks[b].ref_cnt == 1 for g in held for b in g if b)
    eng.abort(r.request_id)
    assert r.status is Status.ABORTING
    step(eng, checker)  # the aborting request is not scheduled, its blocks stay put
    assert table(eng, r) == held
    eng.finish_load(r.request_id, ok=ok)
    checker.check_all(eng)
    assert r.status is Status.ABORTED and eng.requests == {} and all_free(eng)


def test_abort_during_load_keeps_the_blocks_until_the_load_resolves(checker):
    eng, r = async_engine(checker, None)
    eng.abort(r.request_id)
    checker.check_all(eng)
    eng.finish_load(r.request_id, ok=True)
    assert all_free(eng) and eng.requests == {}


def test_abort_during_load_on_the_buggy_engine_is_caught_at_the_free(checker):
    """The free-during-async-load variant frees the blocks at the abort, while the load is
    still pending for the request: the free itself is judged (freed-request-remains)."""
    eng, r = async_engine(checker, "free-during-async-load")
    with pytest.raises(Violation, match="freed-request-remains"):
        eng.abort(r.request_id)


def test_finish_load_without_a_load_in_flight(checker):
    """finish_load names the request and the loads actually in flight."""
    eng, r = async_engine(checker)
    eng.finish_load(r.request_id, ok=True)
    with pytest.raises(RequestError, match=r"finish_load: no load in flight for 'r0'; in flight: \[\]"):
        eng.finish_load(r.request_id, ok=True)


# ---- prefix-cache reset and a mixed drain -----------------------------------------------


def test_reset_prefix_cache_through_the_engine(checker):
    """Refused while a request runs; after it finishes the cache is empty and a repeat of
    the prompt gets no hit (it is computed in full)."""
    eng = engine([FullAttention(2)], 10, hooks=checker)
    r = eng.add_request([1, 2, 3, 4, 5], 2)
    step(eng, checker)
    assert eng.reset_prefix_cache() is False
    drain(eng, checker)
    assert eng.reset_prefix_cache() is True
    assert eng.allocator.pool.cached == {}
    again = eng.add_request([1, 2, 3, 4, 5], 1)
    report = step(eng, checker)
    assert report.scheduled == {again.request_id: 5}
    assert r.status is Status.FINISHED


def test_shared_prefix_is_hit_by_a_later_request(checker):
    """A later request with the same prefix reuses the cached blocks and computes only its tail."""
    eng = engine([FullAttention(2), SlidingWindow(2, 4)], 20, hooks=checker)
    eng.add_request([1, 2, 3, 4, 5, 6, 7], 1)
    step(eng, checker)
    b = eng.add_request([1, 2, 3, 4, 5, 6, 9], 1)
    report = step(eng, checker)
    assert report.scheduled == {b.request_id: 1}
    assert all_free(eng)


def test_the_fail_policy_needs_an_asynchronous_connector():
    with pytest.raises(ConfigError, match="load_failure_policy 'fail' needs connector 'async', got 'sync'"):
        EngineConfig(AllocatorConfig((FullAttention(4),), 8), connector="sync", load_failure_policy="fail")
