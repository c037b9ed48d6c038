"""An external KV tier keyed by block hash, as a KV connector sees it.

It is filled the two ways real tiers are: by offloading blocks once they are computed and
cached, and by a remote prefill node publishing a whole prefix. It offers tokens beyond
the local hit, and loads them into the fresh blocks the allocator hands it — at once, or
asynchronously, where the load later completes or fails.

Saves follow vLLM 0.34.0's offloading connector (``distributed/kv_transfer/kv_connector/v1/
offloading/scheduler.py`` and ``worker.py``). With connector "sync" a block's contents go to the
tier at once. With "async" each offload is a save job in flight: it reads its source blocks
when it completes, or earlier when flushed, and the tier offers its keys only once it completed
successfully (``complete_store(success=True)``); a failed save leaves no key. The blocks are
not held for it (``request_finished`` returns ``(False, None)``): a block handed out again, or
one its request gave back on preemption, has its saves flushed first (``jobs_to_flush``, which
the worker waits for before the forward pass, ``handle_preemptions``), so the save reads the
contents it was made for. A key already held or being saved is not saved again
(``prepare_store`` skips the keys its manager holds).

The tier holds ``EngineConfig.tier_blocks`` blocks (None: any number), one per (block hash, group) key, as vLLM's
CPU tier holds ``num_chunks`` (``cpu/manager.py``): a save of keys it lacks takes their room when
it starts, evicting idle keys (none being saved or read by a load in flight, none of the save's
own) by the configured policy (``kvprop.sim.tier_policy``), and is dropped whole when too few are
idle (``prepare_store`` returns None); a failed save gives its room back.

A state group's row is the state after its block's last token (slot 0 of the block). A hit
through the tier then ends on a block boundary whose state the tier holds, and a load writes
one block of the group, the one at the hit's end (vLLM's offloading connector: the total is
rounded down to the Mamba block size, ``_sliding_window_lookup(keys, 1)`` for the group, and
``allocate_external_computed_blocks`` gives it one block; docs/design.md §3).
"""

from __future__ import annotations

from collections import Counter

import attrs

from kvprop.allocator.hashing import ROOT_HASH, chain_hashes, fingerprint, prefix_hash, state_fingerprint
from kvprop.sim.memory import PagedMemory
from kvprop.sim.tier_policy import tier_policy


@attrs.define
class PendingLoad:
    request_id: str
    slots: list
    values: list
    block_ids: list  # (group, block id) pairs the load writes
    num_local: int = 0  # tokens its request had computed before the load
    keys: frozenset = frozenset()  # (block hash, group) keys it reads: the tier keeps them while it runs


@attrs.define
class PendingSave:
    """A save in flight: the (block hash, group, block id) entries it copies out, and the rows it
    read once flushed (None: it still reads its source blocks)."""

    job_id: int
    entries: list
    rows: list | None = None


class Connector:
    def __init__(
        self,
        mode: str,
        memory: PagedMemory,
        block_size: int,
        num_groups: int,
        state_groups=frozenset(),
        capacity: int | None = None,
        policy: str = "lru",
    ):
        if mode not in ("sync", "async"):
            raise ValueError(f"Connector mode must be 'sync' or 'async', got {mode!r}")
        self.capacity = capacity  # blocks, one per (block hash, group) key; None: unbounded
        self.policy = tier_policy(policy, capacity)
        self.mode = mode
        self.memory = memory
        self.block_size = block_size
        self.num_groups = num_groups
        self.state_groups = frozenset(state_groups)
        self.attention_groups = [g for g in range(num_groups) if g not in self.state_groups]
        self.tier: dict[int, dict[int, tuple]] = {}
        self.pending: dict[str, PendingLoad] = {}
        self.saves: dict[int, PendingSave] = {}  # job id -> a save in flight (connector "async")
        self.saving: set[tuple[int, int]] = set()  # (block hash, group) of every save in flight
        self.unread: Counter = Counter()  # block id -> saves in flight that still read it
        self.num_saves = 0  # saves made so far: the next one's job id

    def offload(self, entries: list[tuple[int, int, int]]) -> None:
        """Copy computed, cached blocks out: entries are (block hash, group, block id). With
        connector "async", a save job; either way only of the keys neither held nor being saved, and
        only where the tier has or makes room for them all."""
        if not entries:
            return
        fresh: dict[tuple[int, int], tuple[int, int, int]] = {}
        for entry in entries:
            key = (entry[0], entry[1])
            if key not in self.saving and entry[1] not in self.tier.get(entry[0], {}):
                fresh.setdefault(key, entry)
        if not fresh or not self._make_room(len(fresh), {(e[0], e[1]) for e in entries}):
            return
        for key in fresh:
            self.policy.insert(key)
        if self.mode == "sync":
            rows = self.memory.rows([e[2] for e in fresh.values()])
            for (block_hash, group, _), row in zip(fresh.values(), rows):
                self.tier.setdefault(block_hash, {})[group] = tuple(row)
            return
        job = PendingSave(self.num_saves, list(fresh.values()))
        self.num_saves += 1
        self.saves[job.job_id] = job
        self.saving |= fresh.keys()
        self.unread.update(entry[2] for entry in job.entries)

    def flush(self, block_ids) -> None:
        """Every save in flight that still reads one of ``block_ids`` reads all its blocks now:
        they are about to change hands, and still hold what the save was made for."""
        blocks = {b for b in block_ids if self.unread[b]}
        if blocks:
            for job in self.saves.values():
                if job.rows is None and any(entry[2] in blocks for entry in job.entries):
                    self._read(job)

    def _read(self, job: PendingSave) -> None:
        job.rows = [tuple(row) for row in self.memory.rows([entry[2] for entry in job.entries])]
        self.unread.subtract(entry[2] for entry in job.entries)
        self.unread += Counter()  # drops the blocks no save reads any more

    def finish_save(self, job_id: int, ok: bool) -> PendingSave:
        """A save completes (``ok``: its rows reached the tier) or fails (nothing reached it)."""
        job = self.saves.pop(job_id)
        if job.rows is None:
            self._read(job)
        self.saving -= {(entry[0], entry[1]) for entry in job.entries}
        self.complete_store(job, ok)
        return job

    def complete_store(self, job: PendingSave, ok: bool) -> None:
        """The tier's record of a finished save (vLLM's ``complete_store``): a landed save's keys
        are offered from now on; a failed save's destination holds nothing, and its keys are dropped."""
        if ok:
            assert job.rows is not None  # a finished save has read its blocks
            for (block_hash, group, _), row in zip(job.entries, job.rows):
                self.tier.setdefault(block_hash, {})[group] = row
            return
        for block_hash, group, _ in job.entries:
            self.policy.remove((block_hash, group))  # its room is free again

    def _held(self) -> int:
        """Blocks the tier holds or has given to a save in flight."""
        return sum(len(rows) for rows in self.tier.values()) + len(self.saving)

    def _make_room(self, n: int, protected: set) -> bool:
        """Room for ``n`` more blocks, evicting idle ones (neither saved nor loaded now, nor among
        ``protected``, the keys of the call) by the policy; False, evicting none, where too few
        are idle (vLLM's ``prepare_store`` returns None and stores nothing)."""
        if self.capacity is None:
            return True
        short = self._held() + n - self.capacity
        if short <= 0:
            return True
        reading = {key for load in self.pending.values() for key in load.keys}
        victims = self.policy.evict(
            short, lambda key: key not in protected and key not in reading and key not in self.saving
        )
        if victims is None:
            return False
        for block_hash, group in victims:
            rows = self.tier.get(block_hash, {})
            rows.pop(group, None)
            if not rows:
                self.tier.pop(block_hash, None)
        return True

    def publish_prefix(self, tokens: list[int]) -> int:
        """A remote prefill node computed ``tokens``: make their full blocks loadable. Returns blocks added."""
        bs = self.block_size
        hashes = chain_hashes(tokens, bs)
        prefix, running = [], ROOT_HASH
        for token in tokens[: len(hashes) * bs]:
            running = prefix_hash(running, token)
            prefix.append(running)
        added = 0
        for i, block_hash in enumerate(hashes):
            end = (i + 1) * bs
            keys = {(block_hash, g) for g in range(self.num_groups)}
            new = {key for key in keys if key[1] not in self.tier.get(block_hash, {})}
            if not self._make_room(len(new), keys):
                break  # a full tier keeps the prefix published so far
            for key in sorted(new):
                self.policy.insert(key)
            added += 1
            self.tier[block_hash] = {
                g: (state_fingerprint(g, end, prefix[end - 1]),)
                if g in self.state_groups
                else tuple(fingerprint(g, p, prefix[p]) for p in range(i * bs, end))
                for g in range(self.num_groups)
            }
        return added

    def num_new_matched_tokens(self, request, num_local_computed: int) -> int:
        """Tokens beyond the local hit this tier can supply; never the last prompt token. An
        attention group needs every block of the range, a state group only the state at its end."""
        bs, hashes = self.block_size, request.block_hashes
        i = num_local_computed // bs
        last = min(len(hashes), (request.num_tokens - 1) // bs) if self.state_groups else len(hashes)
        end_block = i
        while i < last:
            rows = self.tier.get(hashes[i], {})
            if any(g not in rows for g in self.attention_groups):
                break
            i += 1
            if all(g in rows for g in self.state_groups):
                end_block = i
        end = end_block * bs if self.state_groups else min(i * bs, request.num_tokens - 1)
        return max(0, end - num_local_computed)

    def start_load(self, request, null_block_id: int, tables, num_local: int, num_external: int) -> None:
        """Take the blocks allocated for external tokens (the checker has seen them at the hand-off)."""
        bs = self.block_size
        slots, values, owned, keys = [], [], [], set()
        end = -(-(num_local + num_external) // bs)
        for g, table in enumerate(tables):
            for index in range(end - 1 if g in self.state_groups else num_local // bs, end):
                block_id = table[index]
                if block_id == null_block_id:
                    continue
                owned.append((g, block_id))
                keys.add((request.block_hashes[index], g))
                row = self.tier[request.block_hashes[index]][g]
                if g in self.state_groups:
                    slots.append(block_id * bs)
                    values.append(row[0])
                    continue
                for offset in range(bs):
                    position = index * bs + offset
                    if num_local <= position < num_local + num_external:
                        slots.append(block_id * bs + offset)
                        values.append(row[offset])
        for key in sorted(keys):
            self.policy.touch(key)
        load = PendingLoad(request.request_id, slots, values, owned, num_local, frozenset(keys))
        if self.mode == "sync":
            self.memory.write(slots, values)
        else:
            self.pending[request.request_id] = load

    def finish_load(self, request_id: str, ok: bool) -> PendingLoad:
        load = self.pending.pop(request_id)
        if ok:
            self.memory.write(load.slots, load.values)
        return load
