"""The state-space group's manager: a table of state blocks, not of token positions.

A Mamba layer needs only the state after the last computed token. In "align" mode (vLLM
0.33.0's ``MambaManager`` with prefix caching; docs/design.md §2 "State-space groups") the
table is position-indexed like an attention table, but only one entry is live: index
``cdiv(T, bs) - 1`` holds the running state after the ``T`` tokens scheduled so far. Every
earlier entry is the null block, a retired state awaiting release, or a snapshot some hit
brought in. A block cached under the key of its first ``(i + 1) * bs`` tokens promises the
state after exactly those tokens, so the scheduler ends prefill chunks on block boundaries
(``kvprop.sim.engine``) and the manager refuses, for the rest of the step, a hit whose
state is only being computed in this step.

With drafts the table ends in one scratch column per draft, where a verification pass puts
the state after each draft; a column the next running state passes moves to the end of the
table instead of being released (vLLM's ``_relocate_speculative_block``), because the state
the next step continues from may be in it.

With a hash unit below the block size (docs/design.md §2 "Hits inside a block") a hit may
end at any hash-unit boundary: the prompt's last boundary below its last token is keyed on
the running block that holds it, a request hitting there gets a copy of that block, and the
request that keyed it, still writing the block, moves the key onto a copy of it instead.

With prefill checkpoints (``Mamba.checkpoint``; kvprop.allocator.checkpoint) a chunk may also
save the state at a unit boundary inside it into the column before the new running state: the
manager reserves a block there instead of the null block, and once the chunk is cached keys it
at that boundary, dropping the block key regular caching gave it; a checkpoint no later
request can resume at loses its keys at once.

In "none" mode (no prefix caching) nothing is cached and the table keeps only the running
state, like a one-token window.
"""

from __future__ import annotations

from kvprop.allocator import guards
from kvprop.allocator.block_pool import Block, BlockPool
from kvprop.allocator.checkpoint import checkpoint_column, checkpoint_position, chunk_checkpoint
from kvprop.allocator.group_managers import SingleTypeManager
from kvprop.allocator.retention import kept_state_mask, resume_boundaries
from kvprop.allocator.specs import Mamba, cdiv


class MambaManager(SingleTypeManager):
    # Whether a chunk before the prefill's end keeps a scratch column the worker writes its
    # checkpoint into in place (``_plan_checkpoint``); False is vLLM 0.33.0's rule.
    guard_scratch_checkpoint = True

    def __init__(
        self, spec: Mamba, pool: BlockPool, group_id: int, enable_caching: bool, retention_interval: int | None = None
    ) -> None:
        super().__init__(spec, pool, group_id, enable_caching, retention_interval)
        self.align = spec.mode == "align"
        # In align mode lookahead slots are ignored: draft models have no Mamba layers, and
        # lookahead tokens would break the alignment (vLLM's MambaManager; "none" counts them).
        self.uses_main_model_tokens = self.align
        self.num_speculative = spec.speculative_blocks  # scratch columns after the running state
        self.last_state_index: dict[str, int] = {}  # the previous running state, freed once passed
        self.num_retired: dict[str, int] = {}  # entries below this index were released already
        self.allocated: set[str] = set()  # requests past their first allocation (vLLM's _allocated_block_reqs)
        self.cached_this_step: set = set()  # keys whose state this step's forward pass computes
        self.checkpoint = spec.checkpoint if self.align else None  # the kernel's checkpoint alignment
        self.checkpoints: dict[str, tuple[int, int]] = {}  # the allocation's checkpoint: (position, column)

    def new_step_starts(self) -> None:
        self.cached_this_step.clear()

    def find_longest_cache_hit(self, block_hashes: list[int], max_length: int) -> list[Block]:
        """The rightmost cached state at a block boundary within ``max_length``: one block, nulls before."""
        for i in range(min(max_length // self.block_size, len(block_hashes)) - 1, -1, -1):
            block = self.pool.get_cached_block(block_hashes[i], self.group_id)
            if block is not None:
                return [self.null_block] * i + [block]
        return []

    def find_hit(self, block_hashes: list[int], unit_hashes: list[int], max_length: int, drop: bool = False):
        """When hits may end inside a block: the rightmost cached state at any hash-unit boundary."""
        if not self.fine_grained:
            return super().find_hit(block_hashes, unit_hashes, max_length)
        u = self.alignment
        for index in range(min(max_length // u, len(unit_hashes)) - 1, -1, -1):
            block = self.pool.get_cached_block(unit_hashes[index], self.group_id)
            if block is not None:
                return [self.null_block] * (index * u // self.block_size) + [block], (index + 1) * u
        return [], 0

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        if not self.align:
            return super().remove_skipped_blocks(request_id, num_computed_tokens)
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        last = min(self.skipped_tokens(num_computed_tokens) // self.block_size, len(blocks))
        first = self.num_retired.get(request_id, 0)
        if first < last:
            freed = []
            for i in range(last - 1, first - 1, -1):
                if blocks[i] is not self.null_block:
                    freed.append(blocks[i])
                    blocks[i] = self.null_block
            self.pool.free_blocks(freed)
            self.num_retired[request_id] = last
        previous = self.last_state_index.get(request_id)
        if previous is not None and previous < cdiv(num_computed_tokens, self.block_size) - 1:
            if blocks[previous] is not self.null_block:
                self.pool.free_blocks([blocks[previous]])
                blocks[previous] = self.null_block

    def count_blocks_to_allocate(
        self, request_id, num_tokens, hits, total_computed_tokens, num_local=0, prefill_end=0
    ) -> int:
        if not self.align:
            return super().count_blocks_to_allocate(request_id, num_tokens, hits, total_computed_tokens, num_local)
        if hits and hits[-1].key in self.cached_this_step:
            # its state exists only once this step's forward pass has run: not this step
            return self.pool.num_blocks + 1
        table = self.req_to_blocks.get(request_id, ())
        new = self._required(num_tokens) - len(hits) - len(table)
        evictable = sum(1 for b in hits if b.ref_cnt == 0 and not b.is_null)
        # a copy of a shared state block: the hit's, or the one this request keyed inside a block
        copy = int(self._partial_local_hit(hits, num_local) or request_id in self.partial_hit)
        checkpoint = self._plan_checkpoint(request_id, total_computed_tokens, num_tokens, prefill_end)
        # the next running state, the copy, the checkpoint, and the scratch columns on a first allocation
        cap = 1 + copy + checkpoint + (0 if request_id in self.allocated else self.num_speculative)
        return min(max(new, 0) + copy, cap) + evictable

    def _plan_checkpoint(self, request_id: str, start: int, end: int, prefill_end: int) -> int:
        """1 if the chunk [start, end) saves a checkpoint into a column this allocation reserves
        (recorded for ``allocate_new_blocks`` and ``cache_blocks``), else 0. The column must be
        free: past the table, null, or a scratch column of the request (vLLM 0.33.0's
        ``_needs_internal_checkpoint``).

        Before ``prefill_end`` (retention interval 0) no checkpoint is kept, so vLLM 0.33.0
        reserves none and the worker writes it into whatever its table holds there: the null
        block, or a scratch column the manager has just moved to the new running state (the
        worker's table only grows), whose state the checkpoint then overwrites. kvprop keeps a
        scratch column there in place as if it held a checkpoint; the variant
        ``checkpoint-over-running-state`` is vLLM's rule (docs/findings.md)."""
        self.checkpoints.pop(request_id, None)
        if self.checkpoint is None:
            return 0
        position = chunk_checkpoint(start, end, self.unit, self.block_size, self.checkpoint)
        if not position:
            return 0
        column = checkpoint_column(end, self.block_size)  # >= 0 when the chunk saves a checkpoint
        table = self.req_to_blocks.get(request_id, ())
        scratch = request_id in self.allocated and len(table) - self.num_speculative <= column < len(table)
        if end < prefill_end and not (scratch and self.guard_scratch_checkpoint):
            return 0
        if not (column >= len(table) or table[column].is_null or scratch):
            return 0
        self.checkpoints[request_id] = (position, column)
        return 1

    def _required(self, num_tokens: int) -> int:
        """Entries a table needs: through the running state after ``num_tokens``, then one scratch
        column per draft (the states after each draft of a verification pass)."""
        return cdiv(num_tokens, self.block_size) + self.num_speculative

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[Block]:
        if not self.align:
            return super().allocate_new_blocks(request_id, num_tokens)
        table = self.req_to_blocks.setdefault(request_id, [])
        required, k = self._required(num_tokens), self.num_speculative
        allocated = request_id in self.allocated
        self.allocated.add(request_id)
        partial = self.partial_hit.pop(request_id, None)
        checkpoint = int(request_id in self.checkpoints)
        if required <= len(table) and partial is None and not checkpoint:
            return []
        before = len(table)
        if before:  # the running state (on a first allocation, the hit) becomes the previous one
            self.last_state_index[request_id] = before - 1 - (k if allocated else 0)
        running = required - k - 1
        # the checkpoint column, just before the running state, gets a block, not the null block
        table.extend([self.null_block] * (running - checkpoint - before))
        if allocated:
            # scratch columns the new running state passes are moved to the end, not released:
            # one of them may hold the state the step continues from (one in the checkpoint
            # column stays: the checkpoint is written there)
            for index in range(before - k, min(before, running - checkpoint)):
                self._relocate(table, index)
        new = self.pool.get_new_blocks(max(required - len(table), 0) + (partial is not None))
        copies = []
        if partial is not None:
            copies, new = self._copy_partial(table, *partial, new[0], allocated), new[1:]
        table.extend(new)
        return copies + new

    def _copy_partial(self, table, index: int, source: Block, copy: Block, allocated: bool) -> list[Block]:
        """A state block shared at a boundary inside it gets a copy. A new request puts the copy
        in its table (``_copy_on_write``). The request that keyed the block keeps writing it
        (the worker's table only grows), so the keys move to the copy, which the worker fills
        before the step's forward pass, and ``source`` is held until then (vLLM's
        ``MambaManager.allocate_new_blocks``)."""
        if not allocated:
            self._copy_on_write(table, index, source, copy)
            return [copy]
        if guards.ENABLED and table[index] is not source:
            raise AssertionError(f"partial state block {source.block_id} left index {index} before its copy")
        self.pool.move_keys(source, copy)
        self.pending_copies.append((source, copy))
        source.ref_cnt += 1
        self.pool.changed.add(source.block_id)
        if copy.key is not None:
            self.cached_this_step.add(copy.key)
        return [copy]

    def _relocate(self, table: list[Block], index: int) -> None:
        block = table[index]
        if guards.ENABLED and (block.is_null or block.ref_cnt != 1 or block.key is not None):
            raise AssertionError(f"speculative block {block.block_id} at index {index} is not the request's alone")
        table.append(block)
        table[index] = self.null_block

    def kept_mask(self, request, start: int, end: int) -> list[bool] | None:
        return kept_state_mask(self.spec, self.retention_interval, resume_boundaries(request), start, end)

    def cache_blocks(self, request, num_tokens: int) -> None:
        before = self.num_cached_block.get(request.request_id, 0)
        super().cache_blocks(request, num_tokens)
        after = self.num_cached_block.get(request.request_id, 0)
        if request.request_id in self.checkpoints:
            key = self._cache_checkpoint(request)
        elif self.align and self.unit < self.block_size:
            key = self._cache_partial_tail(request, num_tokens)
        else:
            key = None
        if key is not None:
            self.cached_this_step.add(key)
        table = self.req_to_blocks.get(request.request_id, ())
        for block in table[before:after]:
            if block.key is not None and not block.is_null:
                self.cached_this_step.add(block.key)

    def _cache_partial_tail(self, request, num_tokens: int):
        """Key the running state at the prompt's last hash boundary below its last token, when
        the cached length reaches exactly that boundary (the scheduler ends a chunk there). If
        the boundary is inside the block, the block stays uncounted as cached, and the next
        allocation copies it (``_copy_partial``). vLLM's ``MambaManager._cache_partial_tail_block``
        without checkpoint columns."""
        u, bs = self.unit, self.block_size
        if num_tokens <= 0 or num_tokens % u or num_tokens != (request.num_prompt_tokens - 1) // u * u:
            return None
        table = self.req_to_blocks[request.request_id]
        index = cdiv(num_tokens, bs) - 1
        if index >= len(table) or table[index].is_null or table[index].key_tokens == num_tokens:
            return None
        source = table[index]
        key = self.pool.cache_partial(source, request.unit_hashes[num_tokens // u - 1], self.group_id, num_tokens)
        if key is not None and num_tokens % bs:
            self.partial_hit[request.request_id] = (index, source)
            self.num_cached_block[request.request_id] = index
        return key

    def _cache_checkpoint(self, request):
        """Key the checkpoint column at the checkpoint, replacing every key it has (regular
        caching may have keyed the column at its block's end, a state it does not hold), if a
        later request can resume there: the prompt's checkpoint, a block boundary retention
        keeps, or the junction. Any other checkpoint is transient and loses its keys (vLLM
        0.33.0's ``_cache_partial_tail_block``, checkpoint branch)."""
        position, column = self.checkpoints[request.request_id]
        block = self.req_to_blocks[request.request_id][column]
        if block.is_null:
            return None
        u, bs = self.unit, self.block_size
        resumable = position == checkpoint_position(request.num_prompt_tokens, u)
        if position % bs == 0:
            kept = kept_state_mask(self.spec, self.retention_interval, (), position // bs - 1, position // bs)
            resumable = resumable or kept is None or kept[0]
        if not resumable and position != request.shared_prefix_boundary:
            self.pool.drop_keys(block)
            return None
        if block.key_tokens == position:
            return None
        return self.pool.cache_partial(block, request.unit_hashes[position // u - 1], self.group_id, position, True)

    def pop_blocks_for_free(self, request_id: str) -> list:
        self.checkpoints.pop(request_id, None)
        for state in (self.last_state_index, self.num_retired):
            state.pop(request_id, None)
        self.allocated.discard(request_id)
        return super().pop_blocks_for_free(request_id)
