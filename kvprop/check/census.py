"""Every field of the state kvprop's engine keeps, and what judges it.

A fault that corrupts a field no check reads passes unseen unless a guard inside kvprop's
allocator happens to raise, and a real target has no such guard. So each field of the
allocator's objects (blocks, free queue, pool and cache map, group managers, coordinator,
manager facade), of the connector, the worker's memory, the engine's queues and its
requests is named here: ``Judged`` by the kinds that fail when it goes wrong, ``Derived``
from judged fields or read by nothing that decides (with the reason), or a ``Setting``
fixed at construction. ``tests/test_census.py`` walks the engine and fails on a field that
is not named here, so a new field arrives with its judge or its reason.

The view a real target's adapter implements (``kvprop.targets.protocol.View`` and the calls
its capabilities promise) is named the same way in ``VIEW``: each call with the kinds whose
checks read it.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class Judged:
    """Checked: a fault in the field alone raises one of ``kinds``."""

    kinds: tuple[str, ...]


@attrs.frozen
class Derived:
    """Not compared with anything itself, and why that loses nothing."""

    reason: str


@attrs.frozen
class Setting:
    """Fixed when the object is built (from the configuration, or a reference to a part)."""

    reason: str


Judgement = Judged | Derived | Setting

PART = Setting("a reference to another part, judged in its own entry")
CONFIG = Setting("from the configuration, fixed at construction")

TABLES = ("ref-cnt-mismatch", "duplicate-in-table", "table-length", "table-too-short", "null-in-attended-range")
CACHED_COUNT = ("cached-count", "cached-count-behind", "cached-block-lost-hash", "freed-request-remains")
MAP = ("cache-map-missing", "cache-map-stale", "hit-too-long", "hit-too-short", "events-diverge")
CHANGE_LOG = Derived(
    "the change log the incremental checks read (Capabilities.change_log); a block it misses is "
    "still judged by the full sweep every few checks and at the end of every run"
)
RECORD = Judged(("freed-request-remains",))  # a per-request record a free must drop (view.records_of)

CENSUS: dict[str, dict[str, Judgement]] = {
    # ---- kvprop.allocator.block_pool -------------------------------------------------------------
    "Block": {
        "block_id": Setting("the block's index in the pool; the checks address blocks by it"),
        "ref_cnt": Judged(("ref-cnt-mismatch", "negative-ref-cnt", "free-queue-membership", "null-block-count")),
        "key": Judged(MAP[:2] + ("null-block-cached", "cache-key-group", "cached-block-lost-hash", "data-mismatch")),
        "key_tokens": Derived(
            "the length of the prefix ``key`` names, set with it and read only by the pool's guard against "
            "caching a block again under a longer prefix; what the key promises is judged through ``key`` "
            "(data-mismatch reads the block back against the prefix its hash names)"
        ),
        "prev": Judged(("free-queue-links", "free-queue-membership")),
        "next": Judged(("free-queue-links", "free-queue-membership", "free-queue-repeat")),
        "is_null": Setting("set once, on the pool's first block; the view names that block and 2, 4, 6, 7 judge it"),
    },
    "FreeBlockQueue": {
        "head": Setting("a sentinel; its links are judged by the walks from each end (free-queue-links)"),
        "tail": Setting("a sentinel; its links are judged by the walks from each end (free-queue-links)"),
        "num_free": Judged(("free-count", "conservation")),
        "changed": CHANGE_LOG,
    },
    "BlockPool": {
        "blocks": Setting("the blocks, built once; each block's fields have their own entry"),
        "cached": Judged(MAP),
        "extra_keys": Judged(("cache-map-missing", "cache-map-stale", "hit-too-long")),
        "events": Judged(
            ("events-diverge", "events-unknown-removal", "events-reannounce-unheld", "router-forgets-resident")
        ),
        "free_queue": PART,
        "null_block": PART,
        "num_blocks": CONFIG,
        "enable_caching": CONFIG,
        "changed": CHANGE_LOG,
        "num_evictions": Derived(
            "a statistic (cached blocks popped for reuse) that no decision reads: it marks the eviction event "
            "the search's coverage counts, and kvprop agree compares it with the target's count"
        ),
    },
    # ---- kvprop.allocator.group_managers and mamba ----------------------------------------------
    "SingleTypeManager": {
        "req_to_blocks": Judged(
            (*TABLES, "table-without-admission", "admitted-without-table", "freed-request-remains")
        ),
        "num_cached_block": Judged(CACHED_COUNT),
        "pending_copies": Judged(("ref-cnt-mismatch", "data-mismatch")),
        "partial_hit": RECORD,
        "spec": CONFIG,
        "pool": PART,
        "null_block": PART,
        "group_id": CONFIG,
        "block_size": CONFIG,
        "enable_caching": CONFIG,
        "retention_interval": CONFIG,
        "alignment": CONFIG,
        "unit": CONFIG,
        "eagle": CONFIG,
    },
    "FullAttentionManager": {
        "keyed_this_step": Derived(
            "scratch cleared at every step's start: blocks keyed inside them in this step, whose hit waits "
            "for the forward pass; a hit it wrongly lets through reads unwritten slots (data-mismatch)"
        ),
    },
    "MambaManager": {
        "last_state_index": RECORD,
        "num_retired": RECORD,
        "allocated": RECORD,
        "checkpoints": RECORD,
        "cached_this_step": Derived(
            "scratch cleared at every step's start: keys whose state this step computes; a hit it wrongly "
            "lets through continues from an unwritten state (state-source-mismatch)"
        ),
        "align": CONFIG,
        "uses_main_model_tokens": CONFIG,
        "num_speculative": CONFIG,
        "checkpoint": CONFIG,
    },
    "KVCacheCoordinator": {
        "config": CONFIG,
        "pool": PART,
        "managers": PART,
        "block_size": CONFIG,
        "lookup_order": CONFIG,
    },
    "KVCacheManager": {
        "config": CONFIG,
        "pool": PART,
        "coordinator": PART,
        "block_size": CONFIG,
        "enable_caching": CONFIG,
        "num_groups": CONFIG,
    },
    # ---- kvprop.sim --------------------------------------------------------------------------------
    "Connector": {
        "tier": Judged(("data-mismatch", "connector-write-unowned", "tier-offers-unsaved")),
        "pending": Judged(("freed-request-remains", "connector-write-unowned", "proceeds-before-load")),
        "saves": Judged(("write-during-save", "tier-offers-unsaved")),
        "saving": Derived("the keys of the saves in flight, from saves: what an offload skips as being saved"),
        "unread": Derived("the blocks the unflushed saves read, from saves: a wrong one shows as write-during-save"),
        "num_saves": Derived("a counter giving each save its job id; the operations pick saves by their order"),
        "policy": Derived(
            "the order a full tier evicts idle keys in: the policy's choice, which no oracle judges; the keys it "
            "may not take (saved or read now) come from saves and pending"
        ),
        "capacity": CONFIG,
        "mode": CONFIG,
        "memory": PART,
        "block_size": CONFIG,
        "num_groups": CONFIG,
        "state_groups": CONFIG,
        "attention_groups": CONFIG,
    },
    "PagedMemory": {
        "data": Judged(("data-mismatch", "write-to-null-block", "state-source-mismatch")),
        "copied": Derived("the step's copies, a log the incremental data check reads; the full one reads data"),
        "recent": Derived("the step's written slots, a log the incremental data check reads; the full one reads data"),
        "flat": Setting("a flat alias of data, the same storage"),
        "host": Setting("a host copy of data for reads where data lives on a GPU, refreshed before each check"),
        "device": CONFIG,
        "block_size": CONFIG,
        "num_blocks": CONFIG,
    },
    "Engine": {
        "requests": Judged(("liveness", "table-without-admission", "admitted-without-table")),
        "waiting": Judged(("table-without-admission", "liveness")),
        "running": Judged(("admitted-without-table", "table-length", "table-too-short", "liveness")),
        "loading": Judged(("proceeds-before-load", "load-room-short", "freed-request-remains")),
        "loaded": Judged(("proceeds-before-load", "load-room-short", "liveness")),
        "worker_tables": Judged(("data-mismatch", "write-to-shared-block", "write-to-null-block")),
        "state_columns": Judged(("state-source-mismatch", "state-write-unowned", "state-not-held")),
        "registry": Derived(
            "the oracle's own record of what each block hash names, from the requests' tokens: the data "
            "checks read it, no decision does"
        ),
        "admissions": Derived("a counter giving each admission its place, the order preemption follows (liveness)"),
        "admitted_at": Derived("each running request's place in the admission order, from admissions"),
        "last_hits": Derived("the latest admission's hit, kept for the stale-hits misuse the checker judges"),
        "retired": Derived("recently ended requests, kept only for the buggy caller's frees of ended requests"),
        "next_id": Derived("the next request id; an id is never reused (a reuse would show as a foreign table)"),
        "events": Derived("counts of the engine events reached, the search's coverage; nothing decides on them"),
        "batches": Judged(("output-not-continuation", "data-mismatch", "write-to-shared-block", "liveness")),
        "fence": Judged(("data-mismatch", "ref-cnt-mismatch", "liveness")),
        "sched_steps": Derived("a count of the schedules so far, which the decode stagger reads (vLLM's current_step)"),
        "copy_reserve": CONFIG,
        "caches_after_output": CONFIG,
        "tells_steps": Setting("whether the target declares step_notice"),
        "copies_blocks": Setting("whether the target declares block_copies"),
        "state_aligned": CONFIG,
        "checkpoint_alignment": CONFIG,
        "config": CONFIG,
        "specs": CONFIG,
        "state_groups": CONFIG,
        "block_size": CONFIG,
        "capabilities": Setting("what the target declares"),
        "allocator": PART,
        "view": PART,
        "hooks": PART,
        "target_calls": PART,
        "connector": PART,
        "memory": PART,
    },
    "Request": {
        "num_computed_tokens": Judged(("table-length", "table-too-short", "data-mismatch", "proceeds-before-load")),
        "num_in_flight": Judged(("data-mismatch", "null-in-attended-range", "output-not-continuation")),
        "num_output_placeholders": Judged(("table-length", "table-too-short", "output-not-continuation")),
        "num_stale": Judged(("output-not-continuation",)),
        "last_sched_seq": Derived(
            "the fenced step a request was last scheduled in (vLLM's last_sched_seq), which decides whether its "
            "free waits (kvprop.sim.fence)"
        ),
        "decode_at": Derived("when a request may decode again with pipeline stages (vLLM's next_decode_eligible_step)"),
        "status": Judged(("liveness", "table-without-admission", "admitted-without-table", "proceeds-before-load")),
        "pending_external": Judged(("table-length", "proceeds-before-load")),
        "load_failed": Judged(("proceeds-before-load",)),
        "shared_prefix_boundary": Judged(("cached-count-behind", "hit-too-short")),
        "tokens": Setting("the prompt, then each token sampled: the input the fingerprints are computed from"),
        "block_hashes": Derived("the chained hashes of the tokens, computed from them as they arrive"),
        "unit_hashes": Derived("the chained hashes at each hash unit, computed from the tokens"),
        "prefix": Derived("the rolling prefix hash through each token, computed from the tokens"),
        "spec_token_ids": Derived("drafts proposed after the last token; their verification writes are judged"),
        "spec_prefix": Derived("the rolling prefix hash through each draft, computed from the drafts"),
        "num_preemptions": Derived("a statistic of the request's preemptions; nothing decides on it"),
        "request_id": CONFIG,
        "num_prompt_tokens": CONFIG,
        "max_new_tokens": CONFIG,
        "block_size": CONFIG,
        "unit": CONFIG,
        "vocab": CONFIG,
        "registry": PART,
    },
}

# The view every target's adapter implements, and the calls its capabilities promise: the kinds
# whose checks read each (an adapter's own fields are its engine's, judged through these).
VIEW: dict[str, Judgement] = {
    "num_blocks": Judged(("conservation",)),
    "block_size": CONFIG,
    "num_groups": Judged(("cache-key-group",)),
    "null_block_id": Judged(("null-block-free", "null-block-cached", "null-block-count", "write-to-null-block")),
    "num_free_blocks": Judged(("free-count", "conservation", "spurious-refusal")),
    "ref_cnt": Judged(("ref-cnt-mismatch",)),
    "ref_cnts": Judged(("ref-cnt-mismatch", "negative-ref-cnt", "free-queue-membership", "null-block-count")),
    "cache_key": Judged(("cache-map-missing", "cached-block-lost-hash")),
    "cache_keys": Judged(("cache-map-missing", "cache-map-stale", "null-block-cached")),
    "free_queue_ids": Judged(("free-queue-membership", "free-queue-links", "free-queue-repeat", "free-count")),
    "free_queue_ids_backward": Judged(("free-queue-links",)),
    "free_queue_prefix": Judged(("refusal-changed-queue",)),
    "cache_map_items": Judged(("cache-map-stale",)),
    "request_ids": Judged(("table-without-admission", "freed-request-remains")),
    "request_block_ids": Judged(TABLES),
    "num_cached_blocks": Judged(CACHED_COUNT),
    # the capabilities' calls (kvprop.capabilities)
    "take_events": Judged(
        ("events-diverge", "events-unknown-removal", "events-reannounce-unheld", "router-forgets-resident")
    ),
    "new_step_starts": Derived("a notice the engine sends; what the target does with it is judged by the rest"),
    "take_kv_cache_block_copies": Judged(("data-mismatch",)),
    "caller_contract": Judged(("misuse-accepted", "misuse-changed-state")),
    "pop_blocks_for_free": Judged(("ref-cnt-mismatch", "freed-request-remains")),
    "free_popped_blocks": Judged(("ref-cnt-mismatch", "free-queue-membership", "liveness")),
    "num_evictions": Derived("a statistic; kvprop agree compares it with kvprop's own count"),
    "extra_keys": Judged(("cache-map-missing", "cache-map-stale")),
    "further_keys": Judged(("cache-map-stale", "hit-too-long")),
    "pending_copies": Judged(("ref-cnt-mismatch",)),
    "take_changes": CHANGE_LOG,
    "cache_count": Judged(("events-diverge", "router-advertises-absent", "router-forgets-resident")),
    "raw_tables": Judged(TABLES),
    "has_cache_key": Judged(("hit-too-short",)),
    "records_of": RECORD,
}
