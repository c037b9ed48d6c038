"""``kvprop bench startup``: how long kvprop takes to start, each command timed as a fresh process.

What every command pays before it does anything: a new interpreter, kvprop's imports and the
parsing of its command line. The commands timed run nothing (the help, the version, the list
of targets, an argument error), so their time is start-up alone. The goal, a median under one
second, holds while parsing imports neither torch nor Hypothesis nor an engine: the parser
takes its choices from ``kvprop.front.choices`` and imports a command's module only to run it.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from collections.abc import Callable

# Commands that run nothing, with the exit status each must end with
COMMANDS = ((("--help",), 0), (("--version",), 0), (("targets",), 0), (("fuzz", "--seconds", "-1"), 2))
GOAL = 1.0  # seconds, the median of a fresh process


def rows(quick: bool, progress: Callable[[str], None]) -> list[dict]:
    """Per command, the fastest and the median of several fresh processes, and whether the
    median meets the goal."""
    runs = 3 if quick else 7
    found = []
    for argv, status in COMMANDS:
        command = " ".join(["kvprop", *argv])
        progress(f"startup: {command}, {runs} processes")
        times = [seconds(argv, status) for _ in range(runs)]
        median = round(statistics.median(times), 3)
        found.append(
            {
                "command": command,
                "runs": runs,
                "min_s": round(min(times), 3),
                "median_s": median,
                "goal": f"< {GOAL:g} s",
                "met": "yes" if median < GOAL else "no",
            }
        )
    return found


def seconds(argv: tuple[str, ...], status: int) -> float:
    """Wall-clock seconds of one ``python -m kvprop ARGV``; one that exits otherwise than
    ``status`` is refused, since its time would not be the command's."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "kvprop", *argv], capture_output=True, text=True, timeout=600)
    elapsed = time.perf_counter() - start
    if done.returncode != status:
        said = (done.stderr.strip().splitlines() or ["nothing"])[-1]
        raise RuntimeError(f"`kvprop {' '.join(argv)}` exited {done.returncode}, not {status}: {said}")
    return elapsed
