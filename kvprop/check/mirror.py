"""Incremental checking: the same sentences as ``invariants``, applied to what changed.

A full sweep costs O(blocks + table entries) in Python per check, which would dominate a
step at large pools. Instead a mirror remembers, per block, which tables hold it and how
often (its holder count and its groups follow), and per table what it held; each check diffs the tables that changed and
re-judges only the blocks the pool reports as changed plus those whose holders changed.
The checker still runs the full sweep every few checks and at the end of every run.
"""

from __future__ import annotations

from collections import Counter

from kvprop.check import invariants as inv


class Mirror:
    def __init__(self, view, capabilities, fenced=dict) -> None:
        self.view = view
        n = view.num_blocks
        self.tables: dict[tuple[str, int], list] = {}  # the block objects, compared by identity
        self.ids: dict[tuple[str, int], list[int]] = {}  # the same tables as block ids
        self.tables_of: list[Counter] = [Counter() for _ in range(n)]  # block -> the tables holding it, how often
        self.verified: dict = {}  # table key -> its TableVerdict (invariants.check_tables), while its keys stand
        self.cached_counts: dict = {}  # table key -> the cached count the view reported with it
        self.rekeyed: set = set()  # keys of tables holding a block whose key changed, until sync returns them
        self.keys: list = [None] * n
        self.free = set(view.free_queue_ids())
        self.moved_keys: set = set()  # old and new keys of every block judged since the last take
        # block -> its keys (its own, then those inside it) when the step began, once it moves (the checker's)
        self.first_keys: dict | None = None
        self.further: dict[int, tuple] = {}  # block -> its keys inside it, where it has any
        # keys inside a block, and every live table of a group at once, where the view declares them
        self.further_keys = view.further_keys if capabilities.keys_inside_blocks else None
        self.raw_tables = view.raw_tables if capabilities.raw_tables else None
        self.null_count_fixed = capabilities.null_count_fixed
        self.fenced = fenced  # the references deferred frees hold (the engine's fence)
        view.take_changes()
        self.sync(set(range(n)), check=False)

    def _count(self, key, table, sign: int, affected: set) -> None:
        null = self.view.null_block_id
        for block in table:
            block_id = block.block_id
            if block_id == null:
                continue
            tables = self.tables_of[block_id]
            tables[key] += sign
            if tables[key] == 0:
                del tables[key]
            affected.add(block_id)

    def sync(self, changed: set, check: bool = True, requests: set | None = None) -> set:
        """Fold in the tables that changed; judge every affected block. Returns the keys of the
        tables to judge again: those whose entries or cached count changed, and those holding a
        block whose key changed (a table's cached prefix is judged by its blocks' keys).

        ``requests`` limits the table comparison to those request ids (inside a step, where the
        engine knows whose tables it asked to change); None compares every table."""
        view = self.view
        tables, counts, changed_tables, seen = self.tables, self.cached_counts, set(), 0
        for g in range(view.num_groups):
            for rid, live in self._live_tables(g, requests):
                if live is None:
                    continue
                seen += 1
                key = (rid, g)
                count = view.num_cached_blocks(g, rid)
                if counts.get(key, -1) != count:
                    counts[key] = count
                    changed_tables.add(key)
                old = tables.get(key)
                if old is not None and old == live:
                    continue
                if old is None:
                    self._count(key, live, +1, changed)
                else:
                    # recount only the entries that differ: a table mostly grows at its end
                    n, m = len(old), min(len(old), len(live))
                    differ = [] if live[:n] == old else [i for i in range(m) if old[i] is not live[i]]
                    self._count(key, [old[i] for i in differ] + old[m:], -1, changed)
                    self._count(key, [live[i] for i in differ] + live[m:], +1, changed)
                tables[key] = list(live)
                self.ids[key] = [b.block_id for b in live]
                changed_tables.add(key)
        if requests is None:  # every table still in the mirror was seen, unless one went
            stale = [] if seen == len(tables) else [k for k in tables if view.raw_table(k[1], k[0]) is None]
        else:
            stale = [
                (rid, g)
                for rid in requests
                for g in range(view.num_groups)
                if (rid, g) in tables and view.raw_table(g, rid) is None
            ]
        for key in stale:
            del self.ids[key]
            self.verified.pop(key, None)
            counts.pop(key, None)
            self._count(key, tables.pop(key), -1, changed)
            changed_tables.add(key)
        if check:
            for rid, g in changed_tables:
                if (rid, g) in self.tables:
                    inv.table_without_repeats(rid, g, self.ids[(rid, g)], view.null_block_id)
        self._judge(changed, check)
        rekeyed, self.rekeyed = self.rekeyed, set()
        return changed_tables | rekeyed

    def _live_tables(self, group: int, requests: set | None):
        """(request id, live table or None) for ``requests``, or for every request of the group:
        in one call where the view offers ``raw_tables``."""
        view = self.view
        if requests is not None:
            return [(rid, view.raw_table(group, rid)) for rid in requests]
        if self.raw_tables is not None:
            return self.raw_tables(group)
        return [(rid, view.raw_table(group, rid)) for rid in list(view.request_ids(group))]

    def _judge(self, changed: set, check: bool) -> None:
        """Re-judge each changed block. The cheap test in front of each sentence only decides
        whether to call it; the sentence in ``invariants`` decides and words the violation."""
        view, null, num_groups = self.view, self.view.null_block_id, self.view.num_groups
        keys, free, tables_of = self.keys, self.free, self.tables_of
        first_keys = self.first_keys
        copies = inv.refs_outside_tables(view, self.fenced()) if check else {}
        for block_id in sorted(changed):  # the lowest block first, as the full sweep reports
            old_key = keys[block_id]
            old_further = self.further.pop(block_id, ())
            if first_keys is not None and block_id not in first_keys:
                first_keys[block_id] = () if old_key is None else (old_key, *old_further)
            ref_cnt, key, in_queue, links_ok, in_map, stale = view.block_state(block_id, old_key)
            further = self.further_keys(block_id) if key is not None and self.further_keys else ()
            if further:
                self.further[block_id] = tuple(further)
            keys[block_id] = key
            if key != old_key:  # the tables holding it are judged again, without their verdicts
                for table_key in tables_of[block_id]:
                    self.verified.pop(table_key, None)
                    self.rekeyed.add(table_key)
            if key is not None:
                self.moved_keys.add(key)
            if old_key is not None:
                self.moved_keys.add(old_key)
            if in_queue:
                free.add(block_id)
            else:
                free.discard(block_id)
            if not check:
                continue
            if stale:
                inv.map_entry(block_id, old_key, key, further)
            if key is not None and (not in_map or block_id == null or not 0 <= key[1] < num_groups):
                inv.block_cache_entry(block_id, key, in_map, num_groups, block_id == null)
            for extra in further:
                inv.block_cache_entry(block_id, extra, view.map_holds(extra, block_id), num_groups, block_id == null)
            if block_id == null:
                inv.null_block_not_free(block_id, in_queue)
                if self.null_count_fixed:
                    inv.null_block_count(block_id, ref_cnt)
                continue
            held = tables_of[block_id]
            holders, queued = sum(held.values()), copies.get(block_id, 0)
            groups = {g for _, g in held} if len(held) > 1 else ()
            if ref_cnt != holders + queued or len(groups) > 1 or (holders > 1 and key is None):
                who = {rid for rid, _ in held}
                inv.block_ref_cnt(block_id, ref_cnt, holders, who, queued)
                inv.block_single_group(block_id, groups, who)
                inv.block_shared_only_if_cached(block_id, holders, key, who)
            if ref_cnt < 0 or (ref_cnt == 0) != in_queue:
                inv.block_queue_membership(block_id, ref_cnt, in_queue)
            if not links_ok:
                inv.free_queue_links(
                    False, f"block {block_id}'s free-queue neighbours do not link back to it", [block_id]
                )
        if check:
            inv.free_count(len(free), view.num_free_blocks)
            inv.check_conservation_counts(view, view.num_blocks - 1 - len(free))
