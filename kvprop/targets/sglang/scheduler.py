"""``SglangScheduler``: SGLang's scheduler loop over SGLang's own KV-cache objects, on a CPU.

The pools, allocator and tree are the ones ``Scheduler.__init__`` builds
(``mem_cache/kv_cache_configurator.py`` picks the allocator class, ``mem_cache/registry.py``'s
``create_tree_cache`` the tree: ``RadixCache`` for full attention on 0.5.18, ``UnifiedRadixCache``
with ``(FULL,)`` or ``(FULL, SWA)`` components otherwise). Every KV decision is SGLang's:
``Req.init_next_round_input`` matches, ``PrefillAdder`` admits, chunks and locks,
``ScheduleBatch.prepare_for_extend`` / ``prepare_for_decode`` allocate (evicting the shortfall),
``retract_decode`` / ``release_req`` retract, ``release_kv_cache`` and
``maybe_cache_unfinished_req`` / ``checkpoint_kv_cache`` insert and release. This module is the
orchestration between those calls, following ``managers/scheduler.py`` (``event_loop_normal``:
non-overlap, no PD, no LoRA, no speculative decoding, no hierarchical cache) and
``scheduler_components/batch_result_processor.py``; ``release.py`` holds the per-release lines.
The "model" samples one token per request, never EOS.
"""

from __future__ import annotations

from array import array
from typing import Any

from kvprop.errors import ConfigError, RequestError
from kvprop.targets.sglang.config import SglangConfig, StepResult
from kvprop.targets.sglang.loading import import_sglang, publish
from kvprop.targets.sglang.release import Release


class SglangScheduler:
    """The Scheduler's request bookkeeping, calling SGLang for every KV decision."""

    def __init__(self, config: SglangConfig, forward=None):
        """``forward(batch)``, when given, plays the model's forward pass over each batch SGLang
        prepared, before its tokens are sampled (kvprop's worker writes and reads the KV there)."""
        sg = self.sg = import_sglang()
        self.forward = forward
        self._stop: set[str] = set()
        rel = self.release = Release.of(sg)
        if rel.tree_core_selector == "none" and config.tree_core != "python":
            raise ConfigError(
                f"target 'sglang': SGLang {sg.version} has only the Python tree core; tree_core must be 'python'"
            )
        self.config = config
        self._fields = rel.server_fields(config)
        self.server_args = publish(**self._fields)
        rel.prepare(config)
        torch, page, n = sg.torch, config.page_size, config.pool_tokens
        # ---- what kv_cache_configurator / kv_cache_builder build (Scheduler.__init__) ----
        self.req_to_token_pool = sg.ReqToTokenPool(config.max_running_requests, config.max_context_len, "cpu", False)
        if config.swa:
            self.kvcache = sg.SWAKVPool(
                size=n, size_swa=config.swa_pool_tokens, page_size=page, dtype=torch.float32, head_num=1,
                head_dim=4, swa_attention_layer_ids=[0], full_attention_layer_ids=[1], device="cpu",
                enable_alt_stream=False,
            )  # fmt: skip
            self.allocator = sg.SWATokenToKVPoolAllocator(
                n,
                config.swa_pool_tokens,
                page_size=page,
                dtype=torch.float32,
                device="cpu",
                kvcache=self.kvcache,
                need_sort=False,
                **rel.swa_allocator_kwargs(self.req_to_token_pool),
            )
        else:
            self.kvcache = sg.MHATokenToKVPool(
                n, page, torch.float32, head_num=1, head_dim=4, layer_num=1, device="cpu",
                enable_memory_saver=False, enable_alt_stream=False,
            )  # fmt: skip
            if page == 1:
                self.allocator = sg.TokenToKVPoolAllocator(n, torch.float32, "cpu", self.kvcache, False)
            else:
                self.allocator = sg.PagedTokenToKVPoolAllocator(n, page, torch.float32, "cpu", self.kvcache, False)
        params = sg.CacheInitParams(
            disable=False,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.allocator,
            page_size=page,
            chunked_prefill_size=config.chunked_prefill_size,
            sliding_window_size=config.sliding_window,
            **rel.cache_params_kwargs(config),
        )
        self.tree_cache = rel.create_tree_cache(
            sg,
            sg.TreeCacheBuildContext(
                server_args=self.server_args,
                params=params,
                is_hybrid_swa=config.swa,
                is_hybrid_ssm=False,
                enable_hierarchical_cache=False,
                disable_radix_cache=False,
                tp_worker=None,
                model_config=sg.model_config,
                tp_size=1,
                tp_rank=0,
                tp_group=None,
                full_tokens_per_layer=n if config.swa else None,
                **rel.tree_context_kwargs(config),
            ),
            config,
        )
        self.new_token_ratio_tracker = sg.NewTokenRatioTracker.from_config()
        self.policy = sg.SchedulePolicy(config.schedule_policy, self.tree_cache, False, False, False)
        self.spec_algorithm = sg.SpeculativeAlgorithm.from_string(None)
        self.waiting_queue: list = []
        self.running_batch = sg.ScheduleBatch(reqs=[], batch_is_full=False)
        self.last_batch = None
        self.chunked_req = None
        self._pending_chunked_abort_req = None
        self._retract: set[str] = set()
        self._requests: dict[str, Any] = {}
        swa_tokens = config.swa_pool_tokens if config.swa else None
        self.pool_stats_observer = sg.SchedulerPoolStatsObserver(
            tree_cache=self.tree_cache,
            token_to_kv_pool_allocator=self.allocator,
            req_to_token_pool=self.req_to_token_pool,
            session_controller=None,
            hisparse_coordinator=None,
            is_hybrid_swa=config.swa,
            is_hybrid_ssm=False,
            enable_hisparse=False,
            full_tokens_per_layer=n if config.swa else None,
            swa_tokens_per_layer=swa_tokens,
            max_total_num_tokens=n,
            **rel.observer_kwargs(self),
        )
        self.invariant_checker = sg.SchedulerInvariantChecker(
            is_hybrid_swa=config.swa,
            is_hybrid_ssm=False,
            disaggregation_mode=sg.DisaggregationMode.NULL,
            page_size=page,
            full_tokens_per_layer=n if config.swa else None,
            swa_tokens_per_layer=swa_tokens,
            max_total_num_tokens=n,
            tree_cache=self.tree_cache,
            token_to_kv_pool_allocator=self.allocator,
            req_to_token_pool=self.req_to_token_pool,
            pool_stats_observer=self.pool_stats_observer,
            get_last_batch=lambda: self.last_batch,
            get_running_batch=lambda: self.running_batch,
            **rel.checker_kwargs(self),
        )

    # ---- read accessors ------------------------------------------------------------
    def live_requests(self) -> list:
        """Requests holding a req_to_token row: the last batch's, the running batch's and the
        chunked one (``SchedulerInvariantChecker._requests_owning_rows``'s sources), once each."""
        seen: dict[int, object] = {}
        for batch in (self.last_batch, self.running_batch):
            for req in batch.reqs if batch is not None else ():
                seen.setdefault(id(req), req)
        if self.chunked_req is not None:
            seen.setdefault(id(self.chunked_req), self.chunked_req)
        return [req for req in seen.values() if self.release.holds_kv(req)]

    def request(self, request_id: str):
        return self._requests.get(request_id)

    def is_fully_idle(self) -> bool:
        """``Scheduler.is_fully_idle`` (no running, chunked, last or waiting request)."""
        return (
            self.running_batch.is_empty()
            and self.chunked_req is None
            and (self.last_batch is None or self.last_batch.is_empty())
            and not self.waiting_queue
        )

    # ---- operations ----------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids, max_new_tokens: int):
        """``TokenizerManager`` (SamplingParams normalised and verified) then
        ``Scheduler.handle_generate_request`` -> ``_add_request_to_queue`` (NULL disaggregation)."""
        if request_id in self._requests:
            raise RequestError(f"target 'sglang': request {request_id!r} already exists")
        sg = self.sg
        self._publish()
        vocab = sg.model_config.vocab_size
        prompt = list(prompt_token_ids)
        if not prompt or any(not 3 <= t < vocab for t in prompt):
            raise RequestError(f"target 'sglang': request {request_id!r}: prompt tokens must be in [3, {vocab})")
        if len(prompt) + max_new_tokens > self.config.max_context_len:
            raise RequestError(
                f"target 'sglang': request {request_id!r}: {len(prompt)} + {max_new_tokens} tokens exceed "
                f"max_context_len {self.config.max_context_len}"
            )
        # Scheduler.handle_generate_request: the prompt's length is validated (validate_input_length,
        # no auto-truncation: an error ends the request at arrival, so kvprop does not make it) and
        # the generation clipped to what can ever be scheduled (init_req_max_new_tokens)
        longest = self.release.max_req_len(self.config) - 5
        if len(prompt) >= longest:
            raise RequestError(
                f"target 'sglang': request {request_id!r}: SGLang refuses a prompt of {len(prompt)} tokens "
                f"(max_req_input_len {longest})"
            )
        max_new_tokens = self.release.max_new_tokens(self.allocator, self.config, len(prompt), max_new_tokens)
        if max_new_tokens < 1:
            raise RequestError(
                f"target 'sglang': request {request_id!r}: SGLang leaves a prompt of {len(prompt)} tokens no room "
                f"to generate in a pool of {self.config.pool_tokens}"
            )
        sp = sg.SamplingParams(max_new_tokens=max_new_tokens)
        sp.normalize(None)
        sp.verify(vocab)
        req = sg.Req(
            request_id, "", array("q", prompt), sp, vocab_size=vocab, eos_token_ids=sg.model_config.hf_eos_token_id
        )
        self._requests[request_id] = req
        self.waiting_queue.append(req)
        return req

    def abort(self, request_id: str) -> None:
        """``Scheduler.abort_request`` (NULL disaggregation, no Mamba, pp 1): a waiting request
        leaves the queue; the chunked one is released at the start of the next step
        (``process_pending_chunked_abort``); a running one finishes on its next forward."""
        self._publish()
        req = self._requests.get(request_id)
        if req is None:
            return
        if self.chunked_req is req:
            self._pending_chunked_abort_req = req
        if req in self.waiting_queue:
            self.waiting_queue.remove(req)
            self.release.release_aborted(self.sg, req, self.tree_cache)
            self._requests.pop(request_id)
            return
        inflight = [r for b in (self.running_batch, self.last_batch) if b is not None for r in b.reqs]
        if req in inflight and not req.finished():
            req.to_finish = self.sg.FINISH_ABORT()

    def retract(self, request_id: str) -> None:
        """Retract a running request at the next decode step, where ``retract_decode`` retracts:
        ``ScheduleBatch.release_req`` (release without insert, evict for the survivors) and
        ``filter_batch``; it returns to the waiting queue and later re-matches its prefix."""
        if request_id in self._requests:
            self._retract.add(request_id)

    def stop(self, request_id: str) -> None:
        """The model samples EOS for ``request_id`` the next time it samples for it: the request
        finishes as SGLang finishes any request that generates its model's EOS token."""
        if request_id in self._requests:
            self._stop.add(request_id)

    def reset_prefix_cache(self) -> bool:
        """``Scheduler.flush_cache``: resets the tree and pools when fully idle, else refuses."""
        self._publish()
        if not self.is_fully_idle():
            return False
        self.last_batch = None
        self.release.flush(self)
        return True

    def step(self) -> StepResult:
        """``event_loop_normal``: get_next_batch_to_run, run_batch, process_batch_result; SGLang's
        busy check only where its ``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY`` asks for it, as
        the server does (``kvprop.check.sglang.check_conservation`` states the same contract as a Violation)."""
        self._publish()
        self._step_finished: list[str] = []
        self._step_retracted: list[str] = []
        self._step_admitted: list[str] = []
        batch = self.get_next_batch_to_run()
        if batch is not None:
            scheduled = self._scheduled(batch)
            if self.forward is not None:
                self.forward(batch)
            self.process_batch_result(batch, self._sample(batch))
            mode = "extend" if batch.forward_mode.is_extend() else "decode"
        else:
            scheduled, mode = (), "idle"
            if self.is_fully_idle():  # Scheduler.on_idle's state reset; its checks are kvprop.check.sglang.check_idle
                self.new_token_ratio_tracker.reset()
        self.last_batch = batch
        if self.sg.envs.SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY.get():  # as event_loop_normal
            self.invariant_checker.self_check_during_busy()
        for rid in self._step_finished:
            self._requests.pop(rid, None)
            self._retract.discard(rid)
            self._stop.discard(rid)
        return StepResult(
            mode=mode,
            admitted=tuple(self._step_admitted),
            finished=tuple(self._step_finished),
            retracted=tuple(self._step_retracted),
            scheduled=scheduled,
        )

    def _publish(self) -> None:
        self.server_args = publish(**self._fields)

    def _scheduled(self, batch) -> tuple:
        if batch.forward_mode.is_extend():
            return tuple((r.rid, int(n)) for r, n in zip(batch.reqs, batch.extend_lens))
        return tuple((r.rid, 1) for r in batch.reqs)

    def _sample(self, batch) -> list[int]:
        """The model: a token per request from its id and length, inside the vocabulary and never
        EOS, except for a request ``stop`` named, which samples EOS."""
        vocab, eos = self.sg.model_config.vocab_size, min(self.sg.model_config.hf_eos_token_id)
        return [
            eos
            if r.rid in self._stop
            else 3 + (len(r.origin_input_ids) + 7 * len(r.output_ids) + sum(map(ord, r.rid))) % (vocab - 3)
            for r in batch.reqs
        ]

    # ---- the loop ------------------------------------------------------------------
    def process_pending_chunked_abort(self) -> None:
        """``Scheduler.process_pending_chunked_abort``."""
        req, rel = self._pending_chunked_abort_req, self.release
        if req is None:
            return
        if self.chunked_req is not req:
            if req.finished() or not rel.holds_kv(req):
                self._pending_chunked_abort_req = None
            elif rel.chunk_abort_redispatch:  # it left the chunk: aborted where it is now
                self._pending_chunked_abort_req = None
                self.abort(req.rid)
            return
        rel.release_chunk_abort(self.sg, req, self.tree_cache)
        self.chunked_req = None
        self._pending_chunked_abort_req = None
        self._step_finished.append(req.rid)

    def get_next_batch_to_run(self):
        """``Scheduler.get_next_batch_to_run`` (non-PD, no DLLM)."""
        rel = self.release
        self.process_pending_chunked_abort()
        running_batch, last_batch = self.running_batch, self.last_batch
        exclude = []
        if self.chunked_req is not None:  # stash_chunked_request
            exclude.append(self.chunked_req)
            if rel.extend_end(self.chunked_req) > rel.prefix_len(self.chunked_req):
                rel.cache_unfinished(self.sg, self.chunked_req, self.tree_cache, chunked=True)
        if last_batch is not None and last_batch.forward_mode.is_extend():
            if last_batch.chunked_req is not None and last_batch.chunked_req not in exclude:
                exclude.append(last_batch.chunked_req)
            last_bs = last_batch.batch_size()
            rel.filter_batch(last_batch, exclude)
            if last_batch.batch_size() < last_bs:
                running_batch.batch_is_full = False
            if not last_batch.is_empty() and last_batch is not running_batch:
                if running_batch.is_empty():
                    running_batch = last_batch
                else:
                    running_batch.merge_batch(last_batch)
        if rel.filters_running_each_step:
            running_bs = running_batch.batch_size()
            running_batch.filter_batch()
            if running_batch.batch_size() < running_bs:
                running_batch.batch_is_full = False
        self.running_batch = running_batch
        new_batch = self.get_new_batch_prefill(running_batch)
        if new_batch is not None:
            return new_batch
        if not self.running_batch.is_empty():
            decode = self.update_running_batch(self.running_batch)
            return decode if decode is not None and not decode.is_empty() else None
        return None

    def get_new_batch_prefill(self, running_batch):
        """``Scheduler._get_new_batch_prefill_raw``, without mixed chunks."""
        sg, rel, config = self.sg, self.release, self.config
        # is_hybrid_swa resets it to try the prefill adder; later releases also reset an empty batch's
        if config.swa or (rel.empty_running_clears_full and running_batch.is_empty()):
            running_batch.batch_is_full = False
        if (running_batch.batch_is_full or not self.waiting_queue) and self.chunked_req is None:
            return None
        running_bs = len(running_batch.reqs)

        def num_allocatable(held_rows: int = 0) -> int:  # Scheduler.get_num_allocatable_reqs
            return min(
                config.max_running_requests - running_bs, max(self.req_to_token_pool.available_size() + held_rows, 0)
            )

        if num_allocatable() <= 0 and self.chunked_req is None:
            running_batch.batch_is_full = True
            return None
        rel.calc_priority(self.policy, self.waiting_queue, running_batch)
        adder = sg.PrefillAdder(
            config.page_size, self.tree_cache, self.allocator, running_batch,
            self.new_token_ratio_tracker.current, 16384, config.chunked_prefill_size, 0,
        )  # fmt: skip
        if self.chunked_req is not None:
            self.chunked_req.init_next_round_input()
            rel.limit_chunk(adder, self.policy, self.chunked_req, self.waiting_queue, config.page_size)
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
        for req in self.waiting_queue:
            if rel.budget_exhausted(sg, adder):
                break
            if len(adder.can_run_list) >= num_allocatable(rel.held_rows(adder)):
                running_batch.batch_is_full = True
            if running_batch.batch_is_full:
                break
            req.init_next_round_input(self.tree_cache)  # match_prefix
            res = adder.add_one_req(req, has_chunked_req=self.chunked_req is not None, truncation_align_size=None)
            if res != sg.AddReqResult.CONTINUE:
                if res == sg.AddReqResult.NO_TOKEN:
                    running_batch.batch_is_full = rel.full_after_no_token(adder, running_batch)
                break
        can_run = adder.can_run_list
        if not can_run:
            return None
        admitted = set(map(id, can_run))
        self._step_admitted.extend(r.rid for r in self.waiting_queue if id(r) in admitted)
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in admitted]
        if adder.new_chunked_req is not None:
            self.chunked_req = adder.new_chunked_req
        if self.chunked_req is not None:
            self.chunked_req.inflight_middle_chunks += 1
        batch = sg.ScheduleBatch.init_new(
            can_run, self.req_to_token_pool, self.allocator, self.tree_cache, sg.model_config, False,
            self.spec_algorithm, chunked_req=self.chunked_req,
        )  # fmt: skip
        batch.prepare_for_extend()  # alloc_for_extend: evicts the shortfall, allocates rows and slots
        batch.decoding_reqs = None
        return batch

    def update_running_batch(self, batch):
        """``Scheduler.update_running_batch`` (non-overlap), with the requested retractions done
        as ``retract_decode`` does them for the requests it picks."""
        rel = self.release
        initial_bs = batch.batch_size()
        rel.filter_batch(batch, [])
        if batch.is_empty():
            batch.batch_is_full = False
            return batch
        self._forced_retractions(batch)
        if batch.is_empty():
            return batch
        if not batch.check_decode_mem():
            retracted, ratio, aborted = rel.retract_decode(batch, self.server_args)
            self.new_token_ratio_tracker.current = ratio
            self._requeue(retracted)
            # reqs_to_abort: released by release_req, sent out as aborted (send_abort_output)
            self._step_finished.extend(req.rid for req in aborted)
        else:
            self.new_token_ratio_tracker.decay_step()
        if batch.batch_size() < initial_bs:
            batch.batch_is_full = False
        if batch.is_empty():
            return batch
        batch.prepare_for_decode()  # alloc_for_decode
        return batch

    def _forced_retractions(self, batch) -> None:
        """``ScheduleBatch.retract_decode``'s body for the requests ``retract`` named."""
        chosen = [i for i, r in enumerate(batch.reqs) if r.rid in self._retract and not r.finished()]
        if not chosen:
            return
        keep = [i for i in range(len(batch.reqs)) if i not in chosen]
        retracted = []
        for n, idx in enumerate(reversed(chosen)):
            req = batch.reqs[idx]
            if self.release.release_req(batch, idx, len(keep) + len(chosen) - n - 1, self.server_args):
                retracted.append(req)
            else:  # no backup and the KV is gone: retract_decode aborts it
                req.to_finish = self.sg.FINISH_ABORT("Retracted without a KV backup")
                self._step_finished.append(req.rid)
        batch.filter_batch(keep_indices=keep)
        self._requeue(retracted)

    def _requeue(self, retracted) -> None:
        """``_add_request_to_queue(req, is_retracted=True)``."""
        for req in retracted:
            self._retract.discard(req.rid)
            self._step_retracted.append(req.rid)
        self.waiting_queue.extend(retracted)

    def process_batch_result(self, batch, next_token_ids) -> None:
        """``process_batch_result_prefill`` (generation) / ``process_batch_result_decode`` +
        ``_handle_finish_state_updated_req``, inside one allocator free group as both open it
        (``free_group_begin`` / ``free_group_end``, ``batch_result_processor.py``, 0.5.18 and 0.5.23)."""
        self.allocator.free_group_begin()
        self._process_batch_result(batch, next_token_ids)
        self.allocator.free_group_end()

    def _process_batch_result(self, batch, next_token_ids) -> None:
        rel, tree = self.release, self.tree_cache
        if batch.forward_mode.is_extend():
            for req, tok in zip(batch.reqs, next_token_ids):
                if (req.finished() and req.inflight_middle_chunks <= 0) or req.is_retracted:
                    continue
                if req.inflight_middle_chunks <= 0:
                    req.output_ids.append(tok)
                    req.update_finish_state()
                    if req.finished():
                        rel.release_finished(self.sg, req, tree)
                        self._step_finished.append(req.rid)
                    elif not batch.decoding_reqs or req not in batch.decoding_reqs:
                        rel.cache_unfinished(self.sg, req, tree, chunked=False)
                else:
                    req.inflight_middle_chunks -= 1
        else:
            for req, tok in zip(batch.reqs, next_token_ids):
                req.output_ids.extend([tok])
                req.update_finish_state(1)
                if req.finished():
                    rel.release_finished(self.sg, req, tree)
                    self._step_finished.append(req.rid)
