"""Everything that judges: the violation kinds, the invariants, the decision oracles, the
incremental mirror, the checker.

Verified, for every target, through its view and the engine's own records
(``kinds.KINDS`` lists each kind with its invariant; ``docs/design.md`` says why each holds):

1. reference counts equal the table entries holding each block;
2. the free queue holds exactly the unreferenced blocks, with consistent links and count;
3. a live block belongs to one group, once per table, shared only while cached;
4. the cache map and block keys agree both ways; the null block is never cached;
5. blocks in use + free + the null block = all blocks;
6. tables fit their request's tokens, skip only what the window skips, and their cached
   prefix carries the request's own hashes, counted in full;
7. every computed position and cached block reads back its fingerprint; writes and loads
   go only to blocks their request owns alone;
8. a refused allocation changes nothing but the blocks its window skipping freed;
9. with arrivals stopped every request ends;
10. allocations are granted when they surely fit and refused when they surely do not;
    cache hits are exactly as long as the cache map allows;
11. malformed calls a target's contract refuses are refused and change nothing;
12. a freed request leaves nothing behind; the null block is never queued or cached;
13. replaying the KV cache events (when enabled) reproduces the cache map's keys.

Not verified (details in ``docs/design.md``, "What is not checked"): decisions between the
two capacity bounds, eviction order, calls outside a target's caller contract, a
target's per-request state beyond its tables and cached counts, scheduler-level
accounting of loads in flight, and the model's unmodelled shapes (state-space groups'
drafts, checkpoints and partial hits, speculative decoding, the newer vLLM features
docs/design.md §6 lists).

May import ``kvprop.allocator``, ``kvprop.sim`` and ``kvprop.errors``.
"""
