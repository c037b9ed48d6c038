"""What the allocator's answers leave behind: a refused allocation changes nothing but the
blocks its window skipping freed (invariant 8), and with arrivals stopped every request ends
(invariant 9), and every output token is the model's continuation of the tokens before it
(invariant 18).

A refusal is judged on a snapshot of the view taken before the call (``snapshot``,
``check_refusal``) or, incrementally, on the request's tables before and after it and the
blocks the view reports changed (``refusal_tables``, ``refusal_blocks``); liveness on the
engine's records during and after a drain.
"""

from __future__ import annotations

from collections import Counter

from kvprop.errors import Violation


def snapshot(view, request_id: str):
    return (
        view.ref_cnts(),
        view.cache_keys(),
        view.free_queue_ids(),
        [view.request_block_ids(g, request_id) for g in range(view.num_groups)],
    )


def refusal_tables(view, request_id: str, tables_before, tables_after) -> Counter:
    """8. A refused allocation leaves the request's tables as they were, but for skipped blocks
    its window freed (now the null block). Returns how often each block was freed that way."""
    freed: Counter[int] = Counter()
    for g, (old, new) in enumerate(zip(tables_before, tables_after)):
        if old is None and new is None:
            continue
        replaced = [] if old is None or new is None else [(a, b) for a, b in zip(old, new) if a != b]
        if old is None or new is None or len(old) != len(new) or any(b != view.null_block_id for _, b in replaced):
            raise Violation(
                "refusal-changed-table",
                f"a refused allocation changed {request_id!r}'s group {g} table from {old} to {new}",
                requests=[request_id],
                groups=[g],
            )
        freed.update(a for a, _ in replaced)
    return freed


def refusal_blocks(request_id: str, changed: set, freed) -> None:
    """8, incrementally: the blocks a refused allocation changed are the skipped blocks it freed."""
    stray = sorted(set(changed) - set(freed))
    if stray:
        raise Violation(
            "refusal-changed-state",
            f"a refused allocation for {request_id!r} changed blocks {stray}, which its window skipping did not free",
            blocks=stray,
            requests=[request_id],
        )


def check_refusal(view, request_id: str, before) -> None:
    """8. A refused allocation changes nothing but the skipped blocks it freed."""
    ref_before, keys_before, queue_before, tables_before = before
    ref_after, keys_after, queue_after, tables_after = snapshot(view, request_id)
    freed = refusal_tables(view, request_id, tables_before, tables_after)
    for block_id, (old, new) in enumerate(zip(ref_before, ref_after)):
        if block_id != view.null_block_id and new != old - freed.get(block_id, 0):
            raise Violation(
                "refusal-changed-ref-cnt",
                f"a refused allocation for {request_id!r} moved block {block_id}'s ref_cnt from {old} to {new}",
                blocks=[block_id],
                requests=[request_id],
            )
    if keys_before != keys_after:
        changed = [b for b, (x, y) in enumerate(zip(keys_before, keys_after)) if x != y]
        raise Violation(
            "refusal-changed-cache",
            f"a refused allocation for {request_id!r} changed cache keys",
            blocks=changed,
            requests=[request_id],
        )
    newly_free = set(queue_after) - set(queue_before)
    if [b for b in queue_after if b not in newly_free] != queue_before:
        raise Violation(
            "refusal-changed-queue",
            f"a refused allocation for {request_id!r} reordered or took from the "
            f"free queue: {queue_before} -> {queue_after}",
            requests=[request_id],
        )


# ---- 9. liveness --------------------------------------------------------------------------


def liveness(engine, steps: int | None = None, cause: str | None = None) -> None:
    """9. With arrivals stopped, every request ends: called during a drain when ``steps`` exceeded
    its bound, and after it (``steps`` None). That every block returns then follows from the
    full sweep the drain ends with: a block held by no table is a ref-cnt-mismatch. ``cause``
    is what the live requests wait for (``kvprop.check.stall``)."""
    if steps is not None or engine.requests:
        after = f"after {steps} drain steps" if steps is not None else "after the drain"
        waits = f", waiting for {cause}" if cause else ""
        raise Violation(
            "liveness",
            f"{len(engine.requests)} requests still live {after}{waits}: {sorted(engine.requests)}",
            requests=sorted(engine.requests),
            cause=cause,
        )


# ---- 18. outputs ----------------------------------------------------------------------------


def continuations(engine, checked: dict) -> None:
    """18. Every token past a live request's prompt is the one decoding its prefix produces: what
    the synchronous scheduler appends, a verification's accepted drafts included. With batches in
    flight an output can come back after its request was preempted and scheduled again; a token
    sampled from another prefix, appended there, is an output no synchronous step gives.
    ``checked`` (request id -> tokens judged) keeps each check to the tokens appended since."""
    for rid, request in engine.requests.items():
        start = max(checked.get(rid, 0), request.num_prompt_tokens)
        for i in range(start, request.num_tokens):
            if request.tokens[i] != request.token_after(i - 1):
                raise Violation(
                    "output-not-continuation",
                    f"{rid!r} holds token {request.tokens[i]} at position {i}, but decoding its first {i} tokens "
                    f"gives {request.token_after(i - 1)}",
                    requests=[rid],
                )
        checked[rid] = request.num_tokens
