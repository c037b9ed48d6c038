"""The invariants, and every violation kind with the invariant it belongs to and the sentence it breaks.

One registry, so neither an invariant nor a kind can be worded two ways: each kind is raised by
exactly one function in ``kvprop.check`` (a test walks the code to hold that), the lists in
``docs/design.md`` §4 are generated from ``INVARIANTS`` and ``KINDS`` (``kvprop facts``), and
the prose there says why each sentence holds for a correct allocator.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class Invariant:
    number: int
    statement: str


INVARIANTS = {
    i.number: i
    for i in (
        Invariant(1, "a block's reference count equals its table entries, queued copies and deferred frees"),
        Invariant(2, "the free queue holds exactly the unreferenced blocks, with consistent links and count"),
        Invariant(3, "a live block belongs to one group, once per table, shared only while cached"),
        Invariant(4, "the cache map and block keys agree both ways; the null block is never cached"),
        Invariant(5, "blocks in use + free + the null block = all blocks"),
        Invariant(
            6,
            "tables fit their request's tokens, skip only what the window skips, and their cached prefix "
            "carries the request's own hashes, counted in full",
        ),
        Invariant(
            7,
            "every computed position and cached block reads back its fingerprint; writes and loads go only "
            "to blocks their request owns alone",
        ),
        Invariant(8, "a refused allocation changes nothing but the blocks its window skipping freed"),
        Invariant(9, "with arrivals stopped, every request ends and every block returns"),
        Invariant(
            10,
            "allocations are granted when they surely fit and refused when they surely do not; cache hits "
            "are exactly as long as the cache map allows",
        ),
        Invariant(11, "malformed calls a target's contract refuses are refused and change nothing"),
        Invariant(12, "a freed request leaves nothing behind; the null block is never queued or cached"),
        Invariant(13, "replaying the KV cache events (when enabled) reproduces the cache map's keys"),
        Invariant(14, "an allocation only appends to a table or nulls the entries it skips"),
        Invariant(
            15,
            "a request proceeds only once every load it waits for has landed, or failed and been handled; "
            "an asynchronous load is admitted only with room left for every load in flight",
        ),
        Invariant(
            16,
            "no block is written while a save to the external tier still reads it; the tier offers only what "
            "a completed save delivered",
        ),
        Invariant(
            17,
            "a router replaying the KV cache events (when enabled) as a set of (hash, medium) keys holds exactly "
            "what each medium holds",
        ),
        Invariant(
            18,
            "a request's output is what the synchronous scheduler produces: every token is the model's "
            "continuation of the tokens before it, whatever batches were in flight",
        ),
    )
}


@attrs.frozen
class Kind:
    name: str
    invariant: int
    sentence: str


KINDS = {
    k.name: k
    for k in (
        Kind("ref-cnt-mismatch", 1, "a block's ref_cnt equals the number of table entries holding it"),
        Kind("negative-ref-cnt", 1, "no block's ref_cnt is negative"),
        Kind("free-queue-membership", 2, "a block is in the free queue exactly when its ref_cnt is 0"),
        Kind("free-queue-links", 2, "the free queue's links agree forwards and backwards"),
        Kind("free-queue-repeat", 2, "no block appears twice in the free queue"),
        Kind("free-count", 2, "the free count equals the blocks linked into the free queue"),
        Kind("null-block-free", 2, "the null block is never in the free queue"),
        Kind("null-block-count", 2, "the null block's reference count stays 0 (where the target declares it)"),
        Kind("block-in-two-groups", 3, "a live block belongs to one group"),
        Kind("duplicate-in-table", 3, "no table holds a block twice"),
        Kind("shared-uncached-block", 3, "only cached blocks are shared between tables"),
        Kind("null-block-cached", 4, "the null block is never cached"),
        Kind("cache-map-missing", 4, "a block that says it is cached is in the cache map under its key"),
        Kind("cache-map-stale", 4, "the cache map holds a block only under the key the block carries"),
        Kind("cache-key-group", 4, "a cache key names one of the allocator's groups"),
        Kind("conservation", 5, "blocks in use + free + the null block = all blocks"),
        Kind("table-without-admission", 6, "only admitted requests have tables"),
        Kind("admitted-without-table", 6, "every admitted request has a table and a cached count in every group"),
        Kind("table-length", 6, "a table covers the computed tokens and no more than the request can use"),
        Kind("null-in-attended-range", 6, "the null block stands only where the attention type skips"),
        Kind("cached-count", 6, "a request's cached-block count fits its table and its full blocks"),
        Kind("cached-block-lost-hash", 6, "a block counted as cached carries the request's own hash"),
        Kind("cached-count-behind", 6, "caching resumes at a block not yet cached under the request's own hash"),
        Kind("table-too-short", 6, "a table has a block for every position being computed"),
        Kind("data-mismatch", 7, "every computed position and cached block reads back its fingerprint"),
        Kind("write-to-null-block", 7, "nothing is computed into the null block"),
        Kind("write-to-shared-block", 7, "a block being computed into is the writer's alone (or its own cached block)"),
        Kind("state-write-unowned", 7, "a state group writes its next state into a block the request owns alone"),
        Kind("state-source-mismatch", 7, "a state group continues from its own state after the computed tokens"),
        Kind("state-not-held", 7, "the block holding a state group's running state is in the request's table"),
        Kind("connector-handoff", 7, "blocks handed to the connector are exclusively owned and uncached"),
        Kind("connector-write-unowned", 7, "a completing load writes only blocks its request still owns alone"),
        Kind("refusal-changed-table", 8, "a refused allocation leaves the request's tables as they were"),
        Kind("refusal-changed-ref-cnt", 8, "a refused allocation moves no ref_cnt but the skipped blocks it freed"),
        Kind("refusal-changed-cache", 8, "a refused allocation changes no cache key"),
        Kind("refusal-changed-queue", 8, "a refused allocation neither reorders nor takes from the free queue"),
        Kind("refusal-changed-state", 8, "a refused allocation changes no block but the skipped blocks it freed"),
        Kind("liveness", 9, "with arrivals stopped, every request ends and every block returns"),
        Kind("spurious-refusal", 10, "an allocation that fits under every count of the pool is granted"),
        Kind("accepted-beyond-capacity", 10, "an allocation that fits under no count of the pool is refused"),
        Kind("hit-too-short", 10, "a cache hit is as long as the cache map allows"),
        Kind("hit-too-long", 10, "a cache hit covers only what the cache map holds"),
        Kind("misuse-accepted", 11, "a malformed call the target's contract refuses is refused"),
        Kind("misuse-changed-state", 11, "a refused malformed call changes nothing"),
        Kind("freed-request-remains", 12, "a freed request leaves no table, cached count or pending load"),
        Kind("events-diverge", 13, "replaying the KV cache events reproduces the cache map's keys"),
        Kind("events-unknown-removal", 13, "a removed event names a key the replayed events hold"),
        Kind("events-reannounce-unheld", 13, "a hit's block announced again names a key the replayed events hold"),
        Kind("table-rewritten", 14, "an allocation only appends to a table or nulls entries it skips"),
        Kind(
            "proceeds-before-load",
            15,
            "a request proceeds only once its loads have landed, or failed with the failure handled",
        ),
        Kind(
            "load-room-short",
            15,
            "an asynchronous load leaves free what every other load in flight still needs to finish",
        ),
        Kind(
            "write-during-save",
            16,
            "a block is computed, copied or loaded into only once every save reading it has read it",
        ),
        Kind(
            "tier-offers-unsaved",
            16,
            "every block the tier offers holds its fingerprints: a save that completed delivered it",
        ),
        Kind(
            "router-advertises-absent",
            17,
            "every key a router replaying the events as a set holds on a medium is a hit there",
        ),
        Kind(
            "router-forgets-resident",
            17,
            "every key a medium holds, and announces, is one a router replaying the events as a set holds",
        ),
        Kind(
            "output-not-continuation",
            18,
            "every token a request's output holds is the model's continuation of the tokens before it",
        ),
        Kind(
            "sglang-pool-conservation",
            5,
            "in each SGLang pool, available + evictable + protected + what live requests hold uncached = its size",
        ),
        Kind(
            "sglang-running-totals",
            5,
            "an SGLang tree's evictable and protected totals equal its unlocked and locked nodes' sizes",
        ),
        Kind("sglang-lock-ref", 1, "an SGLang tree node's lock_ref equals the live requests locked at or below it"),
        Kind(
            "sglang-slot-held-twice",
            3,
            "no SGLang KV slot is in two of: tree nodes, live requests' own rows, the free list",
        ),
        Kind(
            "sglang-kv-data",
            7,
            "an SGLang forward pass reads back, in every layer, the KV its request's own tokens computed",
        ),
        Kind(
            "sglang-cached-kv-data",
            7,
            "an SGLang tree node's KV slots hold what the tokens of its path computed",
        ),
        Kind(
            "sglang-idle-leak",
            9,
            "with every request ended, SGLang's own idle checks pass and every request row is free",
        ),
    )
}
