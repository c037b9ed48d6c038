"""The worker side of vLLM's offloading connector, played by kvprop for ``--target vllm-scheduler``.

vLLM's ``OffloadingConnector`` decides, on the scheduler side, which blocks go to its CPU tier
and which come back; each step's ``OffloadingConnectorMetadata`` lists the jobs. This module
runs them against kvprop's paged memory and a CPU tier of its own (one row of slot values per
CPU block), so the data oracle sees exactly what a transfer moved and when: a store reads its
GPU blocks after the next step's pass unless the scheduler asks for a flush first, a load
writes its blocks when it completes. Completions go back the way the release reads them.
With KV cache events on, the tier's own events are collected where the scheduler publishes
them, and its manager's ``lookup`` answers invariant 17 (``kvprop.check.router``).
"""

from __future__ import annotations

import functools
import inspect
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import attrs

from kvprop.allocator.specs import EngineConfig

if TYPE_CHECKING:
    from kvprop.sim.engine import Hooks
    from kvprop.sim.memory import PagedMemory
    from kvprop.sim.request import Request


@attrs.define
class Transfer:
    """A job of vLLM's offloading connector the worker runs: a load (CPU blocks into the
    request's GPU blocks) or a store (GPU blocks out to CPU blocks), pair by pair; a CPU block
    is a (chunk, block within it) pair."""

    job_id: int
    request_id: str
    load: bool
    gpu: list  # (group, block id) per pair
    cpu: list  # (CPU chunk id, block within the chunk) per pair


def transfer_from(job_id: int, job, load: bool, blocks_per_chunk: int = 1) -> Transfer:
    """A job from the connector's metadata: ``transfer_spec`` (src, dst) up to 0.25.x,
    ``src_spec``/``dst_spec`` from 0.30.0; the GPU side lists each group's blocks in turn. With
    chunks of several blocks (0.30.0 on) a group's first GPU block may start inside its first
    chunk: the worker skips ``block_indices[g] % blocks_per_chunk`` blocks of it, and the group
    takes ``ceil((skip + n) / blocks_per_chunk)`` chunks of the CPU side in turn (0.34.0
    ``v1/kv_offload/pointer_utils.py``, ``iter_pointer_groups``; 0.30.0 ``cpu/gpu_worker.py``)."""
    src, dst = job.transfer_spec if hasattr(job, "transfer_spec") else (job.src_spec, job.dst_spec)
    gpu_spec, cpu_spec = (dst, src) if load else (src, dst)
    gpu_ids, chunk_ids = [int(b) for b in gpu_spec.block_ids], [int(b) for b in cpu_spec.block_ids]
    sizes = list(getattr(gpu_spec, "group_sizes", None) or [len(gpu_ids)])
    firsts = list(gpu_spec.block_indices) if blocks_per_chunk > 1 else [0] * len(sizes)  # chunks: 0.30.0 on
    gpu, cpu, start, taken = [], [], 0, 0
    for group, (size, first) in enumerate(zip(sizes, firsts, strict=True)):
        if size == 0:
            continue
        skip = first % blocks_per_chunk
        for j, block in enumerate(gpu_ids[start : start + size]):
            gpu.append((group, block))
            cpu.append((chunk_ids[taken + (skip + j) // blocks_per_chunk], (skip + j) % blocks_per_chunk))
        start, taken = start + size, taken + -(-(skip + size) // blocks_per_chunk)
    if (start, taken) != (len(gpu_ids), len(chunk_ids)):
        raise NotImplementedError(
            f"a transfer of {len(gpu_ids)} GPU blocks over {len(chunk_ids)} chunks of {blocks_per_chunk}, "
            f"which its groups ({sizes}, from {firsts}) do not account for"
        )
    return Transfer(job_id, job.req_id, load, gpu, cpu)


@attrs.frozen
class OffloadTier:
    """vLLM's CPU tier as invariant 17 asks it (``kvprop.check.router``): a key is held where
    the connector's manager's own ``lookup`` finds it ready (``LookupResult.HIT``, True before
    0.34.0). ``names`` gives each kvprop block hash vLLM's (``VllmAllocator.vllm_hashes``)."""

    manager: Any  # the connector's OffloadingManager
    names: dict
    publishes: bool  # the manager queues events: the scheduler publishes the tier's keys
    counting: bool  # a lookup counts as an access (store_threshold), which a check must not make

    def holds(self, key) -> bool | None:
        from vllm.v1.kv_offload.base import ReqContext, make_offload_key

        block_hash = self.names.get(key[0])
        if block_hash is None or key[1] is None or self.counting:
            return None  # a hash kvprop never named, an event that names no group, or a counting lookup
        found = self.manager.lookup(make_offload_key(block_hash, key[1]), ReqContext(req_id="kvprop-router"))
        return found is True or getattr(found, "name", None) == "HIT"


class OffloadWorker:
    """Engine mixin: the worker's transfers and its CPU tier."""

    # what it reads of the engine it is mixed into (kvprop's engine with vLLM's scheduler in charge)
    config: EngineConfig
    specs: tuple
    block_size: int
    hooks: Hooks
    memory: PagedMemory
    requests: dict[str, Request]
    loading: dict[str, Request]
    scheduler: Any  # vLLM's Scheduler
    s: SimpleNamespace  # vLLM's scheduler API (loading.import_scheduler)
    allocator: Any  # VllmAllocator
    _events: list  # what the scheduler publishes, in order
    _offload_tier: OffloadTier | None

    def _init_transfers(self) -> None:
        self.offloaded: dict[tuple[int, int], list[int]] = {}  # (chunk, block in it) -> the GPU block's slots
        self.transfers: dict[int, Transfer] = {}  # job id -> a transfer in flight
        self.stores_due: list[int] = []  # store jobs that complete after the next forward pass
        self.stored_early: set[int] = set()  # store jobs a flush in their own step ran before the pass
        self.done: dict = self._nothing_done()  # for the next output

    # ---- the tier's KV cache events -------------------------------------------------------

    def _observe_tier_events(self) -> None:
        """Find the tier's lookup, and collect its KV cache events where the scheduler publishes
        them: after the manager's, ``update_from_output`` publishes ``connector.take_events()`` in
        the same batch. The connector's ``take_events`` is wrapped, calling through."""
        connector = self.scheduler.connector
        self._real_tier_events = None
        self._offload_tier = self._find_offload_tier()
        if connector is None or not self.config.allocator.enable_kv_cache_events:
            return
        real = self._real_tier_events = connector.take_events

        def take_events():
            events = list(real())
            self._events.extend(events)
            return events

        connector.take_events = take_events

    def pending_tier_events(self) -> list:
        """The tier's events not published yet (an operation between steps made them)."""
        return list(self._real_tier_events()) if self._real_tier_events is not None else []

    def offload_tier(self) -> OffloadTier | None:
        """The tier's own lookup, for invariant 17 (asked at every drain of the events)."""
        return self._offload_tier

    def _find_offload_tier(self) -> OffloadTier | None:
        """The tier's lookup, found once: None without vLLM's offloading connector or with a
        release whose tier keys its blocks otherwise."""
        connector = self.scheduler.connector
        manager = getattr(getattr(connector, "connector_scheduler", None), "manager", None)
        if manager is None:
            return None
        try:
            from vllm.v1.kv_offload.base import ReqContext, make_offload_key  # noqa: F401
        except ImportError:
            return None
        return OffloadTier(
            manager,
            self.allocator.vllm_hashes,
            publishes=getattr(manager, "events", None) is not None,
            counting=getattr(manager, "counts", None) is not None,
        )

    @staticmethod
    def _nothing_done() -> dict:
        return {"jobs": set(), "recving": set(), "failed": set(), "failed_jobs": set()}

    def _start_transfers(self, meta) -> None:
        """As the batch is launched: flush the stores a reused block still owes, take the new
        loads (run at once with connector "sync"). A flush may name a store not yet issued to
        the worker, which it flushes before this batch's pass (``_before_pass``)."""
        self._flush(meta)
        for job_id, job in meta.load_jobs.items():
            self.transfers[job_id] = self._transfer(job_id, job, load=True)
            if self.config.connector == "sync":
                self.finish_load(job.req_id, ok=True)

    def _transfer(self, job_id: int, job, load: bool) -> Transfer:
        """A job of the connector's metadata, in the tier's chunks (``EngineConfig.tier_chunk``)."""
        return transfer_from(job_id, job, load, self.config.tier_chunk)

    def _before_pass(self, meta) -> None:
        """Just before the batch's pass, where vLLM's worker flushes (``handle_preemptions``, in
        batch order): the stores its flush names that batches launched earlier issued since."""
        if meta is not None:
            self._flush(meta)

    def _flush(self, meta) -> None:
        """Run every store ``meta``'s flush names that the worker holds, before a pass overwrites
        its blocks. A flush may name a store of this same step: from 0.30.0 the worker submits it
        at once (``handle_preemptions`` pops it from ``store_jobs``; vLLM's scheduler flushes every
        job on its last step, PR #42611); before, it waits only for the stores already submitted."""
        for job_id in getattr(meta, "jobs_to_flush", None) or ():
            if job_id in meta.store_jobs and job_id not in self.stored_early and self.stores_flushed_in_their_step:
                self.transfers[job_id] = self._transfer(job_id, meta.store_jobs[job_id], load=False)
                self.stored_early.add(job_id)
            if job_id in self.transfers and not self.transfers[job_id].load:
                self._complete(job_id)

    def _after_pass(self, meta, due: list[int]) -> None:
        """After the pass: the stores issued a step ago read their blocks; this step's wait."""
        for job_id in due:
            self._complete(job_id)
        for job_id, job in meta.store_jobs.items() if meta is not None else ():
            if job_id in self.stored_early:
                self.stored_early.discard(job_id)
                continue
            self.transfers[job_id] = self._transfer(job_id, job, load=False)
            self.stores_due.append(job_id)

    def _complete(self, job_id: int, ok: bool = True) -> None:
        """Run transfer ``job_id`` now (a store reads its GPU blocks, a load writes them) and report
        it with the next output. A failed load writes nothing and is reported as the release's
        worker reports it (``reports_failed_requests``)."""
        transfer = self.transfers.pop(job_id, None)
        if transfer is None:
            return
        bs = self.block_size
        if transfer.load and ok:
            request = self.requests.get(transfer.request_id)
            if request is not None:
                self.hooks.before_load_write(self, request, transfer.gpu)
            slots: list[int] = []
            values: list[int] = []
            for (_, block), cpu in zip(transfer.gpu, transfer.cpu, strict=True):
                slots.extend(range(block * bs, (block + 1) * bs))
                values.extend(self.offloaded.get(cpu, [-1] * bs))
            self.memory.write(slots, values)
        elif transfer.load:  # failed: only where the worker reports it (fails_loads)
            self.done["failed"].add(transfer.request_id)
            self.done["failed_jobs"].add(job_id)
        else:
            for (_, block), cpu in zip(transfer.gpu, transfer.cpu, strict=True):
                self.offloaded[cpu] = self.memory.row(block)
        self.done["jobs"].add(job_id)
        if transfer.load:
            self.done["recving"].add(transfer.request_id)

    def _connector_output(self):
        """What the worker reports: the jobs completed since the last output, the requests whose
        loads finished, and, from 0.34.0, the failed loads' requests and jobs; never invalid
        blocks, which the offloading worker does not report in any release."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata

        done, self.done = self.done, self._nothing_done()
        failures = {"failed_jobs": done["failed_jobs"]} if self.reports_failed_requests else {}
        return self.s.KVConnectorOutput(
            finished_recving=done["recving"] or None,
            kv_connector_worker_meta=OffloadingWorkerMetadata(
                completed_jobs=dict.fromkeys(done["jobs"], 1), **failures
            ),
            invalid_block_ids=set(),
            **({"failed_recving": done["failed"]} if self.reports_failed_requests else {}),
        )

    @functools.cached_property
    def reports_failed_requests(self) -> bool:
        """Whether the release's offloading worker reports a failed load by its request: from
        0.34.0 it marks the job failed (``OffloadingWorkerMetadata.failed_jobs``, so the
        connector never looks that request up in its tier again) and names the request in
        ``failed_recving`` as well as in ``finished_recving``; the scheduler then recomputes the
        whole request (``_handle_failed_recving``: computed count 0, its blocks freed) or ends
        it, by its policy, with any number of groups. Before, the worker asserted that every
        transfer succeeded (``fails_loads``)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata

        return "failed_jobs" in inspect.signature(OffloadingWorkerMetadata).parameters

    @functools.cached_property
    def stores_flushed_in_their_step(self) -> bool:
        """Whether the release's worker runs a store that a flush of its own step names before the
        pass (0.30.0 on: ``OffloadingConnectorWorker.handle_preemptions`` moves it from
        ``store_jobs`` to the stores it submits and waits for); before, only submitted stores are
        waited for, and such a store reads its blocks after the pass, as it does here then."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker

        return "store_jobs.pop" in inspect.getsource(OffloadingConnectorWorker.handle_preemptions)

    @functools.cached_property
    def fails_loads(self) -> bool:
        """Whether a load may fail: only where the release's offloading worker reports a failed
        load, by its request, from 0.34.0 (``reports_failed_requests``). Before, the worker asserts
        that every transfer succeeded (0.24.0 ``offloading/worker.py``: ``assert success``, "we
        currently do not support job failures"), so a failed load is no input this connector's
        scheduler side can receive: kvprop's worker fails none. The block-level recovery of
        connectors whose workers report invalid blocks (NIXL and others) is not driven here."""
        return self.reports_failed_requests

    def finish_load(self, request_id: str, ok: bool) -> None:
        """The worker's load for ``request_id`` completes (``ok``) or fails; vLLM hears of it with
        the next step's output. Nothing happens for a load already completed and not yet seen."""
        from kvprop.errors import RequestError

        if request_id not in self.loading:
            raise RequestError(f"finish_load: no load in flight for {request_id!r}; in flight: {sorted(self.loading)}")
        if not ok and not self.fails_loads:
            return
        for job_id, transfer in list(self.transfers.items()):
            if transfer.load and transfer.request_id == request_id:
                self._complete(job_id, ok)
