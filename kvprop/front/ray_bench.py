"""``kvprop bench ray``: a campaign as Ray tasks against the process pool on the same runs, and
the cost model of docs/campaigns.md computed from what it measures.

The same campaign (seed 0, kvprop's allocator, a fixed run budget) runs in the process pool
of two workers and as Ray tasks on a Ray instance started here with 2 CPUs (its start is not
timed: a campaign pays it once). From these:

- ``t``, the CPU-seconds of a run as the pool of 2 runs them (2 x its seconds / runs: on a
  loaded machine both campaigns share what is left of the CPUs);
- ``o``, a task's overhead (its start, its worker's fork, the streaming of its finds and
  counts): the same ``k`` runs as ``k`` tasks of one run and as tasks of ``B`` runs, the CPU
  time between them (2 x the difference of their seconds) shared by the tasks the first has
  more;
- ``d``, the driver's CPU-seconds per batch (``time.process_time`` across the campaign; its
  polling included, so an upper bound on a small cluster);
- the expected efficiency on ``n`` nodes of ``c`` CPUs, against the pool on each node: each CPU
  spends ``B t / (B t + o)`` of its time on runs (``B`` runs per batch), and the driver keeps
  up while it handles ``n c / (B t + o)`` batches a second within one CPU (``1 / d``); beyond
  that the cluster waits on it.
"""

from __future__ import annotations

import math
import sys
import time

from kvprop.search import fuzz

CPUS_PER_NODE = 16  # the node of the expected-efficiency rows


def _campaign_seconds(runs: int, workers: int) -> float:
    result = fuzz.search(fuzz.FuzzOptions(seconds=3600, workers=workers, seed=0, max_runs=runs))
    return result.seconds


def efficiency(nodes: int, cpus: int, batch_seconds: float, overhead: float, driver: float) -> float:
    """The share of the cluster's CPU time spent on runs (the model above)."""
    per_cpu = batch_seconds / (batch_seconds + overhead)
    demand = nodes * cpus / (batch_seconds + overhead)  # batches a second the cluster finishes
    return per_cpu * min(1.0, 1.0 / (driver * demand)) if driver > 0 else per_cpu


def rows(quick: bool) -> list[dict]:
    from kvprop.search import ray_campaign as rc

    batch = rc.BATCH_RUNS
    runs = batch * (4 if quick else 16)  # whole batches, as many on each CPU: no tail where one CPU waits
    print(f"  measuring ray: {runs} runs in the process pool of 2 workers ...", file=sys.stderr, flush=True)
    pool = _campaign_seconds(runs, 2)
    print(f"  measuring ray: the same {runs} runs as Ray tasks on 2 local CPUs ...", file=sys.stderr, flush=True)
    rc.connect(None, 2)
    try:
        opts = fuzz.FuzzOptions(seconds=3600, workers=1, seed=0, max_runs=runs)
        rc.check_nodes(opts)
        cpu, start = time.process_time(), time.monotonic()
        result = rc.campaign(opts, slots=2, batch_runs=batch)
        on_ray, driver_cpu = time.monotonic() - start, time.process_time() - cpu
        k = 2 * batch
        print(f"  measuring ray: {k} runs as {k} tasks, then as 2 ...", file=sys.stderr, flush=True)
        few = fuzz.FuzzOptions(seconds=3600, workers=1, seed=0, max_runs=k)
        start = time.monotonic()
        rc.campaign(few, slots=2, batch_runs=1)
        one_each = time.monotonic() - start
        start = time.monotonic()
        rc.campaign(few, slots=2, batch_runs=batch)
        batched = time.monotonic() - start
    finally:
        rc.disconnect()
    batches = -(-runs // batch)
    t = 2 * pool / runs
    overhead = max(0.0, 2 * (one_each - batched) / (k - 2))
    driver = driver_cpu / batches
    rows: list[dict] = [
        {"measure": "runs", "value": result.runs},
        {"measure": "process pool: CPU-seconds per run (t)", "value": round(t, 4)},
        {"measure": "process pool, 2 workers: runs/s", "value": round(runs / pool, 1)},
        {"measure": f"Ray, 2 local CPUs, {batch} runs per task: runs/s", "value": round(runs / on_ray, 1)},
        {"measure": "Ray / process pool (throughput)", "value": round(pool / on_ray, 3)},
        {"measure": "task overhead o (CPU-seconds per batch)", "value": round(overhead, 4)},
        {"measure": "driver d (CPU-seconds per batch)", "value": round(driver, 5)},
    ]
    for nodes in (10, 100):
        cpus = f"{nodes} nodes x {CPUS_PER_NODE} CPUs"
        e = efficiency(nodes, CPUS_PER_NODE, batch * t, overhead, driver)
        rows.append({"measure": f"expected efficiency, {cpus}", "value": round(e, 3)})
        enough = max(batch, math.ceil((nodes * CPUS_PER_NODE * driver - overhead) / t)) if t > 0 else batch
        rows.append({"measure": f"runs per task (--ray-batch) for the driver to keep up, {cpus}", "value": enough})
        e = efficiency(nodes, CPUS_PER_NODE, enough * t, overhead, driver)
        rows.append({"measure": f"expected efficiency with them, {cpus}", "value": round(e, 3)})
    return rows
