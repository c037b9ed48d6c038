"""What a campaign's workers have reported so far: progress adds up, finds are kept by
(run number, worker) so that the reported one does not depend on timing, and triaged finds are
counted by signature (``kvprop.search.signature``), distinct findings apart from traces.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import attrs

from kvprop.search import trace as tr
from kvprop.search.signature import signature_of
from kvprop.search.trace import Trace
from kvprop.sim.events import EVENTS


@attrs.define
class Tally:
    """What the workers have reported: progress adds up; finds are kept by (run number, worker)."""

    on_find: Callable[[Trace, str | None], None] | None = None  # each find as it is taken, with its log
    reachable: tuple = EVENTS  # the engine events the target can reach (kvprop.targets.protocol)
    runs: int = 0
    steps: int = 0
    events: set = attrs.field(factory=set)
    refused: Counter = attrs.field(factory=Counter)
    depths: Counter = attrs.field(factory=Counter)  # built configurations by pipeline depth -> runs
    finds: dict = attrs.field(factory=dict)  # (index, worker) -> Trace
    known: Counter = attrs.field(factory=Counter)  # triaged finds by signature key; they do not end the search
    found_at: float | None = None
    crash: str | None = None
    unusable: str | None = None
    target_error: str | None = None
    exited: set = attrs.field(factory=set)  # workers that said they end (the others died, if they ended)

    @property
    def found(self) -> bool:
        return bool(self.finds)

    @property
    def best(self) -> tuple:
        return min(self.finds)

    def found_trace(self) -> Trace | None:
        return self.finds[self.best] if self.finds else None

    def take(self, trace: Trace, elapsed: float, where: tuple = (-1, -1), log: str | None = None) -> None:
        self.finds[where] = trace
        if self.found_at is None:
            self.found_at = elapsed
        if self.on_find is not None:
            self.on_find(trace, log)

    def known_find(self, trace: Trace, log: str | None) -> None:
        assert trace.failure is not None  # a find is a trace with its failure
        self.known[signature_of(trace).key] += 1
        if self.on_find is not None:
            self.on_find(trace, log)

    def absorb(self, msg, elapsed: float) -> None:
        """Fold in one worker message."""
        if msg[0] == "progress":
            self.runs, self.steps = self.runs + msg[1], self.steps + msg[2]
            self.events |= msg[3]
            self.refused.update(msg[4])
            self.depths.update(msg[5])
        elif msg[0] == "failure":
            self.take(tr.from_dict(msg[3]), elapsed, (msg[1], msg[2]), msg[4])
        elif msg[0] == "known":
            self.known_find(tr.from_dict(msg[1]), msg[2])
        elif msg[0] == "exit":
            self.exited.add(msg[1])
        elif msg[0] == "target-error":
            self.target_error = self.target_error or msg[1]
        elif msg[0] == "crash":
            self.crash = self.crash or msg[1]
        elif msg[0] == "unusable":
            self.unusable = self.unusable or msg[1]

    def status_line(self, elapsed: float) -> str:
        rate = self.steps / elapsed if elapsed > 0 else 0.0
        refused = f" | refused {sum(self.refused.values()):,}" if self.refused else ""
        known = f" | known {sum(self.known.values()):,} ({len(self.known)} distinct)" if self.known else ""
        return (
            f"[{elapsed:7.1f}s] runs {self.runs:,} | steps {self.steps:,} | {rate:,.0f} steps/s | "
            f"failures {len(self.finds)}{known} | events {len(self.events & set(self.reachable))}/{len(self.reachable)}"
            f"{refused}{depth_counts(self.depths)}"
        )


def depth_counts(depths) -> str:
    """The built runs by batches in flight, as the progress line shows them: `` | in flight
    1/2/3: 812/9/19`` (nothing until a run was built)."""
    if not depths:
        return ""
    top = max(3, *depths)
    names = "/".join(str(d) for d in range(1, top + 1))
    return f" | in flight {names}: " + "/".join(f"{depths.get(d, 0):,}" for d in range(1, top + 1))
