"""Named bug variants: the allocator with one known bug switched on.

Each is a small, honest change to one step, made by overriding exactly the method where
the bug lived. The harness proves itself by finding each of them from scratch.

Past 500 lines on purpose: every planted bug sits next to the registry entry that names it
and the kind that catches it, so that a reader checks one against the other in one file.
"""

from __future__ import annotations

import attrs

from kvprop.allocator.block_pool import BlockPool
from kvprop.allocator.coordinator import HybridCoordinator, UnitaryCoordinator
from kvprop.allocator.events import Reannounced, Removed
from kvprop.allocator.group_managers import (
    FullAttentionManager,
    SingleTypeManager,
    SlidingWindowManager,
)
from kvprop.allocator.kv_cache_manager import KVCacheManager, Parts
from kvprop.allocator.mamba import MambaManager
from kvprop.allocator.registry import MANAGER_FOR_SPEC
from kvprop.allocator.retention import kept_block_mask, resume_boundaries
from kvprop.allocator.specs import FullAttention, Mamba, SlidingWindow, cdiv
from kvprop.errors import ConfigError
from kvprop.sim.connector import Connector
from kvprop.sim.engine import Engine
from kvprop.sim.memory import UNWRITTEN
from kvprop.sim.request import Status


class InterleavedExternalAlloc:
    """The pre-fix loop: each group touches its hits and takes its external blocks in turn,
    so an earlier group's pops can evict a later group's not-yet-touched hits."""

    def allocate_new_computed_blocks(self, request_id, hits, num_local, num_external):
        if self.is_admitted(request_id):
            return
        for g, manager in enumerate(self.managers):
            manager.add_local_computed_blocks(request_id, hits[g], num_local + num_external, num_local)
            if num_external > 0:
                manager.allocate_external_computed_blocks(request_id, num_local, num_external)


class InterleavedUnitary(InterleavedExternalAlloc, UnitaryCoordinator):
    pass


class InterleavedHybrid(InterleavedExternalAlloc, HybridCoordinator):
    pass


class TouchBeforeCapacityCheck(KVCacheManager):
    """Touches the hits first; a refused allocation then leaves them touched."""

    def allocate_slots(
        self,
        request,
        num_new_tokens,
        num_new_computed_tokens=0,
        new_computed_blocks=None,
        num_lookahead_tokens=0,
        num_external_computed_tokens=0,
        delay_cache_blocks=False,
    ):
        if new_computed_blocks is not None and not self.coordinator.is_admitted(request.request_id):
            for hits in new_computed_blocks:
                self.pool.touch(hits)
            result = super().allocate_slots(
                request,
                num_new_tokens,
                num_new_computed_tokens,
                self.empty_hits(),
                num_lookahead_tokens,
                num_external_computed_tokens,
                delay_cache_blocks,
            )
            if result is not None:
                for g, manager in enumerate(self.coordinator.managers):
                    table = manager.req_to_blocks[request.request_id]
                    table[: len(new_computed_blocks[g])] = new_computed_blocks[g]
                    manager.num_cached_block[request.request_id] = len(new_computed_blocks[g])
                    del table[len(new_computed_blocks[g]) + len(result[g]) :]
            return result
        return super().allocate_slots(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            num_external_computed_tokens,
            delay_cache_blocks,
        )


class EvictKeepsHashPool(BlockPool):
    """Eviction clears the block's hash but leaves its entry in the cache map."""

    def _evict(self, block):
        if block.key is not None:
            block.key = None
            self.num_evictions += 1


class NullCountedPool(BlockPool):
    """Touching and freeing count the null block too (vLLM's pool before 0.33.0, where its count
    was "not maintained"): hits through a window touch it, frees of tables holding it release it."""

    def touch(self, blocks):
        blocks = list(blocks)
        super().touch(blocks)
        for block in blocks:
            if block.is_null:
                block.ref_cnt += 1
                self.changed.add(block.block_id)

    def free_blocks(self, ordered):
        ordered = list(ordered)
        for block in ordered:
            if block.is_null:
                block.ref_cnt -= 1
                self.changed.add(block.block_id)
        super().free_blocks(ordered)


class StateRecordsKeptManager(MambaManager):
    """A state group's free drops the table but keeps the request's retired count and previous
    running state, which a preempted request then resumes from."""

    def pop_blocks_for_free(self, request_id):
        return SingleTypeManager.pop_blocks_for_free(self, request_id)


class SwaSkipOffByOne(SlidingWindowManager):
    """Skips one block more than the window allows."""

    def skipped_tokens(self, num_computed_tokens):
        skipped = super().skipped_tokens(num_computed_tokens)
        return skipped + self.block_size if skipped > 0 else 0


class HitsRecachedMixin(SingleTypeManager):
    def add_local_computed_blocks(self, request_id, hits, total_computed_tokens, num_local=0):
        super().add_local_computed_blocks(request_id, hits, total_computed_tokens, num_local)
        self.num_cached_block[request_id] = 0


def _hits_recached_managers():
    return {
        spec: type(f"HitsRecached{cls.__name__}", (HitsRecachedMixin, cls), {})
        for spec, cls in MANAGER_FOR_SPEC.items()
    }


class FreeDuringAsyncLoad(Engine):
    """An abort frees a loading request's blocks at once, while the load still writes them."""

    def abort(self, request_id):
        request = self.get(request_id)
        if request.status is Status.LOADING:
            self.release(request)
            self._retire(request, Status.ABORTED)
            return
        super().abort(request_id)


class ResumesBeforeStaleOutput(Engine):
    """With batches in flight, a preempted request is admitted again while the output of a batch
    that scheduled it before the preemption is still to come: that output then lands after the
    resumed prefill has sampled the same position again."""

    @staticmethod
    def _waits_for_output(request):
        return False


class FreesWithoutFence(Engine):
    """With batches in flight beside a connector that loads, a request's blocks are freed at
    once although its last batch is still in flight: a load into one of them, handed out again,
    races that batch's write (vLLM's deferred-free fence, ``defer_block_free``, 0.24.0)."""

    def frees_at_once(self, request):
        return True


class LoadsUnreserved(Engine):
    """An asynchronous load is admitted whenever it fits, leaving nothing for the loads already
    in flight to finish with (the reservation vLLM added in 0.24.0, ``reserved_blocks``)."""

    def reserved_for_loads(self, request):
        return 0


class ProceedsBeforeLoad(Engine):
    """A request whose asynchronous load was started in an earlier step continues as though the
    load had landed (a poll that takes a submitted load for a finished one); the load itself
    lands later, over blocks the request has already computed from."""

    def _continue_loaded(self, report, budget):
        for request in list(self.loading.values()):
            if request.status is Status.LOADING:
                request.num_computed_tokens += request.pending_external
                request.pending_external = 0
                request.status = Status.LOADED
                self.loaded.append(request)
        return super()._continue_loaded(report, budget)

    def finish_load(self, request_id, ok):
        request = self.loading.get(request_id)
        if request is None or request.status in (Status.LOADING, Status.ABORTING):
            return super().finish_load(request_id, ok)
        if ok:
            self.hooks.before_load_write(self, request, self.connector.pending[request_id].block_ids)
        self.connector.finish_load(request_id, ok)
        del self.loading[request_id]


class ReservesOldestLoadOnly(Engine):
    """An asynchronous load is admitted keeping room only for the oldest load in flight, not for
    every one (vLLM's ``_inflight_prefill_reserved_blocks`` sums them all)."""

    def reserved_for_loads(self, request):
        others = [r for r in self.loading.values() if r is not request and r.status is not Status.ABORTING]
        oldest = min(others, key=lambda r: self.admitted_at[r.request_id], default=None)
        return 0 if oldest is None else self.blocks_to_finish(oldest)


class SaveNotFlushed(Engine):
    """A block handed out again (or given back by a preempted request) keeps the saves that read
    it in flight: the new owner writes it before they have read it, and they carry its new
    contents out under the old key (vLLM 0.34.0 flushes them, ``jobs_to_flush``)."""

    def _flush_saves(self, block_ids):
        return None


class PublishesFailedSaves(Connector):
    """The tier records a failed save's keys as held: they are offered, and a load brings what
    the destination holds, nothing (vLLM 0.34.0's ``complete_store(success=False)`` drops them)."""

    def complete_store(self, job, ok):
        if not ok:
            for block_hash, group, _ in job.entries:
                self.tier.setdefault(block_hash, {})[group] = (UNWRITTEN,) * self.block_size
        super().complete_store(job, ok)


class FailedSavePublished(Engine):
    connector_class = PublishesFailedSaves


def _mixed_managers(mixin: type) -> dict:
    """Every attention type's manager with ``mixin`` in front (one bug in the shared base)."""
    return {spec: type(f"{mixin.__name__}{cls.__name__}", (mixin, cls), {}) for spec, cls in MANAGER_FOR_SPEC.items()}


class CapacityOvercount(SingleTypeManager):
    """Counts one block more than an admission needs, so an allocation that exactly fits is refused."""

    def count_blocks_to_allocate(self, request_id, num_tokens, hits, total_computed, num_local=0, **kwargs):
        needed = super().count_blocks_to_allocate(request_id, num_tokens, hits, total_computed, num_local, **kwargs)
        return needed if request_id in self.num_cached_block else needed + 1


class HitStopsEarly(FullAttentionManager):
    """Stops the full-attention hit one block before the end of a run of three or more."""

    def find_longest_cache_hit(self, block_hashes, max_length):
        hits = super().find_longest_cache_hit(block_hashes, max_length)
        return hits[:-1] if len(hits) >= 3 else hits


class EagleKeepsLastBlock(FullAttentionManager):
    """Ignores the EAGLE drop: the hit keeps the block whose last drafter KV depends on a token
    past the hit (and, looking one block further in a hybrid model, may even end past it)."""

    def find_hit(self, block_hashes, unit_hashes, max_length, drop=False):
        return super().find_hit(block_hashes, unit_hashes, max_length)


class FreeKeepsCachedCount(SingleTypeManager):
    """Freeing a request forgets its table but keeps its cached-block count."""

    def free(self, request_id):
        kept = self.num_cached_block.get(request_id)
        super().free(request_id)
        if kept is not None:
            self.num_cached_block[request_id] = kept


class EvictionUnannouncedPool(BlockPool):
    """Reusing a cached block drops its key without a removed event, so a router replaying the
    events keeps sending requests to a prefix that is gone."""

    def _evict(self, block):
        events, self.events = self.events, None
        try:
            super()._evict(block)
        finally:
            self.events = events


class AnnouncesEveryCopyPool(BlockPool):
    """vLLM's rule (``BlockPool.cache_full_blocks`` and ``_maybe_evict_cached_block``, every
    release): every block cached under a key announces it stored and every block evicted
    announces it removed, so one key two blocks hold is stored twice and removed once while
    the other block keeps it, and a router keeping a set of keys forgets it."""

    def _announce_removed(self, keys):
        if self.events is not None:
            self.events.extend(Removed(key) for key in keys)

    def _announce_stored(self, key, fresh):
        super()._announce_stored(key, True)


class RetentionTailShort(SlidingWindowManager):
    """Sizes each retained tail for a window one block shorter, so the first block a hit at a
    resume boundary needs goes unhashed (docs/design.md §8.3)."""

    def kept_mask(self, request, start, end):
        spec = attrs.evolve(self.spec, window=max(1, self.spec.window - self.block_size))
        return kept_block_mask(spec, self.retention_interval, resume_boundaries(request), start, end)


class StateCachedEarly(MambaManager):
    """Caches a state block as soon as a chunk ends inside it, under the key of the block's
    last token: the block promises a state its request has not reached yet."""

    def cache_blocks(self, request, num_tokens):
        bs = self.block_size
        super().cache_blocks(request, min(cdiv(num_tokens, bs) * bs, len(request.block_hashes) * bs))


class StateRetiredEarly(MambaManager):
    """Releases the previous state block as soon as the next one is allocated, before the
    step has continued from it (instead of at the next step's skip)."""

    def allocate_new_blocks(self, request_id, num_tokens):
        new = super().allocate_new_blocks(request_id, num_tokens)
        previous = self.last_state_index.pop(request_id, None)
        blocks = self.req_to_blocks[request_id]
        if new and previous is not None and blocks[previous] is not self.null_block:
            self.pool.free_blocks([blocks[previous]])
            blocks[previous] = self.null_block
        return new


class AcceptsNegativeExternal(KVCacheManager):
    """Stops validating the external-token count: a negative one is taken as given."""

    def validate_allocation(self, request, num_new_tokens, num_hit, hits, num_lookahead, num_external) -> None:
        super().validate_allocation(request, num_new_tokens, num_hit, hits, num_lookahead, max(0, num_external))


class CachePastComputed(KVCacheManager):
    """``cache_blocks`` caches every full block of the request's tokens that its tables hold,
    not only those the computed count covers: after a verification pass that counts the bonus
    token, whose position still holds a rejected draft until the next step computes it."""

    def cache_blocks(self, request, num_computed_tokens: int) -> None:
        held = min(len(table) for table in self.get_block_ids(request.request_id)) * self.block_size
        super().cache_blocks(request, min(request.num_tokens, held))


class DraftSlotsReturned(SingleTypeManager):
    """At the start of each allocation, hands back the blocks past the computed tokens (only
    rejected drafts or lookahead slots were written there) and cuts them from the table; the
    allocation then takes fresh blocks for the same positions, which the worker's append-only
    copy of the table never learns."""

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        super().remove_skipped_blocks(request_id, num_computed_tokens)
        table = self.req_to_blocks.get(request_id)
        keep = cdiv(num_computed_tokens, self.block_size)
        if table and len(table) > keep:
            surplus = table[keep:]
            del table[keep:]
            self.pool.free_blocks(reversed(surplus))


class PartialHitShared(SingleTypeManager):
    """Takes a hit that ends inside a block like any other: the shared block stays in the table,
    counted as cached, with no copy, and the request computes into it (vLLM's copy-on-write,
    ``_has_partial_local_hit``, forgotten)."""

    def _partial_local_hit(self, hits, num_local):
        return False


class CopyBeforeCompute(FullAttentionManager):
    """vLLM 0.33.0's rule: a hit ending inside a block keyed at that boundary in the current step
    is admitted at once, and its copy, which the worker runs before the step's forward pass,
    reads the block before the forward pass has written it."""

    guard_same_step_copy = False


class StateKeyNotMoved(MambaManager):
    """Queues the copy of a state block its own request keyed inside it, but leaves the keys on
    the block the request keeps writing, instead of moving them to the copy."""

    def _copy_partial(self, table, index, source, copy, allocated):
        if not allocated:
            return super()._copy_partial(table, index, source, copy, allocated)
        self.pending_copies.append((source, copy))
        source.ref_cnt += 1
        self.pool.changed.add(source.block_id)
        return [copy]


class CheckpointOverRunningState(MambaManager):
    """vLLM 0.33.0's rule: with retention interval 0 a chunk before the prefill's end reserves no
    checkpoint column, though the worker writes its checkpoint there; when that column is a
    scratch block the allocation moves to the new running state, the checkpoint overwrites it."""

    guard_scratch_checkpoint = False


class ReannouncesEveryPosition(KVCacheManager):
    """vLLM's rule (``emit_cached_block_events``, 0.30.0 to 0.33.0): the full report announces
    the request's block hash at every position of each group's hit, the null entries a
    sliding window or a state group skipped included, which that group does not hold."""

    def _reannounce(self, request, hits) -> None:
        events = self.pool.events
        assert events is not None  # the full report is refused without enable_kv_cache_events
        for g, group_hits in enumerate(hits):
            events.extend(Reannounced((request.block_hashes[i], g)) for i in range(len(group_hits)))


class CheckpointKeyedLate(MambaManager):
    """Keys a checkpoint column one hash unit past its checkpoint: the state it holds is a unit
    short of the one its key promises (a restored state off by one unit, vLLM #51100's kind)."""

    def _cache_checkpoint(self, request):
        rid = request.request_id
        position, column = self.checkpoints[rid]
        if position + self.unit > len(request.unit_hashes) * self.unit:
            return super()._cache_checkpoint(request)
        self.checkpoints[rid] = (position + self.unit, column)
        try:
            return super()._cache_checkpoint(request)
        finally:
            self.checkpoints[rid] = (position, column)


class CheckpointChunkPastBlock(Engine):
    """vLLM 0.33.0's scheduler: a final chunk that saves the prefill's checkpoint is not stopped
    at the next block boundary when it starts inside a block, judged before the junction may
    cut it short; the block it starts in, or the chunk's end, then holds a state that is not
    its block's."""

    checkpoint_skips_block_stop = True


def _with_manager(spec_type: type, manager: type) -> Parts:
    """The allocator's parts with ``manager`` serving ``spec_type``'s groups."""
    return Parts(managers={**MANAGER_FOR_SPEC, spec_type: manager})


@attrs.frozen
class Variant:
    """A planted bug: ``caught_as`` is the violation kind that catches it when kvprop's
    allocator runs without its own guards (an allocator under test need not have guards), so
    an invariant, never a guard or a crash, must find it."""

    name: str
    bug: str
    caught_as: str = attrs.field(default="", kw_only=True)
    allocator: type = KVCacheManager
    parts: Parts = attrs.field(factory=Parts)
    engine: type = Engine


VARIANTS = {
    v.name: v
    for v in (
        Variant(
            "interleaved-external-alloc",
            "per-group touch + external allocation in one loop",
            caught_as="block-in-two-groups",
            parts=Parts(unitary=InterleavedUnitary, hybrid=InterleavedHybrid),
        ),
        Variant(
            "touch-before-capacity-check",
            "hit blocks are touched before the capacity check, which then fails",
            caught_as="ref-cnt-mismatch",
            allocator=TouchBeforeCapacityCheck,
        ),
        Variant(
            "evict-keeps-hash",
            "popping a cached block leaves it in the cache map",
            caught_as="cache-map-stale",
            parts=Parts(pool=EvictKeepsHashPool),
        ),
        Variant(
            "null-counted",
            "touching and freeing count the null block, whose count then drifts",
            caught_as="null-block-count",
            parts=Parts(pool=NullCountedPool),
        ),
        Variant(
            "state-records-kept",
            "a state group's free keeps the request's retired count and previous running state",
            caught_as="freed-request-remains",
            parts=_with_manager(Mamba, StateRecordsKeptManager),
        ),
        Variant(
            "swa-skip-off-by-one",
            "the sliding window skips one block too many",
            caught_as="null-in-attended-range",
            parts=_with_manager(SlidingWindow, SwaSkipOffByOne),
        ),
        Variant(
            "hits-recached",
            "a newly admitted request's cached-count starts at 0, so its hits are cached again",
            caught_as="cached-count-behind",
            parts=Parts(managers=_hits_recached_managers()),
        ),
        Variant(
            "free-during-async-load",
            "aborting a request frees blocks an external load is still writing",
            caught_as="freed-request-remains",
            engine=FreeDuringAsyncLoad,
        ),
        Variant(
            "resumes-before-stale-output",
            "with batches in flight, a preempted request resumes before its in-flight output has come back",
            caught_as="output-not-continuation",
            engine=ResumesBeforeStaleOutput,
        ),
        Variant(
            "frees-without-fence",
            "with batches in flight beside a loading connector, a request's blocks are freed while its batch runs",
            caught_as="data-mismatch",
            engine=FreesWithoutFence,
        ),
        Variant(
            "loads-unreserved",
            "an asynchronous load is admitted without leaving room for the loads in flight to finish",
            caught_as="liveness",
            engine=LoadsUnreserved,
        ),
        Variant(
            "proceeds-before-load",
            "a request continues the step after its asynchronous load started, before the load lands",
            caught_as="proceeds-before-load",
            engine=ProceedsBeforeLoad,
        ),
        Variant(
            "reserves-oldest-load-only",
            "an asynchronous load is admitted keeping room for the oldest load in flight only",
            caught_as="load-room-short",
            engine=ReservesOldestLoadOnly,
        ),
        Variant(
            "save-not-flushed",
            "a block handed out again is written while a save of its old contents still reads it",
            caught_as="write-during-save",
            engine=SaveNotFlushed,
        ),
        Variant(
            "failed-save-published",
            "a failed save's keys are offered by the external tier as though the save had landed",
            caught_as="tier-offers-unsaved",
            engine=FailedSavePublished,
        ),
        Variant(
            "capacity-overcount",
            "an admission is counted one block larger than it is, so one that exactly fits is refused",
            caught_as="spurious-refusal",
            parts=Parts(managers=_mixed_managers(CapacityOvercount)),
        ),
        Variant(
            "hit-stops-early",
            "the full-attention hit stops one block short of what the cache holds",
            caught_as="hit-too-short",
            parts=_with_manager(FullAttention, HitStopsEarly),
        ),
        Variant(
            "state-cached-early",
            "a state block is cached under its block's last token before the request reaches it",
            caught_as="data-mismatch",
            parts=_with_manager(Mamba, StateCachedEarly),
        ),
        Variant(
            "state-retired-early",
            "the previous state block is released before the step has continued from it",
            caught_as="null-in-attended-range",
            parts=_with_manager(Mamba, StateRetiredEarly),
        ),
        Variant(
            "eviction-unannounced",
            "evicting a cached block emits no KV cache removed event",
            caught_as="events-diverge",
            parts=Parts(pool=EvictionUnannouncedPool),
        ),
        Variant(
            "announces-every-copy",
            "every block cached or evicted under a key announces it, so a key stored twice and removed once is gone",
            caught_as="router-forgets-resident",
            parts=Parts(pool=AnnouncesEveryCopyPool),
        ),
        Variant(
            "retention-tail-short",
            "prefix-cache retention leaves the first block of each retained sliding-window tail unhashed",
            caught_as="cached-block-lost-hash",
            parts=_with_manager(SlidingWindow, RetentionTailShort),
        ),
        Variant(
            "accepts-negative-external",
            "allocate_slots no longer refuses a negative external-token count",
            caught_as="misuse-accepted",
            allocator=AcceptsNegativeExternal,
        ),
        Variant(
            "cache-past-computed",
            "cache_blocks caches every full block its tables hold, past the computed tokens it is given",
            caught_as="data-mismatch",
            allocator=CachePastComputed,
        ),
        Variant(
            "draft-slots-returned",
            "the slots of rejected drafts are handed back and replaced, though a table may only grow",
            caught_as="table-rewritten",
            parts=Parts(managers=_mixed_managers(DraftSlotsReturned)),
        ),
        Variant(
            "partial-hit-shared",
            "a hit that ends inside a block keeps the shared block, uncopied, and computes into it",
            caught_as="cached-count",
            parts=Parts(managers=_mixed_managers(PartialHitShared)),
        ),
        Variant(
            "copy-before-compute",
            "a hit ending inside a block keyed in the current step is copied before the step computes the block",
            caught_as="data-mismatch",
            parts=_with_manager(FullAttention, CopyBeforeCompute),
        ),
        Variant(
            "state-key-not-moved",
            "a state block keyed inside it is copied, but its keys stay on the block its request overwrites",
            caught_as="data-mismatch",
            parts=_with_manager(Mamba, StateKeyNotMoved),
        ),
        Variant(
            "checkpoint-over-running-state",
            "a chunk before the prefill's end writes its checkpoint into the scratch block now running",
            caught_as="data-mismatch",
            parts=_with_manager(Mamba, CheckpointOverRunningState),
        ),
        Variant(
            "reannounces-every-position",
            "the full report announces a hit's skipped positions, which the group does not hold",
            caught_as="events-reannounce-unheld",
            allocator=ReannouncesEveryPosition,
        ),
        Variant(
            "checkpoint-keyed-late",
            "a checkpoint column is keyed one hash unit past the state it holds",
            caught_as="cached-block-lost-hash",
            parts=_with_manager(Mamba, CheckpointKeyedLate),
        ),
        Variant(
            "checkpoint-chunk-past-block",
            "a chunk saving a checkpoint runs past the block boundary after its start",
            caught_as="data-mismatch",
            engine=CheckpointChunkPastBlock,
        ),
        Variant(
            "eagle-keeps-last-block",
            "with the EAGLE drop, the full-attention hit keeps its last block",
            caught_as="hit-too-long",
            parts=_with_manager(FullAttention, EagleKeepsLastBlock),
        ),
        Variant(
            "free-keeps-cached-count",
            "freeing a request leaves its cached-block count behind",
            caught_as="freed-request-remains",
            parts=Parts(managers=_mixed_managers(FreeKeepsCachedCount)),
        ),
    )
}
CORRECT = Variant("correct", "none: the allocator as specified")


def get_variant(name: str | None) -> Variant:
    """The variant ``name``; names joined by '+' switch on several bugs at once where each
    changes a different part (kvprop agree runs kvprop as a release's known bugs this way)."""
    if name is None or name == CORRECT.name:
        return CORRECT
    if "+" in name:
        return _combined([get_variant(part) for part in name.split("+")], name)
    try:
        return VARIANTS[name]
    except KeyError:
        known = ", ".join([CORRECT.name, *VARIANTS])
        raise ConfigError(f"unknown variant {name!r}; known variants: {known}") from None


def _combined(variants: list, name: str) -> Variant:
    """One variant with every part each of ``variants`` changes; two changing one part clash."""
    default = _changes(CORRECT)
    changes: dict = {}
    for v in variants:
        own = {k: c for k, c in _changes(v).items() if default.get(k) is not c}
        both = own.keys() & changes.keys()
        clash = sorted(f"the {k[1].__name__} manager" if isinstance(k, tuple) else k for k in both)
        if clash:
            raise ConfigError(f"variant {name!r}: two of its variants change the same part ({', '.join(clash)})")
        changes |= own
    merged = default | changes
    managers = {spec: merged[("manager", spec)] for spec in MANAGER_FOR_SPEC}
    parts = Parts(pool=merged["pool"], unitary=merged["unitary"], hybrid=merged["hybrid"], managers=managers)
    return Variant(name, " + ".join(v.bug for v in variants), merged["allocator"], parts, merged["engine"])


def _changes(v: Variant) -> dict:
    """Every part ``v`` is built from, by the place it fills."""
    managers = {("manager", spec): cls for spec, cls in v.parts.managers.items()}
    return {
        "allocator": v.allocator,
        "engine": v.engine,
        "pool": v.parts.pool,
        "unitary": v.parts.unitary,
        "hybrid": v.parts.hybrid,
        **managers,
    }
