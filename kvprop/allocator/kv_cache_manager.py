"""The manager facade: the calls a scheduler makes, shaped like vLLM's ``KVCacheManager``."""

from __future__ import annotations

import attrs

from kvprop.allocator.block_pool import BlockPool
from kvprop.allocator.coordinator import HybridCoordinator, KVCacheCoordinator, UnitaryCoordinator
from kvprop.allocator.events import Reannounced
from kvprop.allocator.registry import MANAGER_FOR_SPEC
from kvprop.allocator.specs import AllocatorConfig
from kvprop.errors import RequestError


@attrs.frozen
class Parts:
    """The classes an allocator is assembled from; a bug variant swaps one of them."""

    pool: type = BlockPool
    unitary: type = UnitaryCoordinator
    hybrid: type = HybridCoordinator
    managers: dict = attrs.field(factory=lambda: dict(MANAGER_FOR_SPEC))


class KVCacheManager:
    """The facade a scheduler calls. ``caller_contract`` names the malformed calls it refuses
    (with an error, changing nothing); the harness makes exactly those (``Engine.misuse``)."""

    caller_contract = {
        "negative-external": "refuses",
        "too-many-external": "refuses",
        "zero-new-tokens": "refuses",
        "free-twice": "refuses",
        "free-unadmitted": "refuses",
        "cache-past-end": "refuses",
        "stale-hits": "refuses",
    }

    def __init__(self, config: AllocatorConfig, parts: Parts | None = None):
        parts = parts or Parts()
        self.config = config
        self.block_size = config.block_size
        self.enable_caching = config.enable_caching
        self.pool: BlockPool = parts.pool(config.num_blocks, config.enable_caching, config.enable_kv_cache_events)
        coordinator_cls = parts.unitary if len(config.groups) == 1 else parts.hybrid
        self.coordinator: KVCacheCoordinator = coordinator_cls(config, self.pool, parts.managers)
        self.num_groups = len(config.groups)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def empty_hits(self):
        return tuple([] for _ in range(self.num_groups))

    def get_computed_blocks(self, request):
        """Hit blocks per group, the hit length (never the last token: it must produce logits)
        and the shared-prefix junction (``KVCacheCoordinator.find_longest_cache_hit``)."""
        if not self.enable_caching:
            return self.empty_hits(), 0, 0
        limit = request.num_tokens - 1
        found = self.coordinator.find_longest_cache_hit(request.block_hashes, limit, request.unit_hashes)
        hits, num_hit, junction = found
        if num_hit and self.config.kv_cache_report_mode == "full":
            self._reannounce(request, hits)
        return hits, num_hit, junction

    def _reannounce(self, request, hits) -> None:
        """The full report: every key the hit reuses, announced again (vLLM's
        ``emit_cached_block_events``), one per real hit block, the key that made it the
        request's own."""
        events = self.pool.events
        assert events is not None  # AllocatorConfig: the full report needs enable_kv_cache_events
        for g, group_hits in enumerate(hits):
            for i, block in enumerate(group_hits):
                if not block.is_null:
                    own = request.keys_in_block(i, g)
                    events.extend(Reannounced(key) for key in self.pool.keys_of(block) if key in own)

    def allocate_slots(
        self,
        request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks=None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ):
        """Slots for ``num_new_tokens`` (after hits and external tokens), or None if the pool is short.

        A refusal changes nothing but the skipped blocks it freed: the capacity check runs
        before any hit is touched, and counts hits still in the free queue as taken.
        """
        self.validate_allocation(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            num_external_computed_tokens,
        )
        hits = new_computed_blocks if new_computed_blocks is not None else self.empty_hits()
        request_id = request.request_id
        num_local = request.num_computed_tokens + num_new_computed_tokens
        total_computed = num_local + num_external_computed_tokens
        num_tokens_main_model = total_computed + num_new_tokens
        num_tokens_need_slot = num_tokens_main_model + num_lookahead_tokens

        # on the settled basis: a batch in flight still reads the window below its tokens (vLLM
        # 0.34.0 ``allocate_slots``: "free on the processed-token basis"); 0 in flight synchronously
        self.coordinator.remove_skipped_blocks(request_id, max(0, total_computed - request.num_in_flight))
        needed = self.coordinator.count_blocks_to_allocate(
            request_id,
            num_tokens_need_slot,
            hits,
            total_computed,
            num_tokens_main_model,
            num_local,
            request.prefill_end,
        )
        if needed > self.pool.num_free_blocks:
            return None
        self.coordinator.allocate_new_computed_blocks(request_id, hits, num_local, num_external_computed_tokens)
        new_blocks = self.coordinator.allocate_new_blocks(request_id, num_tokens_need_slot, num_tokens_main_model)
        if self.enable_caching and not delay_cache_blocks:
            self.coordinator.cache_blocks(request, min(total_computed + num_new_tokens, request.num_tokens))
        return new_blocks

    def validate_allocation(self, request, num_new_tokens, num_hit, hits, num_lookahead, num_external) -> None:
        """The caller's side of the contract (``caller_contract``): a malformed call is refused
        with a RequestError before anything changes."""
        if num_new_tokens < 0 or (num_new_tokens == 0 and num_external <= 0):
            raise RequestError(
                f"allocate_slots: num_new_tokens must be >= 1 (or 0 with num_external_computed_tokens > 0), "
                f"got num_new_tokens={num_new_tokens}, num_external_computed_tokens={num_external}"
            )
        for name, value in (
            ("num_new_computed_tokens", num_hit),
            ("num_lookahead_tokens", num_lookahead),
            ("num_external_computed_tokens", num_external),
        ):
            if value < 0:
                raise RequestError(f"allocate_slots: {name} must be >= 0, got {value}")
        total = request.num_computed_tokens + num_hit + num_external + num_new_tokens
        # with batches in flight, the outputs still to come are tokens too (vLLM's placeholders)
        known = request.num_tokens_with_spec + request.num_output_placeholders
        if total > known:
            raise RequestError(
                f"allocate_slots: {request.request_id!r} has {known} tokens with its drafts and outputs in flight, "
                f"but the call covers "
                f"{total} ({request.num_computed_tokens} computed + {num_hit} hit + {num_external} external + "
                f"{num_new_tokens} new)"
            )
        for g, group_hits in enumerate(hits or ()):
            for i, block in enumerate(group_hits):
                if not block.is_null and not request.keys_in_block(i, g).intersection(self.pool.keys_of(block)):
                    raise RequestError(
                        f"allocate_slots: hit block {block.block_id} (group {g}, index {i}) is not "
                        f"{request.request_id!r}'s own cached block (cached as {block.key}); stale or foreign hits"
                    )

    def cache_blocks(self, request, num_computed_tokens: int) -> None:
        if num_computed_tokens > request.num_tokens:
            raise RequestError(
                f"cache_blocks: {request.request_id!r} has {request.num_tokens} tokens, "
                f"cannot cache {num_computed_tokens}"
            )
        if self.enable_caching:
            self.coordinator.cache_blocks(request, num_computed_tokens)

    def free(self, request) -> None:
        self._holds_blocks("free", request)
        self.coordinator.free(request.request_id)

    def _holds_blocks(self, call: str, request) -> None:
        """A ``RequestError`` unless ``request`` holds blocks (a free of it is well formed)."""
        if not self.coordinator.is_admitted(request.request_id):
            raise RequestError(f"{call}: request {request.request_id!r} holds no blocks (never admitted, or freed)")

    def pop_blocks_for_free(self, request) -> list[int]:
        """The request's blocks, group after group in table order, taken from it but still
        referenced: a scheduler that defers the free while a batch in flight may write them
        returns them later with ``free_popped_blocks`` (vLLM's ``pop_blocks_for_free``)."""
        self._holds_blocks("pop_blocks_for_free", request)
        return [block.block_id for block in self.coordinator.pop_blocks_for_free(request.request_id)]

    def free_popped_blocks(self, block_ids: list[int]) -> None:
        """Release blocks ``pop_blocks_for_free`` returned, last first, so that a request's tail
        is evicted before its prefix (vLLM's ``_drain_deferred_frees``)."""
        self.pool.free_blocks(reversed([self.pool.blocks[b] for b in block_ids]))

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def new_step_starts(self) -> None:
        """The scheduler starts a step: state cached in the last one is now computed (vLLM 0.33.0)."""
        self.coordinator.new_step_starts()

    def take_kv_cache_block_copies(self) -> list[tuple[int, int]]:
        """The block copies queued since the last call, each (source id, copy id), for the worker
        to run before the step's forward pass; the references that held both ends for it are
        released now (vLLM's ``take_kv_cache_block_copies`` and the scheduler's release of the
        retained blocks: nothing can be handed out again before the worker has copied)."""
        pairs = self.coordinator.take_pending_copies()
        self.pool.free_blocks([block for pair in pairs for block in pair])
        return [(source.block_id, copy.block_id) for source, copy in pairs]

    def take_events(self) -> list:
        """The KV cache events since the last call (``kvprop.allocator.events``); [] when off."""
        return self.pool.take_events()

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.coordinator.get_block_ids(request_id)
