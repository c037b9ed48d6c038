"""The worker: what the engine's model pass does to paged memory.

An ``Engine`` mixin (``kvprop.sim.engine`` composes it). It executes a scheduled step: the block
copies the allocator queued, then every computed position's fingerprint written through the
block ids the worker reads (one scatter into ``PagedMemory``), and, for a state group, the
states after the step's tokens into their columns, settled again after verification. It holds
the worker's own side of a state group (its append-only copy of each table and the column the
state after the computed tokens is in) and hands cached blocks' contents to the connector's
tier. It decides nothing about requests: the scheduler (``kvprop.sim.scheduler``) chose what
runs, and the hooks see every block before it is written.

What it reads of the engine it is mixed into is declared at the top of ``Worker``.
"""

from __future__ import annotations

from typing import Any

from kvprop.allocator.checkpoint import chunk_checkpoint
from kvprop.allocator.hashing import fingerprint, state_fingerprint
from kvprop.allocator.specs import EngineConfig, GroupSpec, Mamba, cdiv
from kvprop.sim.connector import Connector
from kvprop.sim.hooks import Hooks
from kvprop.sim.memory import PagedMemory
from kvprop.sim.request import Request
from kvprop.sim.step_report import StepReport
from kvprop.sim.target_calls import TargetCalls


class Worker:
    """Engine mixin: a step's copies and writes on paged memory, and the state groups' columns."""

    # what it reads of the engine it is mixed into (set by ``Engine.__init__``)
    config: EngineConfig
    specs: tuple[GroupSpec, ...]
    state_groups: frozenset[int]
    block_size: int
    target_calls: TargetCalls
    view: Any  # the target's view (kvprop.targets.protocol.View, a layer above the engine)
    hooks: Hooks
    connector: Connector | None
    requests: dict[str, Request]  # the scheduler's records (kvprop.sim.scheduler)

    def _init_worker(self, num_blocks: int, device: str | None) -> None:
        self.memory = PagedMemory(num_blocks, self.block_size, device)
        # The worker's side of a state group, per (request id, group): its append-only copy of
        # the table, and (running column, accepted-token offset) of the last step (vLLM's
        # mamba_utils: the state after the computed tokens is at column + offset).
        self.worker_tables: dict[tuple[str, int], list[int]] = {}
        self.state_columns: dict[tuple[str, int], tuple[int, int]] = {}

    def _forget_states(self, request_id: str) -> None:
        """``request_id`` gave its blocks back: the worker's state-group tables of it go too."""
        for g in self.state_groups:
            self.worker_tables.pop((request_id, g), None)
            self.state_columns.pop((request_id, g), None)

    def _execute(self, report: StepReport) -> None:
        """The model's forward pass: the block copies the allocator queued (a hit that ends inside
        a shared block gets a copy of it; vLLM's worker copies before the pass), then the writes."""
        for source, dest in report.copies:
            self.memory.copy_block(source, dest)
        self._write_scheduled(report)

    def worker_block_ids(self, request_id: str):
        """The tables a forward pass writes through: the allocator's own, read at the step (a
        target whose scheduler hands the worker its block ids keeps the worker's copy)."""
        return self.target_calls.get_block_ids(request_id)

    def _write_scheduled(self, report: StepReport) -> None:
        """Write every newly computed position (one scatter), after the hook has seen each target block."""
        bs = self.block_size
        slots: list[int] = []
        values: list[int] = []
        offload: list[tuple[int, int, int]] = []  # (block hash, group, block id) for the tier
        for rid, n in report.scheduled.items():
            request = self.requests[rid]
            start = request.num_computed_tokens
            tables = self.worker_block_ids(rid)
            for g, table in enumerate(tables):
                if g in self.state_groups:
                    self._write_states(request, g, table, start, n, slots, values, offload)
                    continue
                self.hooks.before_write(self, request, g, table, start, n)
                if self.connector is not None:
                    for index in range(start // bs, (start + n) // bs):
                        key = self.view.cache_key(table[index])
                        if key is not None:
                            offload.append((key[0], g, table[index]))
                prefixes = request.prefix[start : start + n]
                if len(prefixes) < n:  # a verification pass: the drafts' positions too
                    prefixes += request.spec_prefix[: n - len(prefixes)]
                for p, prefix in zip(range(start, start + n), prefixes):
                    slots.append(table[p // bs] * bs + p % bs)
                    values.append(fingerprint(g, p, prefix))
        self.memory.write(slots, values)
        if self.connector is not None:
            self.connector.offload(offload)

    def _write_states(
        self,
        request: Request,
        g: int,
        table: list[int],
        start: int,
        n: int,
        slots: list[int],
        values: list[int],
        offload: list[tuple[int, int, int]],
    ) -> None:
        """A state group's writes for positions [start, start + n): from the state after
        ``start``, the state after the last scheduled token into the running column
        ``cdiv(start + n, bs) - 1``; in a verification pass with d drafts, the states after the
        verified token and after each draft into that column and the d after it (vLLM's
        mamba_utils; the scratch columns are the table's last ones); with prefill checkpoints,
        the state at the chunk's checkpoint into the column before (kvprop.allocator.checkpoint)."""
        key, bs = (request.request_id, g), self.block_size
        worker = self.worker_tables.setdefault(key, [])
        worker.extend(table[len(worker) :])
        drafts = max(0, start + n - request.num_tokens)
        column = cdiv(start + n, bs) - 1
        targets = [(worker[column + j], column + j, start + n - drafts + j) for j in range(drafts + 1)]
        spec = self.specs[g]
        assert isinstance(spec, Mamba)  # g is a state group
        position = chunk_checkpoint(start, start + n, self.config.allocator.unit, bs, spec.checkpoint)
        if position and worker[column - 1] != self.view.null_block_id:
            # the worker's own rule (compute_mamba_prefill_checkpoints): the state after
            # ``position`` into the column before the running state, written after it (as
            # mamba_mixer2 writes the checkpoint's conv window); a null column has no row
            targets.append((worker[column - 1], column - 1, position))
        self.hooks.before_state_write(self, request, g, self.state_block(request, g), start, targets)
        for block, index, after in targets:
            slots.append(block * bs)
            values.append(state_fingerprint(g, after, request.prefix_at(after - 1)))
            entry = self._boundary_state(g, block, index, after)
            if entry is not None:
                offload.append(entry)
        self.state_columns[key] = (column, drafts)  # the offset is settled by the verification

    def _boundary_state(self, g: int, block: int, index: int, after: int) -> tuple[int, int, int] | None:
        """The tier entry (block hash, group, block) of a state written at its block's boundary into
        a cached block, or None: vLLM 0.30.0 on hands such boundary states to the connector
        (``take_boundary_state_offloads``)."""
        if self.connector is None or after != (index + 1) * self.block_size:
            return None
        key = self.view.cache_key(block)
        return None if key is None else (key[0], g, block)

    def state_block(self, request: Request, g: int):
        """The block holding state group ``g``'s state after the request's computed tokens, as the
        worker finds it: at the running column plus the accepted drafts, or, before the first
        step, at the hit's last entry. None before anything is computed."""
        if request.num_computed_tokens == 0:
            return None
        key = (request.request_id, g)
        column = self.state_columns.get(key)
        if column is None:
            table = self.target_calls.get_block_ids(request.request_id)[g]
            return table[cdiv(request.num_computed_tokens, self.block_size) - 1]
        return self.worker_tables[key][column[0] + column[1]]

    def _settle_states(self, request: Request, accepted: int) -> None:
        """After verification: the state after the computed tokens is ``accepted`` columns past
        the running one; a block boundary the accepted tokens crossed gets its state copied into
        the boundary's own column, where a hit on that block will look (vLLM's
        ``postprocess_mamba``)."""
        bs = self.block_size
        computed = request.num_computed_tokens
        verified = computed - accepted  # tokens through the verified one, drafts aside
        for g in self.state_groups:
            key = (request.request_id, g)
            column, _ = self.state_columns[key]
            offset = accepted
            boundary = computed // bs * bs
            if boundary >= verified:
                worker = self.worker_tables[key]
                source, dest = worker[column + boundary - verified], boundary // bs - 1
                if dest != column or boundary != verified:
                    self.hooks.before_state_write(self, request, g, source, boundary, [(worker[dest], dest, boundary)])
                    self.memory.copy(source * bs, worker[dest] * bs)
                    entry = self._boundary_state(g, worker[dest], dest, boundary)
                    if entry is not None:
                        assert self.connector is not None  # only a connector's tier takes an entry
                        self.connector.offload([entry])
                if dest == column:
                    offset = 0
            self.state_columns[key] = (column, offset)
