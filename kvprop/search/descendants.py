"""The processes of a worker and of the target it runs: a group of their own, ended together,
and the memory they hold.

A supervised worker (``kvprop.search.supervisor``) leads a process group and is a child
subreaper, so every process its target starts stays in reach: none outlives its run, its
worker or kvprop (a target that forked once per call left hundreds of orphans behind). The
parent reads the worker's resident memory, so that a target that leaks is a find
(``target-oom``) rather than a machine brought down.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

__all__ = ["children", "die_with_parent", "end_descendants", "end_group", "lead_own_group", "resident_mib"]

PAGE = os.sysconf("SC_PAGE_SIZE")


def die_with_parent(parent: int) -> None:
    """Workers must not outlive the parent, even one killed by SIGKILL: ask Linux to send
    SIGKILL when it dies (elsewhere the loops check ``os.getppid``)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(0)


PR_SET_CHILD_SUBREAPER = 36


def lead_own_group() -> None:
    """This worker leads a process group of its own, and adopts the orphans of whatever the target
    starts (Linux's child subreaper): every descendant of the target stays in the group or becomes
    the worker's child, so ``end_descendants`` ends them between runs and ``end_group`` ends the
    group with the worker. A signal sent to kvprop's own group (``timeout``, a CI cancelling, a
    terminal's Ctrl-C) reaches kvprop alone, which ends its workers itself."""
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1)


def children() -> list[int]:
    """The worker's child processes (the target's, and the orphans it adopted), from ``/proc``."""
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/children") as f:
                found += [int(pid) for pid in f.read().split()]
    return found


def end_descendants() -> None:
    """Between runs: no process the target started in one run lives into the next. Each child is
    killed with its own group (a target may have given it one) and reaped; the orphans of those it
    killed come back as children, until none is left."""
    for _ in range(64):  # each round ends one generation; a target cannot outrun it for long
        pids = children()
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        for pid in pids:
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, 0)


def end_group(pid: int | None) -> None:
    """Kill what is left of the process group worker ``pid`` led: the target's descendants outlive
    neither a run, nor a worker, nor kvprop."""
    if pid is None:
        return
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)


def resident_mib(pid: int) -> float:
    """Resident memory of process ``pid`` in MiB (0 where it cannot be read: gone, or no /proc)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0
