"""What makes a process a supervised worker, and how it ends when target code escapes: its
output goes to a log, Ctrl-C is the parent's, it dies with the parent and leads its own process
group (``kvprop.search.descendants``); a ``BaseException`` that escapes target code ends it as
the target asked, for the parent to judge (``kvprop.search.supervisor``)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
from pathlib import Path

from kvprop.search.descendants import die_with_parent, end_descendants, lead_own_group


def enter_worker(log_path: Path, parent: int) -> None:
    """Make this process a worker: the target's output goes to ``log_path``; Ctrl-C is the
    parent's to handle (so a ``KeyboardInterrupt`` here can only come from target code, and is
    its crash); the worker dies with the parent, and leads its own process group."""
    from kvprop.sim import target_calls

    die_with_parent(parent)
    lead_own_group()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    target_calls.supervised()
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def restart_log() -> None:
    """Each run starts with no process of an earlier run left, and its log empty, so the log
    beside a find is that run's output alone."""
    end_descendants()
    sys.stdout.flush()
    sys.stderr.flush()
    with contextlib.suppress(OSError):
        os.ftruncate(1, 0)


ESCAPED_STATUS = 70  # a target's own BaseException ended the worker (named in its journal)


def escaped(error: BaseException) -> None:
    """A ``BaseException`` that is not an ``Exception`` escaped target code (its import or
    factory, or an engine call kvprop does not wrap): kvprop raises none of its own in a worker,
    so it is the target's. ``SystemExit`` and ``KeyboardInterrupt`` end the worker as the target
    asked; any other (``asyncio.CancelledError``, a test framework's outcome) is written to the
    journal first, so that the parent's judgement names it. Either way the death is the target's
    crash, judged by the parent."""
    from kvprop.search import journal as jn

    sys.stdout.flush()
    sys.stderr.flush()
    if isinstance(error, SystemExit):
        code = error.code
        os._exit(code if isinstance(code, int) and 0 <= code < 256 else 1)
    if isinstance(error, KeyboardInterrupt):
        os._exit(128 + signal.SIGINT)
    if jn.current is not None:
        with contextlib.suppress(OSError, ValueError):
            jn.current.raised(error)
    os._exit(ESCAPED_STATUS)


def copy_log(log_path: Path, out: Path, name: str) -> Path | None:
    """A copy of what the target printed in this run, as ``out/<name>.log``, before the next run
    truncates the log; None if it printed nothing."""
    try:
        if os.path.getsize(log_path) == 0:
            return None
        kept = Path(out) / f"{name}.log"
        shutil.copyfile(log_path, kept)
        return kept
    except OSError:
        return None


# ---- single executions ---------------------------------------------------------------------
