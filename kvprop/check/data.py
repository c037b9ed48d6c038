"""The data the blocks hold (invariant 7): every computed position and every cached block reads
back the fingerprint it must, and the null block is never written.

A full sweep (``check_data``) reads every such slot; the incremental check
(``check_recent_data``) reads what the step wrote, what its block copies filled and the
cached blocks that changed. The fingerprint each slot must hold comes from the engine's
records (a request's prefix; the prefix each block hash it has seen names); a mismatch is
reported once, for the first slot, with how many are wrong.
"""

from __future__ import annotations

from kvprop.allocator.hashing import fingerprint, state_fingerprint
from kvprop.allocator.specs import Mamba, cdiv
from kvprop.check.invariants import extra_keys, further_keys
from kvprop.errors import Violation
from kvprop.sim.memory import UNWRITTEN
from kvprop.sim.request import Status


def check_data(engine, view, tables, keys, memo: dict) -> None:
    """Every computed position of a running request reads back its fingerprint; every cached
    block holds the data of the prefix its hash names; the null block is never written."""
    slots: list[int] = []
    expected: list[int] = []
    origin = Origins()
    _expect_computed(engine, view, lambda rid, g: tables[(rid, g)], slots, expected, origin)
    cached = [(b, k) for b, k in enumerate(keys) if k is not None]
    cached += [(b, k) for b, extra in extra_keys(view).items() for k in extra]
    _expect_cached_and_null(engine, view, cached, slots, expected, origin, memo)
    report_mismatch(engine.memory, slots, expected, origin)


def check_recent_data(engine, view, changed_cached, memo: dict, copies: bool = True) -> None:
    """7, incrementally: every write since the last check reads back (two writers of one
    slot in a step cannot both), every position a block copy filled holds what the request
    computing there expects (``copies``; a full sweep's ``check_data`` judges those with every
    other position), every block that changed and is cached holds its hash's data, and the
    null block is unwritten."""
    bs, memory = view.block_size, engine.memory
    slots, expected, copied = memory.take_recent_writes()
    if not slots and not changed_cached and not copied:
        return
    changed_cached = [*changed_cached, *((b, k) for b, _ in changed_cached for k in further_keys(view, b))]
    origin = Origins()
    origin.run(len(slots), lambda j: ("a write this step", -1, slots[j] % bs, slots[j] // bs))
    # the writes alone first, as a full sweep judges them (kvprop.check.checker.check_full): a
    # finding in them reads the same whichever check made it
    report_mismatch(memory, slots, expected, origin)
    if copied and copies:

        def table_of(rid, g):
            return view.request_block_ids(g, rid) or ()

        _expect_computed(engine, view, table_of, slots, expected, origin, only=set(copied))
    _expect_cached_and_null(engine, view, changed_cached, slots, expected, origin, memo)
    report_mismatch(memory, slots, expected, origin)


def _expect_computed(engine, view, table_of, slots, expected, origin, only: set | None = None) -> None:
    """Add the fingerprint of every position a running request has computed, through its
    table ``table_of(request id, group)`` (in a state group: the running state, after exactly
    those tokens). ``only``: just these slots, the positions a block copy filled. A copy brings
    whatever its source held, so the value it wrote proves nothing: it must read back as the
    request computing there expects (a copy that ran before its source was computed, vLLM
    0.33.0; docs/findings.md)."""
    bs, null = view.block_size, view.null_block_id
    blocks = None if only is None else {slot // bs for slot in only}
    pending = engine.pending_blocks()  # a batch in flight writes them: a hit on one is read after it
    for rid, request in engine.requests.items():
        if request.status not in (Status.RUNNING, Status.LOADED):
            continue
        computed, prefix = request.num_settled_tokens, request.prefix  # a batch in flight writes the rest
        for g, spec in enumerate(engine.specs):
            table = table_of(rid, g)
            if isinstance(spec, Mamba):
                if computed > 0:  # the running state: after exactly the computed tokens
                    block_id = engine.state_block(request, g)
                    if only is None and block_id not in table:
                        raise Violation(
                            "state-not-held",
                            f"{rid!r} state group {g} keeps its state after {computed} tokens in block "
                            f"{block_id}, which its table no longer holds",
                            blocks=[block_id],
                            requests=[rid],
                            groups=[g],
                        )
                    if only is None or block_id * bs in only:
                        slots.append(block_id * bs)
                        expected.append(state_fingerprint(g, computed, prefix[computed - 1]))
                        origin.append((rid, g, computed, block_id))
                continue
            for index in range(cdiv(computed, bs)):
                block_id = table[index]
                if block_id == null or block_id in pending or (blocks is not None and block_id not in blocks):
                    continue
                for p in range(index * bs, min(computed, (index + 1) * bs)):
                    slot = block_id * bs + p % bs
                    if only is None or slot in only:
                        slots.append(slot)
                        expected.append(fingerprint(g, p, prefix[p]))
                        origin.append((rid, g, p, block_id))


def expected_cached_row(engine, key, memo: dict):
    """(first position, fingerprints) a block cached under ``key`` must hold, if the hash is known
    (the engine records what every block hash it has seen names)."""
    row = memo.get(key)
    if row is None:
        known = engine.registry.get(key[0])
        if known is None:
            return None
        index, prefix = known
        start = index * engine.block_size
        if isinstance(engine.specs[key[1]], Mamba):  # the state after the block's last token, in slot 0
            row = memo[key] = (start, [state_fingerprint(key[1], start + len(prefix), prefix[-1])])
        else:
            row = memo[key] = (start, [fingerprint(key[1], start + j, h) for j, h in enumerate(prefix)])
    return row


def _expect_cached_and_null(engine, view, cached, slots, expected, origin, memo) -> None:
    """Add what each (block, key) in ``cached`` must hold (its hash's prefix data, where the
    hash is known) and what the null block must hold (nothing ever written)."""
    bs, null = view.block_size, view.null_block_id
    pending = engine.pending_blocks()
    for block_id, key in cached:
        rows = expected_cached_row(engine, key, memo)
        if rows is None or block_id in pending:
            continue  # unknown, or a batch in flight still writes it (judged once it is back)
        start, row = rows
        slots.extend(range(block_id * bs, block_id * bs + len(row)))
        expected.extend(row)
        origin.run(len(row), lambda j, k=key, p=start, b=block_id: (f"cached{k}", k[1], p + j, b))
    slots.extend(range(null * bs, null * bs + bs))
    expected.extend([UNWRITTEN] * bs)
    origin.run(bs, lambda j: ("null block", -1, j, null))


class Origins:
    """What each expected slot is ((who, group, position, block)), kept as runs and spelled
    out only when a report needs one: most checks find nothing wrong."""

    def __init__(self) -> None:
        self.runs: list = []  # (length, function of the offset in the run)

    def append(self, entry: tuple) -> None:
        self.runs.append((1, lambda j, entry=entry: entry))

    def run(self, length: int, at) -> None:
        self.runs.append((length, at))

    def __getitem__(self, i: int) -> tuple:
        for length, at in self.runs:
            if i < length:
                return at(i)
            i -= length
        raise IndexError(i)


def report_mismatch(memory, slots, expected, origin) -> None:
    bad = memory.mismatches(slots, expected)
    if bad:
        who, g, p, block_id = origin[bad[0]]
        got = memory.read([slots[bad[0]]])[0]
        raise Violation(
            "data-mismatch",
            f"{who} group {g} position {p} in block {block_id} reads {got}, expected "
            f"{expected[bad[0]]} ({len(bad)} positions wrong)",
            blocks=sorted({origin[i][3] for i in bad}),
            requests=[who] if isinstance(who, str) else [],
            groups=[g] if g >= 0 else [],
        )
