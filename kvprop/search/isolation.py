"""Each run of a target in a fresh process: a fork of a worker that has imported it and run nothing.

A target that keeps state between runs in its own process (a module global, a cache, a file
descriptor it closed) can fail a run only because of the runs before it; found in a reused
worker, such a find passed on replay in a fresh one. As AFL's fork server does, a worker that
drives a target other than kvprop's own imports it once and forks a child for every run (a walk,
a replay, a minimising candidate): each run starts from the state a fresh process would have
after the import, so its verdict replays. kvprop's own allocator keeps no state outside the
objects a run builds, and its runs stay in the worker, where they are several times faster.

The child's death is the worker's: the worker dies the same way (signal, exit status), and the
parent judges it from the journal the child wrote, as for any worker (``kvprop.search.supervisor``).
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import select
import signal
import struct
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

T = TypeVar("T")
HEADER = struct.Struct("<Q")  # the answer's length, before it


def isolates(target: str | None) -> bool:
    """Whether runs on ``target`` each run in a fresh fork (every target but kvprop's own)."""
    return target not in (None, "kvprop")


def in_fresh_fork(run: Callable[[], T]) -> T:
    """``run()`` in a forked child of this process: its result, or the exception it raised
    (an ``Exception``: kvprop's or a refusal, re-raised here). A child that dies without an
    answer (a signal, an exit, a ``BaseException`` escaping target code, which the child ends
    on as the worker would: ``worker_setup.escaped``) ends this process the same way."""
    readable, writable = os.pipe()
    gc.freeze()  # what the worker holds stays out of the child's collections: fewer pages copied on write
    pid = os.fork()
    if pid == 0:
        os.close(readable)
        _child(run, writable)
    os.close(writable)
    try:
        data, status = _answer(readable, pid)
    finally:
        os.close(readable)
    if data is None:
        _die_as(status)
    kind, value = pickle.loads(data)
    if kind == "raised":
        raise value
    return value


def _answer(readable: int, pid: int) -> tuple[bytes | None, int]:
    """(the child's whole answer or None, its wait status). The answer is read as it comes (it
    may not fit the pipe's buffer) until its stated length, or until the child has ended: a
    process the target forked may hold the pipe open long after, so its end is no sign."""
    buffer, status, eof = b"", None, False
    while True:
        ready: list = []
        if eof:
            time.sleep(0.01)  # the child closed its end and is ending
        else:
            ready, _, _ = select.select([readable], [], [], 0.05)
            if ready:
                chunk = os.read(readable, 1 << 16)
                buffer, eof = buffer + chunk, not chunk
        if len(buffer) >= HEADER.size:
            (need,) = HEADER.unpack_from(buffer)
            if len(buffer) >= HEADER.size + need:
                if status is None:
                    _, status = os.waitpid(pid, 0)
                return buffer[HEADER.size : HEADER.size + need], status
        if status is not None and (eof or not ready):  # it had ended, and nothing more came since
            return None, status
        if status is None:
            done, waited = os.waitpid(pid, os.WNOHANG)
            status = waited if done else None  # read once more before judging: it may have just written


def _child(run: Callable[[], Any], writable: int) -> None:
    from kvprop.search.worker_setup import escaped

    try:
        try:
            answer: tuple = ("ok", run())
        except Exception as e:  # noqa: BLE001 - kvprop's error or a refusal: the worker handles it as its own
            answer = ("raised", _portable(e))
        data = pickle.dumps(answer)
        with os.fdopen(writable, "wb") as out:
            out.write(HEADER.pack(len(data)) + data)
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException as e:  # noqa: BLE001 - escaped target code: the child ends as the worker would
        escaped(e)
    os._exit(0)


def _portable(error: Exception) -> Exception:
    """``error`` as it crosses the pipe: itself when it pickles, else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any failure to pickle: keep the text
        import traceback

        return RuntimeError(f"{type(error).__name__}: {error}\n{''.join(traceback.format_exception(error))}")


def _die_as(status: int) -> NoReturn:
    """End this process as the child ended (no answer came): by its signal, or its exit status."""
    sys.stdout.flush()
    sys.stderr.flush()
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        with contextlib.suppress(OSError, ValueError):
            signal.signal(number, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [number])
            os.kill(os.getpid(), number)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)
