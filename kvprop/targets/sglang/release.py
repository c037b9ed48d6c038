"""Where SGLang 0.5.18 and 0.5.23 differ for the scheduler glue, in one place keyed by release.

``Release.legacy`` is True for the 0.5.18 shape: the tree is released through
``cache_finished_req`` / ``cache_unfinished_req`` (``mem_cache/common.py``: ``release_kv_cache(req,
tree, is_insert)``, ``maybe_cache_unfinished_req``), a request's KV record ``req.kv`` exists only
while it holds a row, and ``req.last_node`` is the node its lock is on. The 0.5.23 shape
releases through ``checkpoint_kv_cache`` / ``release_kv_cache(req, tree, checkpoint=)`` and
``tree.finish``, keeps ``req.kv`` for the request's life and holds its lock as ``req.lock``
(``TreeLock``). Releases between them take the shape whose API they ship (``checkpoint_kv_cache``
present or not). Every other line of the glue is the same in both.
"""

from __future__ import annotations

import attrs


def ceil_align(n: int, page: int) -> int:
    return -(-n // page) * page


@attrs.frozen
class Release:
    version: str
    legacy: bool

    @classmethod
    def of(cls, sg) -> Release:
        return cls(version=sg.version, legacy=not hasattr(sg.common, "checkpoint_kv_cache"))

    # ---- construction --------------------------------------------------------------
    def server_fields(self, config) -> dict:
        """0.5.18: ``attention_backend="torch_native"`` makes ``support_triton(backend)`` False, so
        ``alloc_for_extend`` writes the req_to_token rows with SGLang's own torch loop
        (``write_cache_indices``) and ``get_last_loc`` takes ``get_last_loc_torch``. 0.5.23 takes
        those paths on a CPU platform by itself."""
        fields = dict(
            page_size=config.page_size,
            chunked_prefill_size=config.chunked_prefill_size,
            schedule_policy=config.schedule_policy,
            device="cpu",
        )
        if self.legacy:
            fields["attention_backend"] = "torch_native"
        return fields

    def prepare(self, config) -> None:
        """0.5.18's paged allocator launches Triton kernels: point it at ``cpu_kernels``."""
        if self.legacy and config.page_size > 1:
            from kvprop.targets.sglang import cpu_kernels

            cpu_kernels.install()

    def max_new_tokens(self, allocator, config, input_len: int, max_new_tokens: int) -> int:
        """``Scheduler.init_req_max_new_tokens`` (no ``SGLANG_MAX_NEW_TOKENS_LIMIT``, one KV
        shard): a request's generation clipped so that it can be scheduled at all. Both releases
        clip to ``max_req_len - input_len - 1``; 0.5.18 then to the pool less the paged prompt,
        a page and one ("Otherwise a request can be accepted into the waiting queue but can never
        be scheduled, blocking the queue", ``managers/scheduler.py``), 0.5.23 through the
        allocator's own ``max_new_tokens_for_memory`` (the same budget, per allocator)."""
        clipped = max(0, min(max_new_tokens, self.max_req_len(config) - input_len - 1))
        if self.legacy:
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
        (``managers/tp_worker.py``, both releases); the longest prompt it takes is 5 less
        (``max_req_input_len``, checked by ``validate_input_length`` in ``managers/utils.py``)."""
        return min(config.max_context_len - 1, config.pool_tokens - 1)

    def swa_allocator_kwargs(self, req_to_token_pool) -> dict:
        return {} if self.legacy else {"req_to_token_pool": req_to_token_pool}

    def cache_params_kwargs(self, config) -> dict:
        """0.5.19 on: the tree core (``tree_core_backend``, Rust by default) per cache."""
        return {} if self.legacy else {"tree_core_backend": config.tree_core}

    def tree_context_kwargs(self, config) -> dict:
        return {"effective_chunked_prefill_size": config.chunked_prefill_size} if self.legacy else {}

    def observer_kwargs(self, sched) -> dict:
        if self.legacy:
            return {"get_last_batch": lambda: sched.last_batch, "get_running_batch": lambda: sched.running_batch}
        return {}

    def checker_kwargs(self, sched) -> dict:
        if self.legacy:
            return {}
        from sglang.srt.observability.scheduler_stage_metrics import SchedulerStageMetricsRecorder

        return {
            "get_chunked_req": lambda: sched.chunked_req,
            "scheduler_stage_metrics": SchedulerStageMetricsRecorder(enabled=False),
        }

    # ---- a request's KV fields -------------------------------------------------------
    def holds_kv(self, req) -> bool:
        return req.kv is not None if self.legacy else req.kv.holds_kv

    def req_pool_idx(self, req):
        return req.req_pool_idx if self.legacy else req.kv.req_pool_idx

    def cache_protected_len(self, req) -> int:
        return req.cache_protected_len if self.legacy else req.kv.cache_protected_len

    def prefix_len(self, req) -> int:
        return len(req.prefix_indices) if self.legacy else req.prefix_len

    def extend_end(self, req) -> int:
        return req.extend_range.end if self.legacy else req.extend_end

    def locked_node(self, req):
        """The tree node a request's admission lock is on, or None when it holds none."""
        if self.legacy:
            return req.last_node if req.kv is not None else None
        return req.lock.node if req.lock is not None else None

    def swa_private_tokens(self, req, tree, page_size: int) -> int:
        """SWA slots a live request holds outside the tree: what
        ``SchedulerInvariantChecker._get_total_uncached_sizes`` counts (0.5.18: allocated minus
        ``max(cache_protected_len, swa_evicted_seqlen)``; 0.5.23: ``kv_private_swa_tokens``)."""
        allocated = ceil_align(req.kv.kv_allocated_len, page_size)
        if self.legacy:
            return allocated - max(req.cache_protected_len, req.kv.swa_evicted_seqlen)
        from sglang.srt.managers.scheduler_components.pool_stats_observer import kv_private_swa_tokens

        return kv_private_swa_tokens(req.kv, page_size)

    def swa_transient(self, tree) -> int:
        """0.5.23 counts SWA slots the tree holds for in-flight work (``swa_transient_size``)."""
        return 0 if self.legacy else tree.swa_transient_size()

    # ---- tree calls at a request's turns -------------------------------------------
    def cache_unfinished(self, sg, req, tree, *, chunked: bool) -> None:
        """After a chunk or a first token: ``maybe_cache_unfinished_req`` (0.5.18) /
        ``checkpoint_kv_cache`` (0.5.23) insert what is computed and move the lock."""
        if self.legacy:
            sg.common.maybe_cache_unfinished_req(req, tree, chunked=chunked)
        else:
            sg.common.checkpoint_kv_cache(req, tree)

    def release_finished(self, sg, req, tree) -> None:
        """A finished request: ``release_kv_cache`` inserting what it computed."""
        if self.legacy:
            sg.common.release_kv_cache(req, tree)
        else:
            sg.common.release_kv_cache(req, tree, checkpoint=True)

    def release_aborted(self, sg, req, tree) -> None:
        """``Scheduler._release_aborted_request`` (0.5.23; nothing in 0.5.18): the tree's
        per-request handle is finished as aborted."""
        if not self.legacy:
            from sglang.srt.mem_cache.base_prefix_cache import CacheRequestOutcome

            req.release_mm_inputs_on_abort()
            tree.finish(req.cache_request_handle, CacheRequestOutcome.ABORT)

    def release_chunk_abort(self, sg, req, tree) -> None:
        """``Scheduler.process_pending_chunked_abort``: release without inserting."""
        if self.legacy:
            sg.prepare_abort(req, "Aborted")
            sg.common.release_kv_cache(req, tree, is_insert=False)
        else:
            reason = req.discard_output_reason or sg.FINISH_ABORT("Aborted")
            sg.prepare_abort(req, reason.message, reason.status_code)
            req.to_finish = None
            self.release_aborted(sg, req, tree)
            sg.common.release_kv_cache(req, tree, checkpoint=False)

    # ---- batch calls -----------------------------------------------------------------
    def filter_batch(self, batch, exclude) -> None:
        if self.legacy:
            batch.filter_batch(chunked_req_to_exclude=list(exclude))
        else:
            batch.filter_batch(reqs_to_exclude=list(exclude))

    @property
    def filters_running_each_step(self) -> bool:
        """0.5.23's ``get_next_batch_to_run`` filters the running batch every step."""
        return not self.legacy

    def retract_decode(self, batch, server_args):
        return batch.retract_decode(server_args) if self.legacy else batch.retract_decode()

    def release_req(self, batch, idx: int, remaining: int, server_args) -> bool:
        """``ScheduleBatch.release_req``: True when the request can resume (0.5.23 returns it;
        0.5.18 always retracts)."""
        if self.legacy:
            batch.release_req(idx, remaining, server_args)
            return True
        return bool(batch.release_req(idx, remaining))

    def calc_priority(self, policy, queue, batch) -> None:
        if self.legacy:
            policy.calc_priority(queue, batch)
        else:
            policy.calc_priority(queue, batch, processed_tokens=0)

    def limit_chunk(self, adder, policy, chunked_req, queue, page_size: int) -> None:
        """0.5.23: ``adder.chunked_req_limit`` from ``SchedulePolicy.shortest_prefill_chunk_limit``."""
        if not self.legacy:
            adder.chunked_req_limit = policy.shortest_prefill_chunk_limit(
                chunked_req, queue, adder.rem_chunk_tokens or 0, page_size
            )

    def budget_exhausted(self, sg, adder) -> bool:
        """0.5.23 stops adding requests once ``adder.budget_state()`` says OTHER."""
        return not self.legacy and adder.budget_state() == sg.AddReqResult.OTHER

    def held_rows(self, adder) -> int:
        """0.5.23's ``get_num_allocatable_reqs`` counts rows the admitted requests already hold."""
        return 0 if self.legacy else sum(r.kv.holds_kv for r in adder.can_run_list)

    def full_after_no_token(self, adder, running_batch) -> bool:
        if self.legacy:
            return True
        return len(adder.can_run_list) > 0 or not running_batch.is_empty()

    def verify_bytes(self, allocator) -> list:
        """0.5.23's ``on_idle`` also runs ``allocator.verify_byte_accounting()``."""
        return [] if self.legacy else list(allocator.verify_byte_accounting())

    def flush(self, sched) -> None:
        """``Scheduler.flush_cache``'s pool resets (0.5.23 also resets the aux cache allocator)."""
        sched.tree_cache.reset()
        sched.req_to_token_pool.clear()
        sched.allocator.clear()
        if not self.legacy:
            sched.req_to_token_pool.reset_aux_cache_allocator()
