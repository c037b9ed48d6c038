"""Per-group managers: each owns one group's block tables and knows its attention type.

The three types differ only in what they may skip (tokens no future token attends) and
in what counts as a cache hit; allocation, caching and freeing are shared.
"""

from __future__ import annotations

from typing import cast

from kvprop.allocator import guards
from kvprop.allocator.block_pool import Block, BlockPool
from kvprop.allocator.retention import kept_block_mask, resume_boundaries
from kvprop.allocator.specs import cdiv


class SingleTypeManager:
    """One group's request -> blocks table and request -> leading cached-block count.

    ``num_cached_block`` has an entry exactly while the request is admitted: it is the
    signal the coordinator's fast path uses to tell an admitted request from a new one.
    """

    # Whether the group's slots leave out lookahead tokens (a state group in align mode:
    # draft models have none of its layers).
    uses_main_model_tokens = False

    def __init__(self, spec, pool: BlockPool, group_id: int, enable_caching: bool, retention_interval=None):
        self.spec = spec
        self.retention_interval = retention_interval
        self.block_size = spec.block_size
        self.pool = pool
        self.group_id = group_id
        self.enable_caching = enable_caching
        self.null_block = pool.null_block
        self.req_to_blocks: dict[str, list[Block]] = {}
        self.num_cached_block: dict[str, int] = {}
        # Hits inside a block (docs/design.md §2 "Hits inside a block"): the tokens a hit may
        # end on (the coordinator sets the hash unit when hits may end inside a block), the
        # hash unit, each admission's shared tail block awaiting its copy, and the copies
        # queued for the worker, each (source, copy).
        self.alignment = spec.block_size
        self.unit = spec.block_size
        self.partial_hit: dict[str, tuple[int, Block]] = {}
        self.pending_copies: list[tuple[Block, Block]] = []
        self.eagle = False  # the EAGLE drop (the coordinator sets it from the configuration)

    def find_longest_cache_hit(self, block_hashes: list[int], max_length: int) -> list[Block]:
        raise NotImplementedError

    def find_hit(self, block_hashes: list[int], unit_hashes: list[int], max_length: int, drop: bool = False):
        """(hit blocks, hit length in tokens); only a fine-grained lookup ends inside a block.
        ``drop``: the EAGLE drop, for the groups that have one (full attention, windows)."""
        hits = self.find_longest_cache_hit(block_hashes, max_length)
        return hits, len(hits) * self.block_size

    @property
    def fine_grained(self) -> bool:
        return self.alignment < self.block_size

    def _partial_local_hit(self, hits, num_local: int) -> bool:
        """The hit ends inside its last block, which other requests share: the request gets a
        copy of it before writing there (vLLM's ``_has_partial_local_hit``)."""
        return bool(hits) and num_local % self.block_size != 0

    def skipped_tokens(self, num_computed_tokens: int) -> int:
        return self.spec.skipped_tokens(num_computed_tokens)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Replace blocks no future token attends with the null block and free them."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        num_skipped = min(self.skipped_tokens(num_computed_tokens) // self.block_size, len(blocks))
        freed = []
        for i in range(num_skipped - 1, -1, -1):
            if blocks[i] is self.null_block:
                break  # everything before was dropped by an earlier call
            freed.append(blocks[i])
            blocks[i] = self.null_block
        self.pool.free_blocks(freed)

    def count_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        hits: list[Block],
        total_computed_tokens: int,
        num_local: int = 0,
        prefill_end: int = 0,
    ) -> int:
        """Free-queue blocks this allocation consumes: new pops plus hits still in the queue,
        plus the copy of a shared tail block when the hit ends inside it. ``prefill_end`` matters
        to state groups only (their prefill checkpoints)."""
        required = cdiv(num_tokens, self.block_size)
        if request_id in self.num_cached_block:  # registered: its table is there too
            return max(0, required - len(self.req_to_blocks[request_id]))
        num_skipped = self.skipped_tokens(total_computed_tokens) // self.block_size
        kept = hits[num_skipped:]
        evictable = sum(1 for b in kept if b.ref_cnt == 0 and not b.is_null)
        copy = int(self._partial_local_hit(hits, num_local))
        return max(0, required - max(num_skipped, len(hits))) + copy + evictable

    def add_local_computed_blocks(
        self, request_id: str, hits: list[Block], total_computed_tokens: int, num_local: int = 0
    ) -> None:
        """Phase 1 of admission: touch this group's hits and register the request. A hit that
        ends inside its last block leaves that block uncounted as cached: the request's copy
        replaces it at allocation and is cached once full."""
        if guards.ENABLED and self.req_to_blocks.get(request_id):
            raise AssertionError(f"request {request_id} already has blocks in group {self.group_id}")
        num_skipped = self.skipped_tokens(total_computed_tokens) // self.block_size
        kept = hits[num_skipped:]
        if self.enable_caching:
            self.pool.touch(kept)
        table = [self.null_block] * num_skipped + list(kept)
        self.req_to_blocks[request_id] = table
        self.num_cached_block[request_id] = len(table)
        if self._partial_local_hit(kept, num_local):
            index = num_local // self.block_size
            self.partial_hit[request_id] = (index, kept[-1])
            self.num_cached_block[request_id] = index

    def allocate_external_computed_blocks(self, request_id: str, num_local: int, num_external: int) -> None:
        """Phase 2 of admission: fresh blocks for tokens an external tier will load."""
        total = num_local + num_external
        if min(total - self.skipped_tokens(total), num_external) <= 0:
            return
        table = self.req_to_blocks[request_id]
        n = cdiv(total, self.block_size) - len(table)
        if n > 0:
            table.extend(self.pool.get_new_blocks(n))

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[Block]:
        table = self.req_to_blocks.setdefault(request_id, [])
        copies = []
        if request_id in self.partial_hit:
            index, source = self.partial_hit.pop(request_id)
            copy = self.pool.get_new_blocks(1)[0]
            self._copy_on_write(table, index, source, copy)
            copies.append(copy)
        n = cdiv(num_tokens, self.block_size) - len(table)
        if n <= 0:
            return copies
        new = self.pool.get_new_blocks(n)
        table.extend(new)
        return copies + new

    def _copy_on_write(self, table: list[Block], index: int, source: Block, copy: Block) -> None:
        """Put ``copy`` in the table where the shared ``source`` was and queue the copy. Both
        stay held until the worker has copied: ``source`` keeps the hit's reference and
        ``copy`` takes one more than the table's (vLLM's ``_apply_cow``)."""
        if guards.ENABLED and (table[index] is not source or source.is_null or source.ref_cnt <= 0):
            raise AssertionError(f"copy-on-write of block {source.block_id} at index {index}, which is not the hit")
        table[index] = copy
        self.pending_copies.append((source, copy))
        copy.ref_cnt += 1
        self.pool.changed.add(copy.block_id)

    def take_pending_copies(self) -> list[tuple[Block, Block]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def kept_mask(self, request, start: int, end: int) -> list[bool] | None:
        """Which of blocks ``start..end-1`` get a hash; None: all of them (retention thins
        only sliding-window and state groups)."""
        return None

    def new_step_starts(self) -> None:
        """A scheduler step begins; only a state group remembers anything per step."""

    def cache_blocks(self, request, num_tokens: int) -> None:
        """Cache the blocks that ``num_tokens`` tokens fill, past those already cached. A block
        retention does not keep is counted as cached all the same, and never hashed later."""
        num_full = num_tokens // self.block_size
        num_cached = self.num_cached_block.get(request.request_id, 0)
        if num_full <= num_cached:
            return
        table = self.req_to_blocks[request.request_id]
        hashes = request.block_hashes
        mask = self.kept_mask(request, num_cached, num_full)
        bs = self.block_size
        for i in range(num_cached, num_full):
            block = table[i]
            if block is not self.null_block and (mask is None or mask[i - num_cached]):
                self.pool.cache_block(block, hashes[i], self.group_id, (i + 1) * bs)
        self.num_cached_block[request.request_id] = num_full

    def free(self, request_id: str) -> None:
        self.pool.free_blocks(reversed(self.pop_blocks_for_free(request_id)))

    def pop_blocks_for_free(self, request_id: str) -> list:
        """The request's records dropped and its blocks returned, still referenced, in table
        order: the caller frees them (vLLM's ``pop_blocks_for_free``, 0.24.0 on)."""
        self.num_cached_block.pop(request_id, None)
        self.partial_hit.pop(request_id, None)
        return self.req_to_blocks.pop(request_id, [])


class FullAttentionManager(SingleTypeManager):
    """Full attention: every block stays attended; with hits inside a block, the prompt's last
    hash boundary inside a block is keyed too, and a hit ending there gets a copy.

    A copy runs before the step's forward pass (vLLM's worker applies
    ``kv_cache_block_copies`` before the model runs), so a block keyed at a boundary inside it
    in the current step (its tokens up to the boundary are computed by this step's forward
    pass, or it receives a copy this step) cannot be a copy's source until the next step:
    such a hit is refused for the rest of the step, as the state group refuses a state
    computed this step. vLLM 0.33.0 has no such rule for attention groups and copies what the
    block held before (docs/findings.md); variant ``copy-before-compute`` is its rule."""

    guard_same_step_copy = True

    def __init__(self, spec, pool: BlockPool, group_id: int, enable_caching: bool, retention_interval=None):
        super().__init__(spec, pool, group_id, enable_caching, retention_interval)
        self.keyed_this_step: set[int] = set()  # blocks keyed inside them in the current step

    def new_step_starts(self) -> None:
        self.keyed_this_step.clear()

    def count_blocks_to_allocate(
        self, request_id, num_tokens, hits, total_computed_tokens, num_local=0, prefill_end=0
    ) -> int:
        if (
            self.guard_same_step_copy
            and request_id not in self.num_cached_block
            and self._partial_local_hit(hits, num_local)
            and hits[-1].block_id in self.keyed_this_step
        ):
            return self.pool.num_blocks + 1  # its copy would read positions not yet written: not this step
        return super().count_blocks_to_allocate(
            request_id, num_tokens, hits, total_computed_tokens, num_local, prefill_end
        )

    def find_longest_cache_hit(self, block_hashes: list[int], max_length: int) -> list[Block]:
        hits = []
        for block_hash in block_hashes[: max_length // self.block_size]:
            block = self.pool.get_cached_block(block_hash, self.group_id)
            if block is None:
                break
            hits.append(block)
        return hits

    def find_hit(self, block_hashes: list[int], unit_hashes: list[int], max_length: int, drop: bool = False):
        """Full blocks from the start, then, when hits may end inside a block, the longest
        cached boundary inside the next one, probed from its end. ``drop``: the last block
        goes back (the EAGLE drop; hits end on block boundaries with it)."""
        hits = self.find_longest_cache_hit(block_hashes, max_length)
        if drop:
            return hits[:-1], max(len(hits) - 1, 0) * self.block_size
        length = len(hits) * self.block_size
        if not self.fine_grained:
            return hits, length
        u = self.alignment
        first = len(hits) * (self.block_size // u)
        for index in range(min(first + self.block_size // u - 1, max_length // u, len(unit_hashes)) - 1, first - 1, -1):
            block = self.pool.get_cached_block(unit_hashes[index], self.group_id)
            if block is not None:
                return [*hits, block], (index + 1) * u
        return hits, length

    def cache_blocks(self, request, num_tokens: int) -> None:
        super().cache_blocks(request, num_tokens)
        if self.unit < self.block_size:
            self._cache_partial_tail(request, num_tokens)

    def _cache_partial_tail(self, request, num_tokens: int) -> None:
        """Key the block holding the prompt's last hash boundary below its last token, once
        computed, at that boundary, so a request sharing the prompt may hit inside the block
        (vLLM's ``FullAttentionManager._cache_partial_tail_block``; only that boundary)."""
        u = self.unit
        boundary = min((request.num_prompt_tokens - 1) // u, len(request.unit_hashes)) * u
        if boundary == 0 or boundary > num_tokens or boundary % self.block_size == 0:
            return
        table = self.req_to_blocks[request.request_id]
        index = boundary // self.block_size
        if index < len(table):
            block, unit_hash = table[index], request.unit_hashes[boundary // u - 1]
            if (unit_hash, self.group_id) not in self.pool.keys_of(block):
                self.keyed_this_step.add(block.block_id)
            self.pool.cache_partial(block, unit_hash, self.group_id, boundary)


class SlidingWindowManager(SingleTypeManager):
    def kept_mask(self, request, start: int, end: int) -> list[bool]:
        boundaries = resume_boundaries(request, self.eagle)
        return kept_block_mask(self.spec, self.retention_interval, boundaries, start, end, self.eagle)

    def find_hit(self, block_hashes: list[int], unit_hashes: list[int], max_length: int, drop: bool = False):
        """With the EAGLE drop, the run must be one block longer, which then goes back: the
        window of the hit's next token stays covered (vLLM's ``_contiguous_blocks_for_hit``)."""
        if not drop:
            return super().find_hit(block_hashes, unit_hashes, max_length)
        hits = self.find_longest_cache_hit(block_hashes, max_length, self.spec.hit_blocks_needed + 1)[:-1]
        return hits, len(hits) * self.block_size

    def find_longest_cache_hit(self, block_hashes: list[int], max_length: int, need: int | None = None) -> list[Block]:
        """Scan from the right for the last run of ``need`` blocks (those covering a full
        window by default).

        Blocks before the run are never attended again, so they become null blocks; a run
        that starts at block 0 is a hit even when shorter than the window.
        """
        need = self.spec.hit_blocks_needed if need is None else need
        num_blocks = min(max_length // self.block_size, len(block_hashes))
        found: list[Block | None] = [None] * num_blocks
        run = 0
        for i in range(num_blocks - 1, -1, -1):
            block = self.pool.get_cached_block(block_hashes[i], self.group_id)
            if block is None:
                run = 0
                continue
            found[i] = block
            run += 1
            if run >= need:  # found[i : i + run] is the run: every entry of it was found
                return [self.null_block] * i + cast("list[Block]", found[i : i + run])
        return cast("list[Block]", found[:run])  # the run from block 0, every entry found


class ChunkedLocalManager(SingleTypeManager):
    def find_longest_cache_hit(self, block_hashes: list[int], max_length: int) -> list[Block]:
        """Earlier chunks are never attended: they are null; the current chunk must hit from its start."""
        chunk_start = (max_length // self.spec.chunk) * self.spec.chunk // self.block_size
        num_blocks = min(max_length // self.block_size, len(block_hashes))
        if chunk_start > len(block_hashes):
            return []
        hits = [self.null_block] * chunk_start
        for i in range(chunk_start, num_blocks):
            block = self.pool.get_cached_block(block_hashes[i], self.group_id)
            if block is None:
                break
            hits.append(block)
        return hits
