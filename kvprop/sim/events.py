"""The engine events a search counts: what a run reached (an eviction, a preemption, a failed
load...), reported beside its verdict so that a clean run says what it exercised.

Apart from the engine so that a target's declaration and a campaign's tally name them without
importing the engine (which loads torch).
"""

from __future__ import annotations

EVENTS = (
    "cross-group hit + external tokens, hit block at free-queue head",
    "evicted a cached block",
    "preemption",
    "re-hit after preemption",
    "window skip",
    "async load failure",
    "abort during load",
    "drafts all accepted",
    "draft rejected",
    "two batches in flight",
    "three batches in flight",
    "free deferred behind a batch in flight",
)
(EV_CROSS_GROUP, EV_EVICT, EV_PREEMPT, EV_REHIT, EV_SKIP, EV_LOAD_FAIL, EV_ABORT_LOAD) = EVENTS[:7]
EV_SPEC_ACCEPT, EV_SPEC_REJECT, EV_TWO_IN_FLIGHT, EV_THREE_IN_FLIGHT, EV_DEFERRED_FREE = EVENTS[7:]
PIPELINE_EVENTS = (EV_TWO_IN_FLIGHT, EV_THREE_IN_FLIGHT)
IN_FLIGHT_ONLY = (*PIPELINE_EVENTS, EV_DEFERRED_FREE)  # reached only by a scheduler with batches in flight
