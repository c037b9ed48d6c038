"""Walks restricted to the shapes with a state group and drafts, until a step budget has run.

    python scripts/soak-state-drafts.py TARGET STEPS    (TARGET: kvprop, vllm, vllm-scheduler)

Prints how many walks and steps ran (by connector mode) and how they ended. The walk seeds
are 1, 2, ... skipping those whose sampled configuration has no Mamba group or no drafts,
so two runs with the same arguments run the same walks.
"""

from __future__ import annotations

import sys
import time
from collections import Counter

from kvprop.allocator.specs import Mamba
from kvprop.search.walk import plan, run_walk


def main(target: str, goal: int) -> None:
    steps = walks = refused = seed = 0
    outcomes, by_connector = Counter(), Counter()
    start = time.monotonic()
    while steps < goal:
        seed += 1
        config = plan(seed).config
        if not (config.speculative_tokens and any(isinstance(g, Mamba) for g in config.allocator.groups)):
            continue
        result = run_walk(seed, target=None if target == "kvprop" else target)
        walks, steps, refused = walks + 1, steps + result.steps_run, refused + (result.refused is not None)
        by_connector[config.connector] += result.steps_run
        outcomes["refused" if result.refused else result.failure.kind if result.failure else "clean"] += 1
    print(
        f"target {target}: {walks:,} walks ({refused} refused), {steps:,} steps with a state group and drafts "
        f"(by connector: {dict(by_connector)}), seeds 1..{seed}, {time.monotonic() - start:.0f}s; "
        f"outcomes {dict(outcomes)}"
    )


TARGETS = ("kvprop", "vllm", "vllm-scheduler")

if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in TARGETS or not sys.argv[2].isdigit() or int(sys.argv[2]) < 1:
        print(f"usage: python scripts/soak-state-drafts.py TARGET STEPS (TARGET one of {TARGETS}, STEPS >= 1), "
              f"got {sys.argv[1:]}", file=sys.stderr)
        sys.exit(2)
    main(sys.argv[1], int(sys.argv[2]))
