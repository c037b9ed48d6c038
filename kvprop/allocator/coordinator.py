"""Coordinators: one view of all groups for the manager facade.

The coordinator is where cross-group ordering lives. Admission is two-phase: every
group's hits are touched before any group takes fresh blocks for external tokens, so no
group's pops can evict a block another group is about to claim as a hit.
"""

from __future__ import annotations

from kvprop.allocator import guards
from kvprop.allocator.block_pool import BlockPool
from kvprop.allocator.group_managers import SingleTypeManager
from kvprop.allocator.registry import MANAGER_FOR_SPEC
from kvprop.allocator.specs import AllocatorConfig, FullAttention, cdiv


class KVCacheCoordinator:
    """Groups that share one pool; the hit length is a fixed point over all groups."""

    def __init__(self, config: AllocatorConfig, pool: BlockPool, manager_for_spec=MANAGER_FOR_SPEC):
        self.config = config
        self.pool = pool
        self.block_size = config.block_size
        self.managers: list[SingleTypeManager] = [
            manager_for_spec[type(spec)](spec, pool, g, config.enable_caching, config.retention_interval)
            for g, spec in enumerate(config.groups)
        ]
        # Full attention first, as vLLM orders its lookups: the final hit does not depend on
        # the order (every group's lookup is monotone in the candidate length), the junction does.
        for manager in self.managers:
            manager.unit = config.unit
            manager.alignment = config.unit if config.partial_hits else manager.block_size
            manager.eagle = config.eagle
        groups = config.groups
        self.lookup_order = sorted(range(len(groups)), key=lambda g: not isinstance(groups[g], FullAttention))

    def find_longest_cache_hit(self, block_hashes: list[int], max_length: int, unit_hashes=None):
        """(hits per group, hit length, junction). The length shrinks group by group until no
        group shrinks it further (one pass for full attention and one other group, whose answer
        at its own hit is that hit); a full-attention group is looked up once and then trimmed to
        the final length (its hits are downward-closed), as vLLM does, so its last block may be
        one a hit ends inside. The junction is the first lookup's hit where it is longer than
        the final one: a prefix some request shares that a sliding window has not retained yet
        (vLLM's ``shared_prefix_boundary``, 0.30.0 on), 0 when there is none.
        ``unit_hashes``: the request's per-unit hashes, when hits may end inside a block."""
        units = block_hashes if unit_hashes is None else unit_hashes
        found: list = [None] * len(self.managers)
        lengths = [0] * len(self.managers)
        length, first = max_length, None
        # The EAGLE drop: a group looks one block past the candidate (as far as the request is
        # hashed) and gives the last block back, once per candidate; a length that shrinks
        # without a drop asks every group again. Two groups, full attention first: one pass.
        dropped: set = set()
        hashed = len(block_hashes) * self.block_size
        one_pass = len(self.managers) == 2 and isinstance(self.config.groups[self.lookup_order[0]], FullAttention)
        while True:
            candidate = length
            for g in self.lookup_order:
                if found[g] is not None and isinstance(self.config.groups[g], FullAttention):
                    candidate = min(candidate, lengths[g])
                    continue
                drop = self.config.eagle and g not in dropped
                limit = min(candidate + self.block_size, hashed) if drop else candidate
                found[g], hit = self.managers[g].find_hit(block_hashes, units, limit, drop)
                if drop:
                    dropped.add(g)
                elif hit < candidate:
                    dropped.clear()
                candidate = lengths[g] = hit
                if first is None:
                    first = candidate
            if candidate == length:
                break
            length = candidate
            if one_pass:
                break
        assert first is not None  # the first pass looks up every group, and a config has at least one
        for g, spec in enumerate(self.config.groups):
            if isinstance(spec, FullAttention):
                del found[g][cdiv(length, self.block_size) :]
        return tuple(found), length, first if first > length else 0

    def is_admitted(self, request_id: str) -> bool:
        return any(request_id in m.num_cached_block for m in self.managers)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for manager in self.managers:
            manager.remove_skipped_blocks(request_id, num_computed_tokens)

    @staticmethod
    def _tokens(manager, num_tokens: int, num_tokens_main_model: int | None) -> int:
        """Slots a group needs: a state group's drafts have no layers of it, so no lookahead
        (``num_tokens_main_model`` None: the caller has no lookahead, the two are equal)."""
        if num_tokens_main_model is None or not manager.uses_main_model_tokens:
            return num_tokens
        return num_tokens_main_model

    def count_blocks_to_allocate(
        self,
        request_id,
        num_tokens,
        hits,
        total_computed_tokens,
        num_tokens_main_model=None,
        num_local=0,
        prefill_end=0,
    ):
        """``prefill_end``: where the request's prefill ends. Only retention interval 0 keeps it:
        a state group then saves a prefill checkpoint only in the chunk reaching it; otherwise
        every chunk that can save one does (vLLM 0.33.0's ``get_num_blocks_to_allocate``)."""
        if self.config.retention_interval != 0:
            prefill_end = 0
        return sum(
            m.count_blocks_to_allocate(
                request_id,
                self._tokens(m, num_tokens, num_tokens_main_model),
                hits[g],
                total_computed_tokens,
                num_local,
                prefill_end=prefill_end,
            )
            for g, m in enumerate(self.managers)
        )

    def allocate_new_computed_blocks(self, request_id, hits, num_local: int, num_external: int) -> None:
        if self.is_admitted(request_id):
            if guards.ENABLED and any(hits):
                raise AssertionError(f"admitted request {request_id} cannot take new cache hits")
            return
        total = num_local + num_external
        for g, manager in enumerate(self.managers):
            manager.add_local_computed_blocks(request_id, hits[g], total, num_local)
        if num_external > 0:
            for manager in self.managers:
                manager.allocate_external_computed_blocks(request_id, num_local, num_external)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int | None = None):
        return tuple(
            m.allocate_new_blocks(request_id, self._tokens(m, num_tokens, num_tokens_main_model)) for m in self.managers
        )

    def new_step_starts(self) -> None:
        for manager in self.managers:
            manager.new_step_starts()

    def take_pending_copies(self) -> list:
        return [pair for manager in self.managers for pair in manager.take_pending_copies()]

    def cache_blocks(self, request, num_tokens: int) -> None:
        for manager in self.managers:
            manager.cache_blocks(request, num_tokens)

    def free(self, request_id: str) -> None:
        for manager in self.managers:
            manager.free(request_id)

    def pop_blocks_for_free(self, request_id: str) -> list:
        """Every group's blocks of the request, group after group, its records dropped."""
        return [block for manager in self.managers for block in manager.pop_blocks_for_free(request_id)]

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in m.req_to_blocks.get(request_id, ())] for m in self.managers)


class UnitaryCoordinator(KVCacheCoordinator):
    """A single group: its own hit is final, no fixed point to find."""

    def find_longest_cache_hit(self, block_hashes, max_length, unit_hashes=None):
        hits, length = self.managers[0].find_hit(block_hashes, block_hashes, max_length, self.config.eagle)
        return (hits,), length, 0


class HybridCoordinator(KVCacheCoordinator):
    """Several groups of different attention types sharing one pool."""
