"""The journal: what a worker is running, on disk before it runs, so that a death loses nothing.

A worker process writes the current run's header (configuration, seed, allocator) before
it builds the target, a mark once the target is built, each operation before it is
applied, and a mark before the final drain. When the worker dies (a signal, ``os._exit``)
or stops making progress (a hang), the parent reads the journal back as a trace up to the
operation that killed it, and judges the death as a find of its own
(``kvprop.search.supervisor``). The file's modification time is the worker's heartbeat
(``supervisor.age``): every operation writes a line.

Lines are plain text to cost a few microseconds an operation: ``run <json: the walk's index
and the trace format's header>``, ``built``, ``op <Name> <arg> <arg> ...``, ``drain``, and
``raised <json: exception type and message>`` when a target's own ``BaseException`` subclass
(as ``asyncio.CancelledError`` is) escapes and ends the worker.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from kvprop.search.trace import Trace

PHASES = ("build", "operation", "drain")

current: Journal | None = None  # the worker's journal: a worker writes one


class Journal:
    """The worker's side: one file, rewritten from the start at every run."""

    def __init__(self, path: Path):
        global current
        self.path = Path(path)
        self.file = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 - lives as long as the worker
        current = self

    def begin(self, trace: Trace, index: int | None = None) -> None:
        """A new run: ``trace`` (its steps and failure left out) says what it runs, in the trace
        format; ``index`` is the walk's index in its worker."""
        import attrs

        from kvprop.search.trace import to_dict  # imported here: a coverage worker imports the specs later

        header = {"index": index, "trace": to_dict(attrs.evolve(trace, steps=(), failure=None))}
        # written over the last run, then cut to length: the file is never empty once a run has
        # begun, which the supervisor would read as a worker that never started (supervisor.begun)
        self.file.seek(0)
        self.file.write(f"run {json.dumps(header)}\n")
        self.file.truncate()
        self.file.flush()

    def built(self) -> None:
        self.file.write("built\n")
        self.file.flush()

    def operation(self, op) -> None:
        self.file.write(f"op {type(op).__name__} {' '.join(map(str, attrs.astuple(op)))}\n")
        self.file.flush()

    def drain(self) -> None:
        self.file.write("drain\n")
        self.file.flush()

    def raised(self, error: BaseException) -> None:
        """The exception that is about to end the worker, for the parent's judgement to name."""
        self.file.write(f"raised {json.dumps([type(error).__name__, str(error)[:500]])}\n")
        self.file.flush()

    def beat(self) -> None:
        """Progress inside one operation (each engine step of the drain): the heartbeat only."""
        os.utime(self.file.fileno())


@attrs.frozen
class Journalled:
    """A run read back: the trace up to the operation it was in, where it was, and its walk index."""

    trace: Trace
    phase: str  # one of PHASES
    index: int | None
    raised: tuple[str, str] | None = None  # (type, message) of what ended the worker, if it said

    @property
    def step(self) -> int:
        """The failure step the death stands at: the last operation begun, or the drain."""
        if self.phase == "operation":
            return len(self.trace.steps) - 1
        return len(self.trace.steps)


def building(path: Path) -> bool:
    """Whether the run a journal describes is still building its target (its header written,
    nothing after it): read while the worker writes, so it parses no more than the line words."""
    try:
        lines = Path(path).read_bytes().split(b"\n")
    except OSError:
        return False
    return (
        bool(lines)
        and lines[0].startswith(b"run ")
        and not any(line.split(b" ", 1)[0] in (b"built", b"op", b"drain") for line in lines[1:])
    )


def read(path: Path) -> Journalled | None:
    """The run a journal describes, or None if the worker died before it began one."""
    from kvprop.search.alphabet import OPERATION_BY_NAME
    from kvprop.search.trace import from_dict

    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    if not lines or not lines[0].startswith("run "):
        return None
    try:
        header = json.loads(lines[0][4:])
    except ValueError:
        return None
    phase, steps, raised = "build", [], None  # type: tuple[str, list, tuple[str, str] | None]
    for line in lines[1:]:
        word, _, rest = line.partition(" ")
        if word == "raised":
            with contextlib.suppress(ValueError, TypeError):
                name, message = json.loads(rest)
                raised = (str(name), str(message))
        elif word == "built":
            phase = "built"
        elif word == "op":
            name, *args = rest.split()
            steps.append({"op": name, **dict(zip(OPERATION_BY_NAME[name].ARGS, map(int, args), strict=True))})
            phase = "operation"
        elif word == "drain":
            phase = "drain"
    if phase == "built":  # built, then died before the first operation: nothing ran but the drain would
        phase = "drain"
    return Journalled(from_dict({**header["trace"], "steps": steps}), phase, header["index"], raised)
