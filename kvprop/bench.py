"""``kvprop bench``: throughput, scaling and time-to-find, both drivers side by side.

Figures are wall-clock on whatever machine runs them; compare ratios measured in one run.
Nothing here is asserted: targets live in the README next to the measured tables.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

import attrs
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule, run_state_machine_as_test

from kvprop.allocator.specs import AllocatorConfig, EngineConfig, FullAttention, SlidingWindow
from kvprop.check.checker import Checker
from kvprop.repro.minimise import minimise
from kvprop.search import DRIVERS, fuzz, profiles
from kvprop.search.execute import execute
from kvprop.search.machine import machine_for, trace_length
from kvprop.search.walk import plan
from kvprop.targets.kvprop import build_kvprop_engine
from kvprop.targets.variants import VARIANTS


def _recorder(into: list):
    return lambda i, op, outcome: into.append(i)


def _walk_rate(seconds: float, checks: bool, num_blocks: int = 64) -> tuple[float, int]:
    """Steps/s of the walker over sampled configurations with the pool fixed at ``num_blocks``."""
    steps, seed, start = 0, 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        trace = plan(seed)
        config = attrs.evolve(trace.config, allocator=attrs.evolve(trace.config.allocator, num_blocks=num_blocks))
        executed: list = []
        execute(attrs.evolve(trace, config=config), checks=checks, on_step=_recorder(executed))
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


def throughput(quick: bool) -> list[dict]:
    seconds, examples = (2.0, 40) if quick else (8.0, 150)
    rows = []
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


def _scaling_cell(num_blocks: int, live: int, checks: bool, steps: int) -> float:
    """Seconds per engine step with ``live`` requests (refilled as they finish) over a ``num_blocks`` pool."""
    config = EngineConfig(
        AllocatorConfig((FullAttention(4), SlidingWindow(4, 16)), num_blocks), token_budget=4096, connector="sync"
    )
    checker = Checker(enabled=checks)
    engine = build_kvprop_engine(config, hooks=checker)
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


def scaling(quick: bool) -> list[dict]:
    steps = 60 if quick else 300
    rows = []
    for num_blocks in (16, 256, 4096):
        for live in (1, 8, 64):
            _progress(f"scaling: {num_blocks} blocks, {live} live requests")
            on = _scaling_cell(num_blocks, live, True, steps)
            off = _scaling_cell(num_blocks, live, False, steps)
            rows.append(
                {
                    "blocks": num_blocks,
                    "live_requests": live,
                    "steps_per_s": round(1 / on),
                    "unchecked_steps_per_s": round(1 / off),
                    "check_us_per_step": round((on - off) * 1e6, 1),
                }
            )
    return rows


@contextlib.contextmanager
def _fresh_directory():
    old = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        try:
            yield
        finally:
            os.chdir(old)


def time_to_find(quick: bool) -> list[dict]:
    seeds = range(3) if quick else range(5)
    cap = {"walk": 20.0 if quick else 60.0, "hypothesis": 60.0 if quick else 180.0}
    rows = []
    for variant in VARIANTS:
        for driver in DRIVERS:
            secs, steps, shrunk = [], [], []
            for seed in seeds:
                _progress(f"time to find: {variant}, {driver}, seed {seed}")
                with _fresh_directory():  # an empty Hypothesis example database for every search
                    result = fuzz.search(
                        fuzz.FuzzOptions(
                            seconds=cap[driver], workers=1, seed=seed * 1000, driver=driver, variant=variant
                        )
                    )
                if result.found is None:
                    continue
                best = minimise(result.found, variant=variant)
                secs.append(result.seconds_to_find)
                steps.append(result.steps)
                shrunk.append(trace_length(best))
            rows.append(
                {
                    "variant": variant,
                    "driver": driver,
                    "seeds": len(seeds),
                    "found": len(secs),
                    "median_s": round(statistics.median(secs), 2) if secs else None,
                    "max_s": round(max(secs), 2) if secs else None,
                    "median_steps": int(statistics.median(steps)) if steps else None,
                    "max_steps": max(steps) if steps else None,
                    "median_minimised": statistics.median(shrunk) if shrunk else None,
                    "cap_s": cap[driver],
                }
            )
    return rows


def _table(title: str, rows: list[dict]) -> str:
    if not rows:
        return f"{title}: (no rows)"
    cols = list(rows[0])
    width = {c: max(len(c), *(len(_fmt(r[c])) for r in rows)) for c in cols}
    lines = [
        f"## {title}",
        "",
        "| " + " | ".join(c.ljust(width[c]) for c in cols) + " |",
        "|" + "|".join("-" * (width[c] + 2) for c in cols) + "|",
    ]
    lines += ["| " + " | ".join(_fmt(r[c]).rjust(width[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


def main(quick: bool = False, as_json: bool = False, parts=("throughput", "scaling", "time_to_find")) -> int:
    funcs = {"throughput": throughput, "scaling": scaling, "time_to_find": time_to_find}
    result = {}
    for part in parts:
        result[part] = funcs[part](quick)
        if not as_json:
            print(_table(part.replace("_", " "), result[part]) + "\n", flush=True)
    if as_json:
        print(json.dumps(result, indent=1))
    return 0
