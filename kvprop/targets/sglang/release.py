"""Where the SGLang releases kvprop drives (0.5.18 to 0.5.23) differ for the scheduler glue.

``Release`` is a set of independent facets, each read from the installed release: from the
function, class attribute, signature parameter or dataclass field SGLang added or removed
(``Release.of``), or from the version where the change is in a method body or in attributes a
constructor sets, which no API tells apart. Each facet names the file and the release that
changed it. The methods below build SGLang's objects and read a request's KV fields as the
installed release spells them, and make the calls its ``Scheduler`` makes
(``managers/scheduler.py``, ``scheduler_components/*``, ``mem_cache/common.py``). Every other
line of the glue is the same in every release.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect

import attrs


def ceil_align(n: int, page: int) -> int:
    return -(-n // page) * page


def _has(owner, name: str) -> bool:
    """Whether the installed release's module or class defines ``name``."""
    return hasattr(owner, name)


def _params(fn) -> set[str]:
    return set(inspect.signature(fn).parameters)


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


@attrs.frozen
class Release:
    version: str
    release: tuple[int, int, int]
    # ---- a request's KV state (managers/schedule_batch.py)
    kv_record_lifelong: bool  # 0.5.19: ReqKvInfo holds req_pool_idx / cache_protected_len / holds_kv and
    #   Req.kv lives with the request; 0.5.18 keeps the row and protected length on Req, kv None when unheld
    fill_cursors: bool  # 0.5.22: Req.prefix_len / Req.extend_end replace prefix_indices / extend_range
    tree_lock: bool  # 0.5.22: Req.lock (mem_cache/base_prefix_cache.py TreeLock) replaces Req.last_node
    evicted_seqlen_by_component: bool  # 0.5.21: ReqKvInfo.get_evicted_seqlen(SWA) replaces swa_evicted_seqlen
    private_swa_helper: bool  # 0.5.22: pool_stats_observer.kv_private_swa_tokens (window-freed pages)
    counts_swa_transient: bool  # 0.5.20: BasePrefixCache.swa_transient_size, counted by the invariant checker
    # ---- the tree at a request's turns (mem_cache/common.py, Scheduler)
    checkpoint_api: bool  # 0.5.22: checkpoint_kv_cache / release_kv_cache(checkpoint=) replace
    #   maybe_cache_unfinished_req / release_kv_cache(is_insert=)
    aborts_finish_handle: bool  # 0.5.20: Scheduler._release_aborted_request, tree.finish(handle, ABORT)
    abort_releases_mm_inputs: bool  # 0.5.22: _release_aborted_request first calls Req.release_mm_inputs_on_abort
    chunk_abort_reason_on_req: bool  # 0.5.22: process_pending_chunked_abort aborts with req.discard_output_reason
    chunk_abort_redispatch: bool  # 0.5.20: process_pending_chunked_abort re-aborts a request that left the chunk
    evict_for_alloc: bool  # 0.5.19: BasePrefixCache.evict_for_alloc, the allocators' eviction entry point
    # ---- batches (managers/schedule_batch.py, Scheduler.get_next_batch_to_run / update_running_batch)
    exclude_keyword: str  # 0.5.22: ScheduleBatch.filter_batch(reqs_to_exclude=), chunked_req_to_exclude before
    filters_running_each_step: bool  # 0.5.23: get_next_batch_to_run filters the running batch every step
    retract_takes_server_args: bool  # 0.5.19: retract_decode() / release_req(idx, n) -> bool drop server_args
    # ---- admission (Scheduler._get_new_batch_prefill_raw, managers/schedule_policy.py)
    priority_takes_processed_tokens: bool  # 0.5.20: SchedulePolicy.calc_priority(..., processed_tokens=)
    chunk_limit: bool  # 0.5.21: SchedulePolicy.shortest_prefill_chunk_limit sets adder.chunked_req_limit
    empty_running_clears_full: bool  # 0.5.22: an empty running batch clears batch_is_full first
    no_token_full_only_with_work: bool  # 0.5.22: NO_TOKEN marks the batch full only when work remains
    budget_gate: bool  # 0.5.23: the admission loop stops on budget_state() OTHER and counts held rows
    allocator_budget: bool  # 0.5.21: init_req_max_new_tokens asks allocator.max_new_tokens_for_memory
    # ---- construction and checks
    paged_torch_path: bool  # 0.5.22: mem_cache/allocator/paged.py takes alloc_*_naive where Triton is absent
    triton_by_platform: bool  # 0.5.22: utils/common.py support_triton consults the platform
    swa_allocator_takes_req_pool: bool  # 0.5.20: SWATokenToKVPoolAllocator(req_to_token_pool=)
    tree_core_selector: str  # "none" (0.5.18: Python core only), "env" (0.5.19:
    #   SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND read by UnifiedRadixCache), "params" (0.5.21:
    #   CacheInitParams.tree_core_backend)
    tree_context_takes_chunk_size: bool  # until 0.5.21: TreeCacheBuildContext.effective_chunked_prefill_size
    observer_reads_batches: bool  # until 0.5.21: SchedulerPoolStatsObserver(get_last_batch=, get_running_batch=)
    checker_reads_chunked_req: bool  # 0.5.20: SchedulerInvariantChecker(get_chunked_req=, scheduler_stage_metrics=)
    byte_accounting: bool  # 0.5.19: on_idle also runs allocator.verify_byte_accounting()
    aux_cache_allocator: bool  # 0.5.19: flush_cache also runs req_to_token_pool.reset_aux_cache_allocator()

    @classmethod
    def of(cls, sg) -> Release:
        at = sg.release
        if importlib.util.find_spec("sglang.srt.mem_cache.rust_tree_core") is None:
            selector = "none"
        else:
            selector = "params" if "tree_core_backend" in _fields(sg.CacheInitParams) else "env"
        return cls(
            version=sg.version,
            release=at,
            kv_record_lifelong=_has(sg.ReqKvInfo, "holds_kv"),
            fill_cursors=at >= (0, 5, 22),
            tree_lock=_has(sg.base_prefix_cache, "TreeLock"),
            evicted_seqlen_by_component=_has(sg.ReqKvInfo, "get_evicted_seqlen"),
            private_swa_helper=_has(sg.pool_stats_observer, "kv_private_swa_tokens"),
            counts_swa_transient=_has(sg.base_prefix_cache.BasePrefixCache, "swa_transient_size"),
            checkpoint_api=_has(sg.common, "checkpoint_kv_cache"),
            aborts_finish_handle=_has(sg.base_prefix_cache, "CacheRequestOutcome"),
            abort_releases_mm_inputs=_has(sg.Req, "release_mm_inputs_on_abort"),
            chunk_abort_reason_on_req=at >= (0, 5, 22),
            chunk_abort_redispatch=at >= (0, 5, 20),
            evict_for_alloc=_has(sg.base_prefix_cache.BasePrefixCache, "evict_for_alloc"),
            exclude_keyword=next(
                k for k in ("reqs_to_exclude", "chunked_req_to_exclude") if k in _params(sg.ScheduleBatch.filter_batch)
            ),
            filters_running_each_step=at >= (0, 5, 23),
            retract_takes_server_args="server_args" in _params(sg.ScheduleBatch.release_req),
            priority_takes_processed_tokens="processed_tokens" in _params(sg.SchedulePolicy.calc_priority),
            chunk_limit=_has(sg.SchedulePolicy, "shortest_prefill_chunk_limit"),
            empty_running_clears_full=at >= (0, 5, 22),
            no_token_full_only_with_work=at >= (0, 5, 22),
            budget_gate=at >= (0, 5, 23),
            allocator_budget=_has(sg.TokenToKVPoolAllocator, "max_new_tokens_for_memory"),
            paged_torch_path=_has(sg.paged, "alloc_decode_naive"),
            triton_by_platform=at >= (0, 5, 22),
            swa_allocator_takes_req_pool="req_to_token_pool" in _params(sg.SWATokenToKVPoolAllocator.__init__),
            tree_core_selector=selector,
            tree_context_takes_chunk_size="effective_chunked_prefill_size" in _fields(sg.TreeCacheBuildContext),
            observer_reads_batches="get_last_batch" in _fields(sg.SchedulerPoolStatsObserver),
            checker_reads_chunked_req="get_chunked_req" in _fields(sg.SchedulerInvariantChecker),
            byte_accounting=_has(sg.TokenToKVPoolAllocator, "verify_byte_accounting"),
            aux_cache_allocator=_has(sg.ReqToTokenPool, "reset_aux_cache_allocator"),
        )

    # ---- construction --------------------------------------------------------------
    def server_fields(self, config) -> dict:
        """``attention_backend="torch_native"`` makes ``support_triton(backend)`` False, so
        ``alloc_for_extend`` writes the req_to_token rows with SGLang's own torch loop
        (``write_cache_indices``) and ``get_last_loc`` takes ``get_last_loc_torch``; a release whose
        ``support_triton`` consults the platform takes those paths on a CPU by itself."""
        fields = dict(
            page_size=config.page_size,
            chunked_prefill_size=config.chunked_prefill_size,
            schedule_policy=config.schedule_policy,
            device="cpu",
        )
        if not self.triton_by_platform:
            fields["attention_backend"] = "torch_native"
        return fields

    def prepare(self, config) -> None:
        """A paged allocator without a torch path launches Triton kernels: point it at ``cpu_kernels``."""
        if not self.paged_torch_path and config.page_size > 1:
            from kvprop.targets.sglang import cpu_kernels

            cpu_kernels.install()

    def max_new_tokens(self, allocator, config, input_len: int, max_new_tokens: int) -> int:
        """``Scheduler.init_req_max_new_tokens`` (no ``SGLANG_MAX_NEW_TOKENS_LIMIT``, one KV
        shard): a request's generation clipped so that it can be scheduled at all. Every release
        clips to ``max_req_len - input_len - 1``; before the allocator budget, then to the pool
        less the paged prompt, a page and one ("Otherwise a request can be accepted into the
        waiting queue but can never be scheduled, blocking the queue"), with it through the
        allocator's own ``max_new_tokens_for_memory`` (the same budget, per allocator)."""
        clipped = max(0, min(max_new_tokens, self.max_req_len(config) - input_len - 1))
        if not self.allocator_budget:
            room = config.pool_tokens - ceil_align(input_len, config.page_size) - config.page_size - 1
            return max(0, min(clipped, room))
        budget = allocator.max_new_tokens_for_memory(
            input_len,
            clipped,
            token_capacity=config.pool_tokens,
            sliding_window_size=config.sliding_window,
            chunk_size=config.chunked_prefill_size,
        )
        return -1 if budget is None else max(0, budget)

    @staticmethod
    def max_req_len(config) -> int:
        """``TpModelWorker``'s ``max_req_len``: min(context length - 1, KV capacity - 1)
        (``managers/tp_worker.py``, every release); the longest prompt it takes is 5 less
        (``max_req_input_len``, checked by ``validate_input_length`` in ``managers/utils.py``)."""
        return min(config.max_context_len - 1, config.pool_tokens - 1)

    def swa_allocator_kwargs(self, req_to_token_pool) -> dict:
        return {"req_to_token_pool": req_to_token_pool} if self.swa_allocator_takes_req_pool else {}

    def cache_params_kwargs(self, config) -> dict:
        return {"tree_core_backend": config.tree_core} if self.tree_core_selector == "params" else {}

    def create_tree_cache(self, sg, context, config):
        """``create_tree_cache``; where SGLang's environment chooses the tree core
        (``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND``, read as ``UnifiedRadixCache`` is built), it
        is set to ``tree_core`` for the build only."""
        if self.tree_core_selector != "env":
            return sg.create_tree_cache(context)
        with sg.envs.SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND.override(config.tree_core):
            return sg.create_tree_cache(context)

    def tree_context_kwargs(self, config) -> dict:
        return (
            {"effective_chunked_prefill_size": config.chunked_prefill_size}
            if self.tree_context_takes_chunk_size
            else {}
        )

    def observer_kwargs(self, sched) -> dict:
        if self.observer_reads_batches:
            return {"get_last_batch": lambda: sched.last_batch, "get_running_batch": lambda: sched.running_batch}
        return {}

    def checker_kwargs(self, sched) -> dict:
        if not self.checker_reads_chunked_req:
            return {}
        from sglang.srt.observability.scheduler_stage_metrics import SchedulerStageMetricsRecorder

        return {
            "get_chunked_req": lambda: sched.chunked_req,
            "scheduler_stage_metrics": SchedulerStageMetricsRecorder(enabled=False),
        }

    # ---- a request's KV fields -------------------------------------------------------
    def holds_kv(self, req) -> bool:
        return req.kv.holds_kv if self.kv_record_lifelong else req.kv is not None

    def req_pool_idx(self, req):
        return req.kv.req_pool_idx if self.kv_record_lifelong else req.req_pool_idx

    def cache_protected_len(self, req) -> int:
        return req.kv.cache_protected_len if self.kv_record_lifelong else req.cache_protected_len

    def prefix_len(self, req) -> int:
        return req.prefix_len if self.fill_cursors else len(req.prefix_indices)

    def extend_end(self, req) -> int:
        return req.extend_end if self.fill_cursors else req.extend_range.end

    def locked_node(self, req):
        """The tree node a request's admission lock is on, or None when it holds none."""
        if self.tree_lock:
            return req.lock.node if req.lock is not None else None
        return req.last_node if self.holds_kv(req) else None

    def swa_private_tokens(self, req, tree, page_size: int) -> int:
        """SWA slots a live request holds outside the tree: what
        ``SchedulerInvariantChecker._get_total_uncached_sizes`` counts (allocated minus
        ``max(cache_protected_len, evicted)``; 0.5.22 on ``kv_private_swa_tokens``)."""
        if self.private_swa_helper:
            from sglang.srt.managers.scheduler_components.pool_stats_observer import kv_private_swa_tokens

            return kv_private_swa_tokens(req.kv, page_size)
        if self.evicted_seqlen_by_component:
            from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

            evicted = req.kv.get_evicted_seqlen(ComponentType.SWA)
        else:
            evicted = req.kv.swa_evicted_seqlen
        return ceil_align(req.kv.kv_allocated_len, page_size) - max(self.cache_protected_len(req), evicted)

    def swa_transient(self, tree) -> int:
        """SWA slots the tree holds for in-flight work (``swa_transient_size``)."""
        return tree.swa_transient_size() if self.counts_swa_transient else 0

    # ---- tree calls at a request's turns -------------------------------------------
    def cache_unfinished(self, sg, req, tree, *, chunked: bool) -> None:
        """After a chunk (``Scheduler.stash_chunked_request``) or a first token
        (``process_batch_result_prefill``): insert what is computed and move the lock."""
        if self.checkpoint_api:
            sg.common.checkpoint_kv_cache(req, tree)
        elif chunked:
            sg.common.maybe_cache_unfinished_req(req, tree, chunked=True)
        else:
            sg.common.maybe_cache_unfinished_req(req, tree)

    def release_finished(self, sg, req, tree) -> None:
        """A finished request: ``release_kv_cache`` inserting what it computed."""
        if self.checkpoint_api:
            sg.common.release_kv_cache(req, tree, checkpoint=True)
        else:
            sg.common.release_kv_cache(req, tree)

    def release_aborted(self, sg, req, tree) -> None:
        """``Scheduler._release_aborted_request``: the tree's per-request handle is finished as
        aborted (nothing tree-side before it, without hierarchical storage)."""
        if not self.aborts_finish_handle:
            return
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestOutcome

        if self.abort_releases_mm_inputs:
            req.release_mm_inputs_on_abort()
        tree.finish(req.cache_request_handle, CacheRequestOutcome.ABORT)

    def release_chunk_abort(self, sg, req, tree) -> None:
        """``Scheduler.process_pending_chunked_abort``: release without inserting."""
        if self.chunk_abort_reason_on_req:
            reason = req.discard_output_reason or sg.FINISH_ABORT("Aborted")
            sg.prepare_abort(req, reason.message, reason.status_code)
        else:
            sg.prepare_abort(req, "Aborted")
        req.to_finish = None
        self.release_aborted(sg, req, tree)
        if self.checkpoint_api:
            sg.common.release_kv_cache(req, tree, checkpoint=False)
        else:
            sg.common.release_kv_cache(req, tree, is_insert=False)

    # ---- batch calls -----------------------------------------------------------------
    def filter_batch(self, batch, exclude) -> None:
        batch.filter_batch(**{self.exclude_keyword: list(exclude)})

    def retract_decode(self, batch, server_args):
        return batch.retract_decode(server_args) if self.retract_takes_server_args else batch.retract_decode()

    def release_req(self, batch, idx: int, remaining: int, server_args) -> bool:
        """``ScheduleBatch.release_req``: True when the request can resume (returned from 0.5.19;
        0.5.18 always retracts)."""
        if self.retract_takes_server_args:
            batch.release_req(idx, remaining, server_args)
            return True
        return bool(batch.release_req(idx, remaining))

    def calc_priority(self, policy, queue, batch) -> None:
        if self.priority_takes_processed_tokens:
            policy.calc_priority(queue, batch, processed_tokens=0)
        else:
            policy.calc_priority(queue, batch)

    def limit_chunk(self, adder, policy, chunked_req, queue, page_size: int) -> None:
        """``adder.chunked_req_limit`` from ``SchedulePolicy.shortest_prefill_chunk_limit``."""
        if self.chunk_limit:
            adder.chunked_req_limit = policy.shortest_prefill_chunk_limit(
                chunked_req, queue, adder.rem_chunk_tokens or 0, page_size
            )

    def budget_exhausted(self, sg, adder) -> bool:
        """The admission loop stops once ``adder.budget_state()`` says OTHER."""
        return self.budget_gate and adder.budget_state() == sg.AddReqResult.OTHER

    def held_rows(self, adder) -> int:
        """``get_num_allocatable_reqs(num_held_rows=)``: rows the admitted requests already hold."""
        return sum(r.kv.holds_kv for r in adder.can_run_list) if self.budget_gate else 0

    def full_after_no_token(self, adder, running_batch) -> bool:
        if self.no_token_full_only_with_work:
            return len(adder.can_run_list) > 0 or not running_batch.is_empty()
        return True

    def verify_bytes(self, allocator) -> list:
        """``on_idle``'s ``allocator.verify_byte_accounting()``."""
        return list(allocator.verify_byte_accounting()) if self.byte_accounting else []

    def flush(self, sched) -> None:
        """``Scheduler.flush_cache``'s pool resets."""
        sched.tree_cache.reset()
        sched.req_to_token_pool.clear()
        sched.allocator.clear()
        if self.aux_cache_allocator:
            sched.req_to_token_pool.reset_aux_cache_allocator()
