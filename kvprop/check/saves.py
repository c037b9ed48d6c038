"""Oracles for saves to the external tier (invariant 16): no block is written while a save in
flight still reads it, and the tier offers only what a save (or a remote prefill) delivered.

The contract is vLLM 0.34.0's offloading connector (``distributed/kv_transfer/kv_connector/v1/
offloading/scheduler.py`` and ``worker.py``), stated no stricter than it. The connector does not
hold a finished request's blocks for its saves (``request_finished`` returns ``(False, None)``),
so a block with a save in flight may be freed and handed out again; what it may not be is
written before the save has read it: a store whose source block is allocated again, or whose
request is preempted, is flushed (``jobs_to_flush``) and the worker waits for it before the
forward pass (``handle_preemptions``). A store's keys become loadable only through
``complete_store(success=True)``; a failed store's keys are removed.

Both are judged against ground truth the engine does not decide: which blocks a save in flight
still reads is the connector's record of its jobs (``Connector.saves``, not the index of them
the flushes consult), like the loads in
flight ``kvprop.check.admission`` reads; what an offered key must hold is the fingerprints its
block hash names (the engine's registry, as the data check reads it), never the tier's own
bookkeeping. A block overwritten under a save corrupts only the tier, and shows as a wrong load
much later, if ever; a failed save's keys offered show only when a load reads them; these name
the moment itself.
"""

from __future__ import annotations

from kvprop.allocator.specs import cdiv
from kvprop.check.data import expected_cached_row
from kvprop.errors import Violation


def write_during_save(engine, block_ids, what: str, request_id: str | None = None) -> None:
    """16. Nothing is written into a block (``what``: the write) while a save in flight still
    reads it: every save reading it has read it, at its completion or by a flush."""
    connector = engine.connector
    if connector is None or not connector.saves:
        return
    unread = {entry[2]: job.job_id for job in connector.saves.values() if job.rows is None for entry in job.entries}
    read = sorted({b for b in block_ids if b in unread})
    if read:
        raise Violation(
            "write-during-save",
            f"{what} writes block(s) {read} while saves {sorted({unread[b] for b in read})} in flight still read them",
            blocks=read,
            requests=[request_id] if request_id is not None else [],
        )


def offered_blocks(engine, num_local: int, num_external: int):
    """(table index, group) of every block row an offer of ``num_external`` tokens after
    ``num_local`` brings: every block of the range in an attention group, the last one's state
    in a state group (as ``Connector.start_load`` reads them)."""
    bs = engine.block_size
    end = cdiv(num_local + num_external, bs)
    for g in range(len(engine.specs)):
        for index in range(end - 1 if g in engine.state_groups else num_local // bs, end):
            yield index, g


def offer_held(engine, request, num_local: int, num_external: int, memo: dict) -> None:
    """16. Every block the tier offers holds the fingerprints its hash names: a save that
    completed delivered it (or a remote prefill published it), never one in flight or failed."""
    connector = engine.connector
    if num_external <= 0 or connector is None:
        return
    for index, g in offered_blocks(engine, num_local, num_external):
        key = (request.block_hashes[index], g)
        named = expected_cached_row(engine, key, memo)
        if named is None:
            continue  # a hash the engine has never seen names no data
        row = connector.tier.get(key[0], {}).get(g)
        held = None if row is None else list(row[: len(named[1])])
        if held != named[1]:
            raise Violation(
                "tier-offers-unsaved",
                f"the tier offers {num_external} tokens of {request.request_id!r} after {num_local}; its block "
                f"{index} of group {g} holds {held}, not the fingerprints {named[1]} a completed save delivers",
                requests=[request.request_id],
                groups=[g],
            )
