"""``kvprop bench``: start-up, throughput, scaling and time-to-find, both drivers side by side.

Figures are wall-clock on whatever machine runs them; compare ratios measured in one run.
Nothing here is asserted: the targets part states each speed target beside the measured value.
The tables are rendered by ``kvprop.front.bench_doc`` (``--markdown PATH`` writes them as a document,
docs/benchmarks.md through ``make benchmarks``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule, run_state_machine_as_test

from kvprop.allocator.specs import AllocatorConfig, EngineConfig, FullAttention, Mamba, SlidingWindow
from kvprop.check.checker import Checker
from kvprop.errors import ConfigError
from kvprop.front import bench_doc, find_bench, startup_bench
from kvprop.front.choices import DEFAULT_PARTS, PARTS  # noqa: F401 - PARTS still importable from here
from kvprop.front.find_bench import find_caps, find_row, time_to_find_bound
from kvprop.search import DRIVERS, fuzz, profiles
from kvprop.search.machine import machine_for
from kvprop.search.walk import run_walk
from kvprop.targets import build_engine
from kvprop.targets.variants import VARIANTS


def _recorder(into: list):
    return lambda i, op, outcome: into.append(i)


def _walk_rate(
    seconds: float, checks: bool, num_blocks: int | None = 64, target: str | None = None
) -> tuple[float, int]:
    """Steps/s of the walker over sampled configurations, with the pool fixed at ``num_blocks``
    (None: the sampled pool, as ``kvprop fuzz`` runs them)."""
    steps, seed, start = 0, 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        executed: list = []
        run_walk(seed, target=target, checks=checks, num_blocks=num_blocks, on_step=_recorder(executed))
        steps += len(executed)
        seed += 1
    elapsed = time.perf_counter() - start
    return steps / elapsed, steps


def _machine_rate(examples: int, checks: bool) -> tuple[float, int]:
    profiles.register()
    machine = machine_for(None, checks=checks)
    start = time.perf_counter()
    run_state_machine_as_test(machine, settings=settings(settings.get_profile("ci"), max_examples=examples))
    elapsed = time.perf_counter() - start
    return machine.counters["steps"] / elapsed, machine.counters["steps"]


class TrivialMachine(RuleBasedStateMachine):
    """Hypothesis's own ceiling: one rule that does nothing with one small integer."""

    steps = 0

    @rule(x=st.integers(0, 7))
    def nothing(self, x):
        type(self).steps += 1


def _trivial_rate(examples: int) -> tuple[float, int]:
    profiles.register()
    TrivialMachine.steps = 0
    start = time.perf_counter()
    run_state_machine_as_test(TrivialMachine, settings=settings(settings.get_profile("ci"), max_examples=examples))
    elapsed = time.perf_counter() - start
    return TrivialMachine.steps / elapsed, TrivialMachine.steps


def _progress(text: str) -> None:
    """Each measurement announces itself on stderr: a benchmark is never silent for long."""
    print(f"  measuring {text} ...", file=sys.stderr, flush=True)


def startup(quick: bool) -> list[dict]:
    """Seconds of commands that run nothing, each a fresh process (``kvprop.front.startup_bench``)."""
    return startup_bench.rows(quick, _progress)


def throughput(quick: bool) -> list[dict]:
    seconds, examples = (2.0, 40) if quick else (8.0, 150)
    rows: list[dict[str, Any]] = []
    for name, measure in (
        ("walk, all checks", lambda: _walk_rate(seconds, True)),
        ("walk, checks off", lambda: _walk_rate(seconds, False)),
        ("state machine, all checks", lambda: _machine_rate(examples, True)),
        ("state machine, checks off", lambda: _machine_rate(examples, False)),
        ("Hypothesis, trivial rule", lambda: _trivial_rate(examples)),
    ):
        _progress(f"throughput: {name}")
        rate, steps = measure()
        rows.append({"driver": name, "steps": steps, "steps_per_s": round(rate)})
    base = rows[0]["steps_per_s"]
    for row in rows:
        row["vs_walk_checked"] = round(row["steps_per_s"] / base, 3) if base else None
    return rows


ISOLATED_TARGET = "examples.toy_allocator:TARGET"  # a user's target: its runs each run in a fresh fork


def supervision(quick: bool) -> list[dict]:
    """The same walks (seeds of run seed 0, worker 0) run in this process and in a supervised
    worker (``kvprop.search.supervisor``: the journal of each operation, the target's output to
    a log, the parent watching), checks on: what running target code apart costs; for kvprop's
    own allocator, whose runs share the worker, and for a user's target, whose runs each run in
    a fresh fork of it (``kvprop.search.isolation``)."""
    rows: list[dict[str, Any]] = []
    for target in (None, ISOLATED_TARGET):
        rows += _supervision_rows(60 if quick else 300, target)
    return rows


def _supervision_rows(runs: int, target: str | None) -> list[dict[str, Any]]:
    from kvprop.search.walk import walk_seed

    name = target or "kvprop"
    _progress(f"supervision: {runs} walks on {name} in this process")
    steps, start = 0, time.perf_counter()
    for i in range(runs):
        steps += run_walk(walk_seed(0, i), target=target).steps_run
    in_process = time.perf_counter() - start
    apart = "supervised worker, a fork per run" if target else "supervised worker"
    _progress(f"supervision: the same {runs} walks in a {apart}")
    start = time.perf_counter()
    result = fuzz.search(fuzz.FuzzOptions(seconds=3600, workers=1, seed=0, max_runs=runs, target=target))
    supervised = time.perf_counter() - start
    rows: list[dict[str, Any]] = [
        {"target": name, "where": "this process", "walks": runs, "steps": steps, "seconds": round(in_process, 2)},
        {"target": name, "where": apart, "walks": result.runs, "steps": result.steps, "seconds": round(supervised, 2)},
    ]
    for row in rows:
        row["steps_per_s"] = round(row["steps"] / row["seconds"]) if row["seconds"] else None
        row["vs_this_process"] = round(row["steps_per_s"] / rows[0]["steps_per_s"], 3)
    return rows


# The scaling rows' model shapes: groups and connector (a state group takes no synchronous one).
SHAPES: dict[str, tuple[tuple, dict[str, Any]]] = {
    "fa+swa": ((FullAttention(4), SlidingWindow(4, 16)), {"connector": "sync"}),
    "fa+mamba": ((FullAttention(4), Mamba(4)), {}),
}


def _scaling_cell(
    num_blocks: int,
    live: int,
    checks: bool,
    steps: int,
    tokens: int | None = None,
    target: str | None = None,
    shape: str = "fa+swa",
) -> float:
    """Seconds per engine step with ``live`` requests (refilled as they finish) over a ``num_blocks``
    pool; each request ``tokens`` long (by default as long as a fair share of the pool allows)."""
    groups, connector = SHAPES[shape]
    config = EngineConfig(AllocatorConfig(groups, num_blocks), token_budget=4096, **connector)
    checker = Checker(enabled=checks)
    engine = build_engine(config, target=target, hooks=checker)
    if tokens is None:
        tokens = max(4, min(64, ((num_blocks - 1) // 2 // live) * 4))
    added = [0]

    def refill():
        while len(engine.requests) < live:
            i = added[0] = added[0] + 1
            engine.add_request([(i * 7 + j) % 4 for j in range(tokens // 2 - 1)] + [i % 4], tokens // 2)

    for _ in range(3):
        refill()
        engine.step()
        checker.check_all(engine)
    start = time.perf_counter()
    for _ in range(steps):
        refill()
        engine.step()
        checker.check_all(engine)
    return (time.perf_counter() - start) / steps


def _scaling_row(
    num_blocks: int, live: int, steps: int, tokens: int | None = None, target=None, shape: str = "fa+swa"
) -> dict:
    on = _scaling_cell(num_blocks, live, True, steps, tokens, target, shape)
    off = _scaling_cell(num_blocks, live, False, steps, tokens, target, shape)
    return {
        "groups": shape,
        "blocks": num_blocks,
        "live_requests": live,
        "tokens": tokens or "share",
        "steps_per_s": round(1 / on),
        "unchecked_steps_per_s": round(1 / off),
        "check_us_per_step": round((on - off) * 1e6, 1),
        "check_vs_step": round((on - off) / off, 2),
    }


# Requests as long at every pool size: what the checks cost as the pool grows, tables alike.
SAME_REQUESTS = (8, 64)  # live requests, tokens each


def scaling(quick: bool) -> list[dict]:
    steps = 60 if quick else 300
    rows = []
    for num_blocks in (16, 256, 4096):
        for live in (1, 8, 64):
            _progress(f"scaling: {num_blocks} blocks, {live} live requests")
            rows.append(_scaling_row(num_blocks, live, steps))
    live, tokens = SAME_REQUESTS
    for shape in SHAPES:
        for num_blocks in (256, 4096):
            _progress(f"scaling: {shape}, {num_blocks} blocks, {live} live requests of {tokens} tokens")
            rows.append(_scaling_row(num_blocks, live, steps, tokens, shape=shape))
    return rows


def vllm(quick: bool) -> list[dict]:
    """vLLM's allocator as the target (run from a vLLM environment, ``make vllm-env``), measured
    in a supervised worker (``kvprop.search.supervisor``): vLLM never runs in kvprop's process."""
    from kvprop.search.supervisor import Supervisor

    with Supervisor("vllm") as supervisor:
        return supervisor.call(vllm_here, {"quick": quick}, progress=_progress)


def vllm_here(quick: bool, journal=None, progress=_progress) -> list[dict]:
    """In the worker: walk throughput, and the engine step at two pool sizes with the view's
    change tracking by snapshots and by watched blocks (``kvprop.targets.vllm.view.WATCH_FROM_BLOCKS``)."""
    from kvprop.targets.vllm import view as target

    _walk_rate(0.01, False, None, target="vllm")  # imports vLLM (a ConfigError without it), not timed
    seconds, steps = (2.0, 20) if quick else (8.0, 60)
    rows = []
    for name in ("vllm", "vllm-scheduler"):
        rows += _checked_vs_unchecked(name, seconds, progress)
    saved = target.WATCH_FROM_BLOCKS
    try:
        for num_blocks in (256, 4096):
            for watched in (False, True):
                target.WATCH_FROM_BLOCKS = 0 if watched else 10**9
                how = "watched blocks" if watched else "snapshots"
                progress(f"vLLM target: {num_blocks} blocks, 64 live, {how}")
                row = _scaling_row(num_blocks, 64, steps, target="vllm")
                rows.append(
                    {
                        "measure": f"{num_blocks} blocks, 64 live, {how}: check us per step",
                        "value": row["check_us_per_step"],
                        "steps": steps,
                        "vs_unchecked_step": row["check_vs_step"],
                    }
                )
    finally:
        target.WATCH_FROM_BLOCKS = saved
    return rows


def sglang(quick: bool) -> list[dict]:
    """SGLang's scheduler loop as the target (run from an SGLang environment, ``make sglang-env``),
    measured in a supervised worker: SGLang never runs in kvprop's process."""
    from kvprop.search.supervisor import Supervisor

    with Supervisor("sglang") as supervisor:
        return supervisor.call(sglang_here, {"quick": quick}, progress=_progress)


def sglang_here(quick: bool, journal=None, progress=_progress) -> list[dict]:
    """In the worker: walk throughput with every SGLang check on and with none."""
    _walk_rate(0.01, False, None, target="sglang")  # imports SGLang (a ConfigError without it), not timed
    return _checked_vs_unchecked("sglang", 3.0 if quick else 15.0, progress)


def _checked_vs_unchecked(target: str, seconds: float, progress) -> list[dict]:
    """Walk throughput on ``target`` with every check on and with none, over the sampled
    configurations as ``kvprop fuzz`` runs them, and checked / unchecked, measured in one run."""
    rates = {}
    for checks in (True, False):
        progress(f"{target}: walk, checks {'on' if checks else 'off'}")
        rates[checks] = _walk_rate(seconds, checks, None, target=target)
    rows = [
        {"measure": f"{target}: walk, checks {'on' if checks else 'off'} (ops/s)", "value": round(rate), "steps": n}
        for checks, (rate, n) in rates.items()
    ]
    ratio = rates[True][0] / rates[False][0] if rates[False][0] else None
    rows.append(
        {"measure": f"{target}: checked / unchecked ops/s", "value": round(ratio, 2) if ratio else None, "steps": None}
    )
    return rows


def time_to_find(quick: bool) -> list[dict]:
    return find_bench.time_to_find(quick, _progress)


CROSS_GROUP = "interleaved-external-alloc"  # the motivating bug: the targets table's time-to-find rows


def _rate(rows, driver) -> float:
    """The throughput row of ``driver``; a table without it (a baseline from elsewhere) is refused."""
    for r in rows:
        if r["driver"] == driver:
            return r["steps_per_s"]
    raise ConfigError(f"the throughput table has no row for {driver!r}")


def _cell(rows, blocks, live, tokens="share", shape="fa+swa") -> dict:
    """The scaling row of that shape; a table without it (a baseline from elsewhere) is refused."""
    want = (shape, blocks, live, tokens)
    for r in rows:
        if (r["groups"], r["blocks"], r["live_requests"], r["tokens"]) == want:
            return r
    raise ConfigError(f"the scaling table has no row for {want}")


def targets(quick: bool, result: dict) -> list[dict]:
    """The speed targets, each from the measurements above (measuring what is missing), with
    its target and whether this run meets it."""
    tp = result.get("throughput") or throughput(quick)
    sc = result.get("scaling") or scaling(quick)
    found = [r for r in result.get("time_to_find", ()) if r["variant"] == CROSS_GROUP]
    if not found:
        seeds, cap = find_caps(quick)
        found = [find_row(CROSS_GROUP, driver, seeds, cap[driver], _progress) for driver in DRIVERS]
    walk_on, walk_off = _rate(tp, "walk, all checks"), _rate(tp, "walk, checks off")
    machine, trivial = _rate(tp, "state machine, all checks"), _rate(tp, "Hypothesis, trivial rule")
    big = _cell(sc, 4096, 64)
    live, tokens = SAME_REQUESTS
    walk, hyp = ({r["driver"]: r for r in found}.get(d, {}) for d in DRIVERS)

    def row(measure, value, target, met):
        return {"measure": measure, "value": value, "target": target, "met": "yes" if met else "no"}

    rows = [
        row("walk, 64 blocks: checked / unchecked", round(walk_on / walk_off, 2), ">= 0.7", walk_on >= 0.7 * walk_off),
        row("walk, 64 blocks: checked ops/s", walk_on, ">= 15,000 (quiet core)", walk_on >= 15_000),
        row("state machine checked / trivial rule", round(machine / trivial, 2), ">= 0.5", machine >= 0.5 * trivial),
        row("4,096 blocks, 64 live: check / unchecked step", big["check_vs_step"], "<= 1", big["check_vs_step"] <= 1),
    ]
    for measure, cell in (
        ("check cost 4,096 / 256 blocks, 64 live", lambda n: _cell(sc, n, 64)),
        (f"check cost 4,096 / 256 blocks, {live} live x {tokens} tokens", lambda n: _cell(sc, n, live, tokens)),
        ("the same with a state group (fa+mamba)", lambda n: _cell(sc, n, live, tokens, "fa+mamba")),
    ):
        ratio = cell(4096)["check_us_per_step"] / cell(256)["check_us_per_step"]
        rows.append(row(measure, round(ratio, 2), "<= 1.2", ratio <= 1.2))
    for name, r, steps_target, secs_target in (("walk", walk, None, 0.3), ("state machine", hyp, 8000, 2.0)):
        if not r.get("found"):
            rows.append(row(f"cross-group bug, {name}: median steps / s", "not found", "found", False))
            continue
        met = r["median_s"] <= secs_target and (steps_target is None or r["median_steps"] <= steps_target)
        target = f"<= {secs_target} s" if steps_target is None else f"<= {steps_target:,} steps, <= {secs_target} s"
        value = f"{r['median_steps']:,} / {r['median_s']} s"
        rows.append(row(f"cross-group bug, {name}: median steps / s", value, target, met))
    vl = result.get("vllm")
    if vl:
        rate = vl[0]["value"]
        rows.append(row("vLLM target: walk, checked ops/s", rate, ">= 3x ~1,800 (5,400)", rate >= 5400))
    else:
        rows.append(row("vLLM target: walk, checked ops/s", "not measured (part vllm)", ">= 5,400", False))
    return rows


def load_baseline(path: str) -> dict:
    """Measure -> value of the targets table in an earlier ``kvprop bench --json`` run's output
    (the same command on the previous code): the "before" column. Read as data, checked
    before anything is measured."""
    where = f"baseline {path!r}"
    from kvprop.search.trace import TraceError, read_regular

    try:
        data = json.loads(read_regular(Path(path), 16 << 20, "baseline").decode("utf-8"))
    except TraceError as e:
        raise ConfigError(str(e)) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{where}: not JSON ({e})") from None
    rows = data.get("targets") if isinstance(data, dict) else None
    if not isinstance(rows, list) or not all(
        isinstance(r, dict) and isinstance(r.get("measure"), str) and "value" in r for r in rows
    ):
        raise ConfigError(
            f"{where}: expected the output of `kvprop bench --json` with its targets part: an object whose "
            f'"targets" is a list of rows, each with a "measure" string and a "value"'
        )
    return {r["measure"]: r["value"] for r in rows}


def with_baseline(rows: list[dict], baseline: dict) -> list[dict]:
    """Each targets row with the baseline's value for the same measure beside its own."""
    return [{"measure": r["measure"], "before": baseline.get(r["measure"], "not measured"), **r} for r in rows]


def ray(quick: bool) -> list[dict]:
    from kvprop.front import ray_bench

    return ray_bench.rows(quick)


def main(
    quick: bool = False,
    as_json: bool = False,
    parts=DEFAULT_PARTS,
    baseline: str | None = None,
    markdown: str | None = None,
) -> dict:
    """The tables of ``parts`` (printed as each is measured unless ``as_json``), written as a
    markdown document to ``markdown`` if given; returned for ``--json``."""
    from kvprop.front.output_paths import unwritable_is_usage

    funcs = {
        "startup": startup,
        "throughput": throughput,
        "supervision": supervision,
        "scaling": scaling,
        "time_to_find": time_to_find,
        "vllm": vllm,
        "sglang": sglang,
        "ray": ray,
    }
    before = load_baseline(baseline) if baseline is not None else None
    if before is not None and "targets" not in parts:
        raise ConfigError("--baseline adds a column to the targets table: name the targets part too")
    if "time_to_find" in parts or "targets" in parts:
        seeds, cap = find_caps(quick)
        print(
            f"kvprop bench: time to find searches each of {len(VARIANTS)} variants with each driver "
            f"{len(seeds)} time(s), capped at {', '.join(f'{cap[d]:g} s ({d})' for d in DRIVERS)}: at most "
            f"{time_to_find_bound(quick) / 60:.1f} minutes of searching for that part",
            file=sys.stderr,
            flush=True,
        )
    result: dict = {}
    for part in parts:
        result[part] = targets(quick, result) if part == "targets" else funcs[part](quick)
        if part == "targets" and before is not None:
            result[part] = with_baseline(result[part], before)
        if not as_json:
            print(bench_doc.table(part.replace("_", " "), result[part]) + "\n", flush=True)
    if markdown is not None:
        with unwritable_is_usage(markdown, "--markdown"):
            bench_doc.write(markdown, result, bench_doc.command_line(quick, parts, DEFAULT_PARTS, markdown))
    return result
