"""What one engine step did, as the scheduler reports it to the checks and the drivers."""

from __future__ import annotations

import attrs


@attrs.define
class StepReport:
    """What one step did: tokens scheduled per request, admissions, preemptions, ends, block copies."""

    scheduled: dict = attrs.field(factory=dict)
    admitted: list = attrs.field(factory=list)
    preempted: list = attrs.field(factory=list)
    finished: list = attrs.field(factory=list)
    copies: list = attrs.field(factory=list)  # (source block, copy) pairs the worker copies first
