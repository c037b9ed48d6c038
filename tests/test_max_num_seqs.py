"""``EngineConfig.max_num_seqs``: vLLM's limit on running requests, in kvprop's scheduler, its
trace, its minimiser and its sampler, all from the option's one declaration."""

from __future__ import annotations

import random

import attrs
from helpers import engine

from kvprop.allocator.specs import FullAttention
from kvprop.check.checker import Checker, drain
from kvprop.repro.minimise import _simpler_configs
from kvprop.search.alphabet import RandomChooser, sample_config
from kvprop.search.trace import config_from_dict, config_to_dict
from kvprop.search.walk import run_walk
from kvprop.sim.request import Status


def step(eng, checker):
    report = eng.step()
    checker.check_all(eng)
    return report


def test_a_full_batch_admits_no_request():
    checker = Checker()
    eng = engine([FullAttention(4)], 20, hooks=checker, token_budget=64, max_num_seqs=1)
    first, second = eng.add_request(list(range(6)), 3), eng.add_request(list(range(50, 56)), 3)
    report = step(eng, checker)
    assert (report.admitted, [r.status for r in (first, second)]) == (
        [first.request_id],
        [Status.RUNNING, Status.WAITING],
    )


def test_the_next_request_joins_when_one_finishes():
    checker = Checker()
    eng = engine([FullAttention(4)], 20, hooks=checker, token_budget=64, max_num_seqs=1)
    eng.add_request(list(range(6)), 1), eng.add_request(list(range(50, 56)), 1)
    reports = [step(eng, checker) for _ in range(2)]
    assert [(r.admitted, r.finished) for r in reports] == [(["r0"], ["r0"]), (["r1"], ["r1"])]


def test_a_full_batch_still_starts_an_asynchronous_load():
    checker = Checker()
    eng = engine([FullAttention(4)], 20, hooks=checker, connector="async", max_num_seqs=1)
    running = eng.add_request(list(range(6)), 3)
    step(eng, checker)
    prompt = list(range(100, 114))
    eng.connector.publish_prefix(prompt)
    loading = eng.add_request(prompt, 2)
    report = step(eng, checker)
    assert (running.status, loading.status, report.admitted) == (Status.RUNNING, Status.LOADING, [loading.request_id])


def test_a_finished_load_waits_while_the_batch_is_full():
    checker = Checker()
    eng = engine([FullAttention(4)], 20, hooks=checker, connector="async", max_num_seqs=1)
    prompt = list(range(100, 114))
    eng.connector.publish_prefix(prompt)
    loading = eng.add_request(prompt, 2)
    step(eng, checker)
    running = eng.add_request(list(range(6)), 5)
    step(eng, checker)
    eng.finish_load(loading.request_id, ok=True)
    report = step(eng, checker)
    assert (running.status, loading.status, loading.request_id in report.scheduled) == (
        Status.RUNNING,
        Status.LOADED,
        False,
    )
    drain(eng, checker)


def test_a_trace_spells_it_and_one_without_it_ran_unlimited():
    config = attrs.evolve(sample_config(RandomChooser(random.Random(0))), max_num_seqs=2)
    spelled = config_to_dict(config)
    absent = {k: v for k, v in spelled.items() if k != "max_num_seqs"}
    assert (config_from_dict(spelled).max_num_seqs, config_from_dict(absent).max_num_seqs) == (2, None)


def test_the_minimiser_tries_no_limit():
    config = attrs.evolve(sample_config(RandomChooser(random.Random(0))), max_num_seqs=2)
    assert any(c is not None and c.max_num_seqs is None for c in _simpler_configs(config))


def test_the_sampler_draws_a_limit_in_some_shapes():
    drawn = {sample_config(RandomChooser(random.Random(seed))).max_num_seqs for seed in range(200)}
    assert drawn == {None, 1, 2, 4}


def test_walks_with_a_limit_stay_clean_on_the_correct_allocator():
    """The correct allocator under every drawn limit: no finding over 300 walks."""
    failures = [run_walk(seed).failure for seed in range(300)]
    assert [f for f in failures if f is not None] == []
