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


def children(pid: int | str = "self") -> list[int]:
    """The child processes of ``pid`` (by default this worker's: the target's, and the orphans it
    adopted), from ``/proc``."""
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(child) for child in f.read().split()]
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


def resident_mib(pid: int, bound: float = float("inf")) -> float:
    """Memory held by worker ``pid`` and every process under it (the fork a run runs in, what the
    target started), in MiB; a process that cannot be read (gone, or no /proc) counts 0. Read
    cheaply from each one's resident pages, which count the pages a fork still shares with the
    worker twice; only past ``bound`` is it read again as proportional shares (PSS), which sum
    to what the processes hold together."""
    processes = _under(pid)
    resident = sum(_read_mib(f"/proc/{p}/statm", _statm_resident) for p in processes)
    if resident <= bound:
        return resident
    return sum(_read_mib(f"/proc/{p}/smaps_rollup", _rollup_pss) for p in processes)


def _under(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    found: list[int] = []
    todo = [pid]
    while todo and len(found) < 4096:
        process = todo.pop()
        if process not in found:
            found.append(process)
            todo += children(process)
    return found


def _statm_resident(text: str) -> float:
    return int(text.split()[1]) * PAGE / 2**20


def _rollup_pss(text: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith("Pss:"))
    return int(line.split()[1]) / 1024  # kB


def _read_mib(path: str, parse) -> float:
    try:
        with open(path) as f:
            return parse(f.read())
    except (OSError, ValueError, IndexError, StopIteration):
        return 0.0
