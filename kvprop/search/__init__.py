"""Search: the operation alphabet and configuration sampler, the harness, the trace format,
the two drivers (the Hypothesis state machine and the seeded walker), fuzz orchestration,
Hypothesis profiles and the shared Redis store.

Both drivers apply the same operations to the same harness, so a trace found by either
replays on both. ``alphabet`` and ``trace`` import neither torch nor the engine. It may
import every layer below it: allocator, sim, check, targets.
"""

DRIVERS = ("walk", "hypothesis")  # here, importing nothing, so the CLI can name them cheaply
MAX_MEMORY_MIB = 8192  # MiB a worker may hold (a vLLM worker holds about 1 GiB): past it, a target-oom find
FUZZ_SECONDS = 60.0  # the time budget of a search given no budget at all
MIN_CALL_TIMEOUT = 10.0  # the least call timeout a time budget brings it down to (kvprop.front.cli)
CALL_TIMEOUT = 60.0  # seconds a target may go without progress (importing vLLM on a loaded 2-core machine: a fraction)
RAY_BATCH = 64  # runs per Ray task (kvprop.search.ray_campaign): a task's start is then a small share of it
