"""Oracles for the engine's own decisions about external loads: when a request waiting for a
load may proceed, and how many blocks an asynchronous load's admission leaves for the loads
already in flight.

The allocator's decisions are judged in ``kvprop.check.decisions``; these judge the scheduler's
(``kvprop.sim.scheduler``), against the ground truth the connector keeps (``Connector.pending``:
the loads still in flight) and the pool as the view reports it, never against the scheduler's
own bookkeeping. A wrong decision here leaves every block's state consistent for a while: a
request that runs on a load still in flight, or on a failed one, corrupts data only where a
later read happens to look, and a load admitted without room for the others deadlocks only
when the pool fills; these name the decision itself.

The rules are vLLM 0.34.0's (``vllm/v1/core/sched/scheduler.py``), stated no stricter than it:

* A request in ``WAITING_FOR_REMOTE_KVS`` is scheduled only once its id is in
  ``finished_recving_kv_req_ids`` (``_handle_blocked_waiting_request``), that is, once its load
  has landed or failed; a failed load is handled first (``_update_waiting_for_remote_kv``): the
  request keeps only the tokens computed before the load (``_update_requests_with_invalid_blocks``
  resets its count) or frees its blocks and starts again.
* An asynchronous load is admitted with ``reserved_blocks`` kept back: the blocks every
  in-flight prefill and parked load still needs to finish
  (``_inflight_prefill_reserved_blocks``, summed over all of them). Judged from below: each
  other load in flight still needs at least the full-attention blocks its whole sequence lacks
  (vLLM's ``_request_remaining_blocks``; windows and state groups may need fewer, so they count
  for nothing here); an admission that leaves fewer blocks free than that sum left some load
  without its room.
"""

from __future__ import annotations

from kvprop.allocator.specs import FullAttention, cdiv
from kvprop.errors import Violation
from kvprop.sim.request import Status

WAITING_ON_LOADS = (Status.LOADING, Status.LOADED)  # a load in flight, or landed and not yet continued


def proceeds_before_load(request_id: str, why: str) -> Violation:
    """The one wording of ``proceeds-before-load``: ``request_id`` proceeds, ``why`` it may not."""
    return Violation("proceeds-before-load", f"{request_id!r} {why}", requests=[request_id])


def load_resolved(request, ok: bool, num_local: int) -> None:
    """15. A failed load is handled before its request may proceed: a request made ready to
    continue (landed, or running) after its load failed counts no token the load was to bring."""
    ready = request.status in (Status.LOADED, Status.RUNNING)
    if not ok and ready and request.num_computed_tokens > num_local:
        raise proceeds_before_load(
            request.request_id,
            f"is {request.status.value} with {request.num_computed_tokens} tokens computed after its load "
            f"failed; only {num_local} were computed before the load",
        )


def scheduled_after_loads(engine, scheduled, failed_loads: dict) -> None:
    """15. A request is scheduled only when no load of it is in flight, and, when its load
    failed and it kept its blocks, with no more tokens computed than it had before the load
    (``failed_loads``: request id -> tokens computed before a failed load, for requests not
    freed since)."""
    pending = engine.connector.pending if engine.connector is not None else {}
    for rid in scheduled:
        if rid in pending:
            raise proceeds_before_load(rid, "is scheduled while its load is still in flight")
        computed = engine.requests[rid].num_computed_tokens
        if rid in failed_loads and computed > failed_loads[rid]:
            raise proceeds_before_load(
                rid,
                f"is scheduled with {computed} tokens computed after its load failed; "
                f"only {failed_loads[rid]} were computed before the load",
            )


def least_to_finish(engine, request) -> int:
    """At least the blocks ``request`` still takes to hold its whole sequence: in each
    full-attention group, the blocks its table lacks for ``num_tokens`` tokens."""
    view, rid = engine.view, request.request_id
    need = 0
    for g, spec in enumerate(engine.specs):
        if isinstance(spec, FullAttention):
            table = view.request_block_ids(g, rid) or []
            need += max(0, cdiv(request.num_tokens, spec.block_size) - len(table))
    return need


def load_room(engine, request) -> None:
    """15. An asynchronous load, once allocated, leaves free at least what every other load in
    flight still takes to finish (an aborted one, whose blocks go back when it resolves, aside)."""
    others = [r for r in engine.requests.values() if r is not request and r.status in WAITING_ON_LOADS]
    needs = {r.request_id: least_to_finish(engine, r) for r in others}
    free = engine.view.num_free_blocks
    if free < sum(needs.values()):
        raise Violation(
            "load-room-short",
            f"the asynchronous load of {request.request_id!r} was admitted leaving {free} blocks free; "
            f"the loads in flight still need at least {sum(needs.values())} to finish ({needs})",
            requests=[request.request_id, *needs],
        )
