"""What a stalled request waits for: the drain's liveness find named by its mechanism.

One kind, ``liveness``, holds several bugs: a request that keeps waiting on a load of its KV, one
preempted again and again, one that never gets room to be admitted, one admitted but never
scheduled, one that computes but never finishes. A campaign triages finds by signature, so a
known liveness bug listed by its kind alone would hide every new one. The drain watches what
each live request does in its last steps (``StallWatch``) and names the cause in the find's
signature (``liveness:load@drain``), read from what every engine reports: the tokens a step
schedules, its preemptions, and the requests loading after it.

The causes, the first that applies to a request, over the drain's last steps (between one and
two windows of a quarter of its bound):

- ``load``: loading after two steps or more, though the drain completes every load before each
  step: its KV is loaded again and again, or a completed load is never taken up;
- ``preemption``: preempted twice or more: admitted and put back again and again;
- ``admission``: scheduled nothing and not running: it waits for room to be admitted;
- ``schedule``: scheduled nothing though running: admitted, then starved;
- ``progress``: tokens were scheduled, yet it does not finish (its work is lost or repeated).

A find's cause is the sorted set of its live requests' causes joined with ``+``.
"""

from __future__ import annotations

from collections import Counter

import attrs

from kvprop.sim.request import Status


@attrs.define
class _Window:
    loads: Counter = attrs.field(factory=Counter)
    preempted: Counter = attrs.field(factory=Counter)
    scheduled: Counter = attrs.field(factory=Counter)

    def add(self, other: _Window) -> _Window:
        return _Window(self.loads + other.loads, self.preempted + other.preempted, self.scheduled + other.scheduled)


@attrs.define
class StallWatch:
    """The drain's recent steps per request, in two windows of ``span`` steps: the current one and
    the one before, so that what is judged is always the last ``span`` to ``2 * span`` steps."""

    span: int
    current: _Window = attrs.field(factory=_Window)
    previous: _Window = attrs.field(factory=_Window)
    steps: int = 0

    @classmethod
    def for_bound(cls, max_steps: int) -> StallWatch:
        return cls(max(2, max_steps // 4))

    def record(self, report, loading) -> None:
        """One engine step: its report and the requests loading after it (the drain completes
        every load before the next step)."""
        if self.steps and self.steps % self.span == 0:
            self.previous, self.current = self.current, _Window()
        self.steps += 1
        self.current.loads.update(list(loading))
        self.current.preempted.update(report.preempted)
        self.current.scheduled.update({rid: n for rid, n in report.scheduled.items() if n})

    @staticmethod
    def _cause_of(request, seen: _Window) -> str:
        rid = request.request_id
        if seen.loads[rid] >= 2:
            return "load"
        if seen.preempted[rid] >= 2:
            return "preemption"
        if not seen.scheduled[rid]:
            return "schedule" if request.status is Status.RUNNING else "admission"
        return "progress"

    def cause(self, requests) -> str:
        """What the live ``requests`` wait for, one word per mechanism, sorted."""
        seen = self.previous.add(self.current)
        return "+".join(sorted({self._cause_of(r, seen) for r in requests}))
