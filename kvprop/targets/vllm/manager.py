"""vLLM's own v1 ``KVCacheManager`` as kvprop's allocator (``--target vllm``), and the target's factory.

The allocator turns each kvprop request into a vLLM ``Request`` (hashed by vLLM's own block
hasher) and forwards the manager-facade calls; the view (``view``) reads what vLLM then holds.
vLLM stays untouched: nothing is patched, only read.
"""

from __future__ import annotations

from typing import Any

import attrs

from kvprop.allocator.events import GPU, Cleared, Reannounced, Removed, Stored
from kvprop.allocator.specs import AllocatorConfig
from kvprop.capabilities import Capabilities
from kvprop.targets.protocol import VLLM_CAPABILITIES, Built
from kvprop.targets.vllm.config import accepted, build_manager, call_kwargs
from kvprop.targets.vllm.loading import import_vllm
from kvprop.targets.vllm.view import VllmView


def capabilities() -> Capabilities:
    """What the installed release declares: the registered ones (kvprop.targets.protocol), and
    a fixed null-block count where the release keeps one."""
    from kvprop.targets.vllm.releases import null_count_fixed

    return attrs.evolve(VLLM_CAPABILITIES, null_count_fixed=null_count_fixed())


def make_target(config: AllocatorConfig) -> Built:
    """The target factory: vLLM's allocator for ``config`` and the view the invariants read."""
    allocator = VllmAllocator(config)
    return Built(allocator, VllmView(allocator), capabilities())


class Hits(tuple):
    """One hit list per group, as the engine reads them, carrying vLLM's own ``KVCacheBlocks``.

    vLLM tells "no hit" apart by identity (``is self.empty_kv_cache_blocks``), so
    ``allocate_slots`` must get back the very object ``get_computed_blocks`` returned."""

    vllm_blocks: object

    def __new__(cls, vllm_blocks):
        hits = super().__new__(cls, vllm_blocks.blocks)
        hits.vllm_blocks = vllm_blocks
        return hits


class VllmAllocator:
    """kvprop's manager-facade calls, forwarded to vLLM's ``KVCacheManager``.

    Keeps one vLLM ``Request`` per kvprop request (created on first sight, with vLLM's
    own block hasher), appends the tokens the kvprop request has grown by and copies its
    ``num_computed_tokens`` before every call, since vLLM reads both from its request."""

    # What vLLM does with a malformed call (kvprop.sim.engine.MISUSES). Its managers free a
    # request by popping its table with a default, so freeing one that holds nothing is a
    # no-op it tolerates. Its allocate_slots and cache_blocks do not validate their
    # arguments (the scheduler is trusted), so those calls are not made against it.
    caller_contract = {"free-twice": "tolerates", "free-unadmitted": "tolerates"}

    def __init__(self, config: AllocatorConfig):
        self.v = import_vllm()
        self.config = config
        self.block_size = config.block_size
        self.num_groups = len(config.groups)
        self.manager = build_manager(config)
        self._attach()

    @classmethod
    def around(cls, config: AllocatorConfig, manager) -> VllmAllocator:
        """The facade and its bookkeeping over a manager vLLM built itself (its scheduler's)."""
        allocator = cls.__new__(cls)
        allocator.v = import_vllm()
        allocator.config = config
        allocator.block_size = config.block_size
        allocator.num_groups = len(config.groups)
        allocator.manager = manager
        allocator._attach()
        return allocator

    def _attach(self) -> None:
        v = self.v
        self.pool = self.manager.block_pool
        self.hasher = v.kvu.get_request_block_hasher(self.config.unit, v.sha256)
        self._allocate_params = accepted(v.KVCacheManager.allocate_slots)
        self.requests: dict = {}  # kvprop request id -> vLLM Request
        self.hash_names: dict = {}  # vLLM block hash (bytes) -> kvprop block hash
        self.event_names: dict = {}  # the hash as KV cache events publish it -> kvprop block hash
        self.vllm_hashes: dict = {}  # kvprop block hash -> vLLM block hash (bytes), with events on
        self._named: dict = {}  # request id -> how many of its block hashes are in hash_names
        self.num_evictions = 0
        self._counting = False  # inside counting_evictions
        self._evictions_counted = self._count_evictions()
        # the stored events a lookup queued (the full report), by id; holding them keeps each id theirs
        self._reannounced: dict = {}

    def sampling_params(self, max_tokens: int):
        """The request's sampling parameters: its token limit and, for the full report, the
        mode vLLM's ``Request`` reads from ``extra_args``."""
        if self.config.kv_cache_report_mode == "full":
            return self.v.SamplingParams(max_tokens=max_tokens, extra_args={"kv_cache_report_mode": "full"})
        return self.v.SamplingParams(max_tokens=max_tokens)

    def reannouncing(self, lookup, *args, **kwargs):
        """``lookup(*args, **kwargs)``, marking the stored events it queues: vLLM's event does not
        tell a hit announced again (``emit_cached_block_events``) from a store."""
        queue = getattr(self.pool, "kv_event_queue", None)
        before = len(queue) if queue is not None else 0
        result = lookup(*args, **kwargs)
        if queue is not None:
            self._reannounced.update((id(event), event) for event in queue[before:])
        return result

    # ---- requests ---------------------------------------------------------------------

    def vllm_request(self, request):
        """vLLM's request for ``request``, brought up to date with it."""
        rid = request.request_id
        vreq = self.requests.get(rid)
        if vreq is None:
            vreq = self.requests[rid] = self.v.Request(
                request_id=rid,
                prompt_token_ids=list(request.tokens[: request.num_prompt_tokens]),
                sampling_params=self.sampling_params(request.max_new_tokens),
                pooling_params=None,
                block_hasher=self.hasher,
            )
            self._named[rid] = 0
        grown = request.tokens[vreq.num_tokens :]
        if grown:
            vreq.append_output_token_ids(list(grown))
        vreq.num_computed_tokens = request.num_computed_tokens
        if hasattr(vreq, "shared_prefix_boundary"):  # 0.30.0 on: the scheduler's copy of the junction
            vreq.shared_prefix_boundary = request.shared_prefix_boundary
        self.name_hashes(request, vreq)
        return vreq

    def adopt(self, request, vreq) -> None:
        """Take ``vreq``, built elsewhere (for vLLM's scheduler), as ``request``'s vLLM request."""
        self.requests[request.request_id] = vreq
        self._named[request.request_id] = 0
        self.name_hashes(request, vreq)

    def name_hashes(self, request, vreq) -> None:
        """Record which kvprop hash each new vLLM block hash stands for (same hash unit, same index)."""
        rid, vllm_hashes, kvprop_hashes = request.request_id, vreq.block_hashes, request.unit_hashes
        done = self._named[rid]
        end = min(len(vllm_hashes), len(kvprop_hashes))
        for i in range(done, end):
            if self.config.enable_kv_cache_events:
                self.event_names[self.v.kvu.maybe_convert_block_hash(vllm_hashes[i])] = kvprop_hashes[i]
                self.vllm_hashes[kvprop_hashes[i]] = vllm_hashes[i]
            known = self.hash_names.setdefault(vllm_hashes[i], kvprop_hashes[i])
            if known != kvprop_hashes[i]:
                raise AssertionError(
                    f"target 'vllm': vLLM hash {vllm_hashes[i].hex()[:16]} of {rid!r} block {i} names kvprop hash "
                    f"{kvprop_hashes[i]} but was recorded for {known}: the two hash chains disagree"
                )
        self._named[rid] = max(done, end)

    # ---- manager-facade calls -----------------------------------------------------------

    def get_computed_blocks(self, request):
        result = self.reannouncing(self.manager.get_computed_blocks, self.vllm_request(request))
        # 0.30.0 on adds the shared-prefix junction; releases before have none (0)
        return Hits(result[0]), result[1], result[2] if len(result) > 2 else 0

    def allocate_slots(self, request, num_new_tokens: int, **kwargs):
        vreq = self.vllm_request(request)
        hits = kwargs.get("new_computed_blocks")
        if isinstance(hits, Hits):
            kwargs["new_computed_blocks"] = hits.vllm_blocks
        elif hits is not None and not isinstance(hits, self.v.KVCacheBlocks):
            raise TypeError(
                f"allocate_slots: new_computed_blocks must be what get_computed_blocks returned, got {hits!r}"
            )
        kwargs = call_kwargs("KVCacheManager.allocate_slots()", self._allocate_params, kwargs)
        return self.counting_evictions(self.manager.allocate_slots, vreq, num_new_tokens, **kwargs)

    def _count_evictions(self) -> bool:
        """Counts the evictions vLLM's pool makes inside ``counting_evictions`` as it makes them:
        the pool's own ``_maybe_evict_cached_block`` (0.23.0, 0.24.0 and 0.33.0 read), wrapped on this
        pool, adds one each time it returns True (it evicted a cached block). False where a
        release has no such method: the caller then compares the pool before and after."""
        evict = getattr(self.pool, "_maybe_evict_cached_block", None)
        if evict is None:
            return False

        def counted(block):
            evicted = evict(block)
            if evicted and self._counting:
                self.num_evictions += 1
            return evicted

        self.pool._maybe_evict_cached_block = counted
        return True

    def counting_evictions(self, allocate, *args, **kwargs):
        """``allocate(*args, **kwargs)``, counting the cached free blocks it took: vLLM reports no
        evictions. As they happen where the pool can be watched (``_count_evictions``); else the
        cached free blocks whose hash the call changed."""
        if self._evictions_counted:
            self._counting = True
            try:
                return allocate(*args, **kwargs)
            finally:
                self._counting = False
        blocks = self.pool.blocks
        before = {b.block_id: b.block_hash for b in blocks if b.ref_cnt == 0 and b.block_hash is not None}
        result = allocate(*args, **kwargs)
        self.num_evictions += sum(1 for b, h in before.items() if blocks[b].block_hash != h)
        return result

    def cache_blocks(self, request, num_computed_tokens: int) -> None:
        self.manager.cache_blocks(self.vllm_request(request), num_computed_tokens)

    def free(self, request) -> None:
        self.manager.free(self.vllm_request(request))

    def reset_prefix_cache(self) -> bool:
        return bool(self.manager.reset_prefix_cache())

    def new_step_starts(self) -> None:
        """Every release from 0.22.1 has it: its Mamba managers forget which states were cached
        in the last step (``Scheduler.schedule`` calls it first)."""
        self.manager.new_step_starts()

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple(list(ids) for ids in self.manager.get_block_ids(request_id))

    def take_kv_cache_block_copies(self) -> list[tuple[int, int]]:
        """vLLM's queued block copies (0.30.0 on; none before), each (source id, copy id), with
        the references that held both ends released as its scheduler releases them when it
        does not defer frees (``Scheduler._free_cow_retained_blocks``)."""
        take = getattr(self.manager, "take_kv_cache_block_copies", None)
        if take is None:
            return []
        copies, retained = take()
        if retained:
            self.pool.free_blocks(retained)
        return [(c.src_block_id, c.dst_block_id) for c in copies]

    def take_events(self) -> list:
        """vLLM's KV cache events since the last call, in kvprop's terms: one event per key
        (vLLM's stored event lists several hashes of one group). A hash never named stays
        visibly foreign, as in the view."""
        return self.translate_events(self.manager.take_events())

    def translate_events(self, events) -> list:
        """vLLM's KV cache events in kvprop's terms (``take_events``), each with the medium vLLM
        names (the block pool's "GPU", an offload tier's "CPU"; "GPU" where a release names none,
        as llm-d's router reads an event without one)."""
        ev = self.v.kv_events
        kinds = ((ev.BlockStored, Stored), (ev.BlockRemoved, Removed))
        out: list = []
        for event in events:
            if isinstance(event, ev.AllBlocksCleared):
                out.append(Cleared())
                continue
            kind: Any = next((ours for theirs, ours in kinds if isinstance(event, theirs)), None)
            if kind is None:
                raise TypeError(f"an unknown KV cache event from vLLM {self.v.version}: {event!r}")
            if self._reannounced.pop(id(event), None) is event:
                kind = Reannounced
            medium = getattr(event, "medium", None) or GPU
            for published in event.block_hashes:
                name = self.event_names.get(published)
                if name is None:  # an offload tier of 0.23.0 publishes the hash unconverted, and no group
                    name = self.hash_names.get(published, f"vllm:{published}")
                out.append(kind((name, getattr(event, "group_idx", None)), medium))
        return out
