"""vLLM's own v1 ``Scheduler`` as a kvprop target (``--target vllm-scheduler``).

Here kvprop's engine does not schedule. Each step calls vLLM's ``Scheduler.schedule()``,
plays the model runner — writes every scheduled position through the block ids the
scheduler output hands the worker, samples each request's next token — and hands the
output back through ``update_from_output``. Admission, chunking, preemption under
pressure and the freeing of finished requests are vLLM's own; kvprop's operations only
add requests, abort or stop them, reset the prefix cache and step.

The invariants read the scheduler's ``KVCacheManager`` through the manager target's view,
between operations and inside the step: the manager's ``get_computed_blocks``,
``allocate_slots`` and ``free`` are observed — the instance's attributes wrap the bound
methods and call through with the same arguments, returning what they return — so the
checks run where blocks change hands, as with ``--target vllm``. kvprop's request records
mirror vLLM's (status, computed tokens, tokens) at each of those moments; the data oracle
judges what the worker wrote through the scheduler's block ids.

Speculative decoding runs as vLLM's n-gram drafting does: after each step the worker hands the
scheduler kvprop's drafts (``update_draft_token_ids``), the next step schedules them, and the
output carries the accepted ones and the token after them. vLLM's offloading connector runs
with kvprop as its worker (``offload``). Building the scheduler is ``config``'s, and the shapes
refused before anything is built are ``releases``' (``scheduler_refusal``); docs/targets.md
says what is not driven and why.
"""

from __future__ import annotations

import inspect

from kvprop.allocator.specs import EngineConfig
from kvprop.errors import ConfigError
from kvprop.sim.engine import Engine, StepReport
from kvprop.sim.events import (
    EV_ABORT_LOAD,
    EV_DEFERRED_FREE,
    EV_EVICT,
    EV_LOAD_FAIL,
    EV_PREEMPT,
    EV_SKIP,
    EV_SPEC_ACCEPT,
    EV_SPEC_REJECT,
)
from kvprop.sim.request import Status
from kvprop.sim.target_calls import OwnLoopCalls
from kvprop.targets.vllm.batches import SchedulerBatches
from kvprop.targets.vllm.config import build_scheduler
from kvprop.targets.vllm.loading import import_scheduler
from kvprop.targets.vllm.manager import Hits, VllmAllocator, capabilities
from kvprop.targets.vllm.offload import OffloadWorker
from kvprop.targets.vllm.recipe import Recipe
from kvprop.targets.vllm.releases import scheduler_refusal
from kvprop.targets.vllm.view import VllmView


def build_engine(config: EngineConfig, device=None, hooks=None, canary: bool = False):
    """The target's entry point: it builds the whole engine, as its registry entry declares
    (``own_scheduler``, ``kvprop.targets.protocol``)."""
    import_scheduler()  # without vLLM every configuration is refused for that reason, with the way out
    why = scheduler_refusal(config)
    if why:
        raise ConfigError(f"target 'vllm-scheduler': {why}")
    from kvprop.targets.canary import with_canary

    cls = with_canary(SchedulerEngine) if canary else SchedulerEngine
    return cls(config, device=device, hooks=hooks)


class SchedulerEngine(SchedulerBatches, OwnLoopCalls, OffloadWorker, Engine):
    """kvprop's engine with vLLM's scheduler in charge of every step."""

    preempts_on_request = False  # vLLM's scheduler preempts by its own policy, under pressure
    connector_class = None  # vLLM's own connector is in charge; kvprop plays its worker side

    def __init__(self, config: EngineConfig, device=None, hooks=None):
        self.recipe = Recipe()  # the calls that built the scheduler (kvprop report states them)
        self.scheduler = build_scheduler(config, self.recipe)
        self.s = import_scheduler()
        manager = self.scheduler.kv_cache_manager
        allocator = VllmAllocator.around(config.allocator, manager)
        allocator.caller_contract = {}  # malformed calls go to the manager, never through this scheduler
        super().__init__(
            config, allocator, VllmView(allocator), device=device, hooks=hooks, capabilities=capabilities()
        )
        self.tells_steps = False  # schedule() tells the manager itself
        # vLLM promises to finish any request up to max_model_len, and sizes that from the tables
        # alone (check_enough_kv_cache_memory): the copies a hit inside a block takes are not
        # its caller's to reserve (docs/findings.md)
        self.copy_reserve = 0
        self.fence = None  # and vLLM's scheduler defers its own frees (SchedulerBatches.fenced_blocks)
        self._init_transfers()
        self.worker: dict[str, list[list[int]]] = {}  # request id -> the block ids the worker holds, per group
        self.report: StepReport | None = None
        self._events: list = []
        self._observe(manager)
        self._observe_tier_events()

    # ---- observing the manager ---------------------------------------------------------

    def _observe(self, manager) -> None:
        real_hit, real_allocate, real_free = manager.get_computed_blocks, manager.allocate_slots, manager.free

        def get_computed_blocks(vreq, *args, **kwargs):
            result = self.allocator.reannouncing(real_hit, vreq, *args, **kwargs)
            self._hook(self._after_hit, vreq, result)
            return result

        def allocate_slots(vreq, num_new_tokens, *args, **kwargs):
            if args:  # the scheduler passes keywords; bind positional ones to their names all the same
                bound = inspect.signature(real_allocate).bind(vreq, num_new_tokens, *args, **kwargs)
                kwargs = {k: val for k, val in bound.arguments.items() if k not in ("request", "num_new_tokens")}
            request, seen, token = self._hook(self._before_allocation, vreq, num_new_tokens, kwargs)
            try:
                result = self.allocator.counting_evictions(real_allocate, vreq, num_new_tokens, **kwargs)
            except Exception as e:
                note = self._hook(self.hooks.allocation_crashed, self, request, token)
                if note is not None:
                    e.add_note(note)
                raise
            self._hook(self._after_allocation, request, seen, token, result)
            return result

        def free(vreq):
            self.release(vreq)

        self._real_free = real_free
        real_events = self._real_take_events = manager.take_events

        def take_events():
            events = real_events()
            self._events.extend(events)  # what the scheduler publishes, in order
            return events

        manager.get_computed_blocks = get_computed_blocks
        manager.take_events = take_events
        manager.allocate_slots = allocate_slots
        manager.free = free
        if self.s.fences_frees:  # the fence takes a request's blocks from it and frees them later
            real_pop = manager.pop_blocks_for_free

            def pop_blocks_for_free(vreq):
                blocks = real_pop(vreq)
                self.events[EV_DEFERRED_FREE] += 1
                self._hook(self._after_free, vreq)
                return blocks

            manager.pop_blocks_for_free = pop_blocks_for_free

    def _mirror(self, vreq):
        """kvprop's record of ``vreq``, its computed count and its shared-prefix junction brought
        up to vLLM's: from 0.34.0 the offloading connector's lookup may raise the junction the
        local lookup reported, where a sparse group cut the connector's hit
        (``_maybe_register_shared_prefix_junction``), and vLLM's manager retains by the raised one."""
        request = self.requests[vreq.request_id]
        request.num_computed_tokens = vreq.num_computed_tokens
        request.shared_prefix_boundary = getattr(vreq, "shared_prefix_boundary", request.shared_prefix_boundary)
        return request

    def _after_hit(self, vreq, result) -> None:
        request = self._mirror(vreq)
        request.shared_prefix_boundary = result[2] if len(result) > 2 else 0
        hits = Hits(result[0])
        if result[1]:
            self.last_hits = (request.request_id, hits, result[1])
        self.hooks.after_hit(self, request, hits, result[1])

    def _before_allocation(self, vreq, num_new_tokens, kwargs):
        request = self._mirror(vreq)
        if request.status is Status.LOADING:
            request.pending_external = 0  # vLLM schedules a load's request once the load is in its count
        seen = dict(kwargs)
        hits = seen.get("new_computed_blocks")
        if hits is not None:
            seen["new_computed_blocks"] = hits = Hits(hits)
            num_hit, external = seen.get("num_new_computed_tokens", 0), seen.get("num_external_computed_tokens", 0)
            self._note_admission_events(request, hits, num_hit, external, num_new_tokens)
        return request, seen, self.hooks.before_allocation(self, request, num_new_tokens, seen)

    def _after_allocation(self, request, seen, token, result) -> None:
        computed = (
            request.num_computed_tokens
            + seen.get("num_new_computed_tokens", 0)
            + seen.get("num_external_computed_tokens", 0)
        )
        external = seen.get("num_external_computed_tokens", 0)
        if result is not None and any(spec.skipped_tokens(computed) >= self.block_size for spec in self.specs):
            self.events[EV_SKIP] += 1
        if result is not None and request.status in (Status.WAITING, Status.LOADING):
            # vLLM admits what it allocated for: running from here on, with its hit computed,
            # or loading while an asynchronous load (delay_cache_blocks) brings the rest
            (self.waiting.remove(request) if request.status is Status.WAITING else self.loading.pop(request.request_id))
            request.num_computed_tokens = computed
            if external and seen.get("delay_cache_blocks"):
                # as kvprop's engine counts a load: computed locally, the rest pending
                request.status, request.pending_external = Status.LOADING, external
                request.num_computed_tokens = computed - external
                self.loading[request.request_id] = request
            else:
                request.status, request.pending_external = Status.RUNNING, 0
                self.running.append(request)
            if self.report is not None:
                self.report.admitted.append(request.request_id)
        self.hooks.after_allocation(self, request, token, result, computed)
        if result is not None and external:
            tables = self.target_calls.get_block_ids(request.request_id)
            local = computed - external
            self.hooks.at_handoff(self, request, tables, local, external)

    def release(self, vreq) -> None:
        """vLLM's scheduler frees ``vreq``: the manager frees it, then kvprop mirrors it (the
        engine's ``release`` seam, which the canary's mixin takes over for either engine)."""
        self._real_free(vreq)
        self._hook(self._after_free, vreq)

    def _after_free(self, vreq) -> None:
        """vLLM freed ``vreq``'s blocks: it finished or was aborted, or it is being preempted (the
        scheduler frees first, then marks it; a finished request is marked first)."""
        request = self.requests.get(vreq.request_id)
        if request is None:
            return
        loading = self._leave(request)
        if loading and not vreq.is_finished():
            # a failed load with nothing valid to keep: vLLM frees it and it waits to recompute
            request.pending_external = 0
            request.load_failed = True
            self._wait_again(request, EV_LOAD_FAIL)
        elif vreq.is_finished():
            # the tokens of its last output, which vLLM may have cached a block of before freeing
            self._catch_up(request, vreq)
            self._end(request, self._status(vreq.status))
        else:
            request.num_preemptions += 1
            self._wait_again(request, EV_PREEMPT)
            if self.report is not None:
                self.report.preempted.append(request.request_id)
        self.hooks.after_free(self, request)

    def _leave(self, request) -> bool:
        """Take ``request`` out of the engine's queues and the worker's tables; whether it was loading."""
        self._forget_worker(request)
        loading = self.loading.pop(request.request_id, None) is not None
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        return loading

    def _status(self, vllm_status) -> Status:
        """kvprop's record of how vLLM ended a request: an error is a failed load ("fail" policy)."""
        statuses = self.s.RequestStatus
        if vllm_status == statuses.FINISHED_ABORTED:
            return Status.ABORTED
        return Status.FAILED if vllm_status == statuses.FINISHED_ERROR else Status.FINISHED

    def _end(self, request, status: Status) -> None:
        self._retire(request, status)
        if status is Status.FAILED:
            self.events[EV_LOAD_FAIL] += 1
        elif self.report is not None and status is Status.FINISHED:
            self.report.finished.append(request.request_id)

    def _forget_worker(self, request) -> None:
        rid = request.request_id
        self.worker.pop(rid, None)
        for g in self.state_groups:
            self.worker_tables.pop((rid, g), None)
            self.state_columns.pop((rid, g), None)

    # ---- operations ----------------------------------------------------------------------

    def add_request(self, prompt, max_new_tokens: int):
        request = super().add_request(prompt, max_new_tokens)
        v = self.allocator.v
        vreq = v.Request(
            request_id=request.request_id,
            prompt_token_ids=list(request.tokens),
            sampling_params=self.allocator.sampling_params(max_new_tokens),
            pooling_params=None,
            block_hasher=self.allocator.hasher,
        )
        self.allocator.adopt(request, vreq)
        self._call("Scheduler.add_request", self.scheduler.add_request, vreq)
        return request

    def abort(self, request_id: str) -> None:
        self.get(request_id)
        self._finish_in_vllm(request_id, self.s.RequestStatus.FINISHED_ABORTED)

    def finish(self, request_id: str) -> None:
        from kvprop.errors import RequestError

        request = self.get(request_id)
        if request.status is not Status.RUNNING:
            raise RequestError(
                f"finish: request {request_id!r} is {request.status.value}, only running ones can finish"
            )
        self._finish_in_vllm(request_id, self.s.RequestStatus.FINISHED_STOPPED)

    def why_not_finish(self, request_id: str) -> str | None:
        """vLLM stops a request only once it samples (a stop token, a length): a stop before its
        prompt is computed is outside its caller contract, so it is not made. (Its offloading
        connector then stores the whole prompt, computed or not: 0.30.0 and 0.33.0 take a
        finished request's tokens as computed, ``_build_store_jobs``.)"""
        request = self.requests[request_id]
        if request.num_computed_tokens < request.num_prompt_tokens:
            return f"{request_id} is still in prefill, and only sampling stops a request in vLLM"
        return None

    def _finish_in_vllm(self, request_id: str, status) -> None:
        self.report = None
        self._call("Scheduler.finish_requests", self.scheduler.finish_requests, request_id, status)
        request = self.requests.get(request_id)
        if request is None:
            return
        if request_id in self.scheduler.requests:
            # vLLM keeps the blocks of an aborted load until the worker reports it done
            request.status = Status.ABORTING
            self.events[EV_ABORT_LOAD] += 1
            return
        # vLLM ended it without freeing anything through its manager: it ends all the same
        self._leave(request)
        self._end(request, self._status(status))

    def preempt(self, request_id: str) -> None:
        from kvprop.errors import RequestError

        raise RequestError("preempt: vLLM's scheduler preempts by its own policy, under pressure; not made")

    def reset_prefix_cache(self) -> bool:
        return bool(self._call("Scheduler.reset_prefix_cache", self.scheduler.reset_prefix_cache))

    def take_kv_events(self) -> list | None:
        """The events the scheduler published since the last call, then those the manager holds
        for its next publication (an operation between steps, a reset, makes some): kvprop takes
        them where a subscriber would have them, so the cache map is judged against all of it."""
        if not self.config.allocator.enable_kv_cache_events:
            return None
        published, self._events = self._events, []
        pending = self._call("KVCacheManager.take_events", self._real_take_events)
        tier = self._call("OffloadingConnector.take_events", self.pending_tier_events)
        return self.allocator.translate_events([*published, *pending, *tier])

    # ---- a step ---------------------------------------------------------------------------

    def worker_block_ids(self, request_id: str):
        return self.worker[request_id]

    def stall_signature(self, report: StepReport):
        """None: vLLM's scheduler keeps state kvprop does not mirror (a deferred load, a store
        completing a step later), so only the drain's step bound judges its liveness."""
        return None

    def step(self) -> StepReport:
        if self.batches is not None:  # batches in flight: a turn of the engine core's batch queue
            return self.batches.turn(self)
        report = self.report = StepReport()
        evictions = self.view.num_evictions
        self.hooks.step_starts(self)
        try:
            output = self._call("Scheduler.schedule", self.scheduler.schedule)
            starts = self._hand_to_worker(output)
            for copy in self._copies(output):
                # the worker copies before the forward pass (vLLM 0.30.0 on; hits inside a block)
                self.memory.copy_block(copy.src_block_id, copy.dst_block_id)
            meta = self._connector_meta(output)
            due, self.stores_due = self.stores_due, []
            if meta is not None:
                self._start_transfers(meta)
            for rid, n in output.num_scheduled_tokens.items():
                report.scheduled[rid] = n
                request = self.requests[rid]
                request.num_computed_tokens = starts[rid]
                drafts = list(output.scheduled_spec_decode_tokens.get(rid, ()))
                if drafts != request.spec_token_ids[: len(drafts)]:
                    # vLLM 0.33.0 pads a new decode to 1 + K rows with -1 placeholders (one
                    # CUDA graph for the batch): they are computed and then rejected like drafts
                    request.set_drafts(drafts)
            self._write_scheduled(report)
            self._after_pass(meta, due)
            model_output = self._model_output(output, starts)
            self._call("Scheduler.update_from_output", self.scheduler.update_from_output, output, model_output)
            self._take_outputs(report, output)
        finally:
            self.report = None
        if self.view.num_evictions > evictions:
            self.events[EV_EVICT] += 1
        return report

    def _hand_to_worker(self, output) -> dict[str, int]:
        """The worker's block tables after this step's output (new requests' block ids; running
        ones' new ids appended, a resumed one's replaced), and where each request's tokens start."""
        starts = {}
        for new in output.scheduled_new_reqs:
            self.worker[new.req_id] = [list(ids) for ids in new.block_ids]
            starts[new.req_id] = new.num_computed_tokens
        cached = output.scheduled_cached_reqs
        # a resumed request among the running ones: a set in later releases, a flag per row before;
        # from 0.34.0 a resumed request is sent in full among the new ones, and neither exists
        resumed = getattr(cached, "resumed_req_ids", None)
        flags = getattr(cached, "resumed_from_preemption", None)
        for i, rid in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            again = rid in resumed if resumed is not None else flags is not None and flags[i]
            if again or rid not in self.worker:
                self.worker[rid] = [list(ids) for ids in new_ids] if new_ids else [[] for _ in self.specs]
            elif new_ids:
                for table, ids in zip(self.worker[rid], new_ids, strict=True):
                    table.extend(ids)
            starts[rid] = cached.num_computed_tokens[i]
        return starts

    def _catch_up(self, request, vreq) -> list[int]:
        """The tokens vLLM appended to ``vreq`` since kvprop's record last grew, appended to it
        too, and the new block hashes named (so an event or a key for them reads as kvprop's)."""
        grown = vreq.all_token_ids[request.num_tokens :]
        request.extend_tokens(grown)
        self.allocator.name_hashes(request, vreq)
        return grown

    def _model_output(self, output, starts):
        """What the model runner returns: for every request whose scheduled tokens reach its end,
        the drafts verification accepts and the token after them (decoding depends on the prefix
        alone), nothing for a prefill chunk."""
        ids = list(output.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            request = self.requests[rid]
            request.num_computed_tokens = starts[rid] + output.num_scheduled_tokens[rid]
            drafts = len(output.scheduled_spec_decode_tokens.get(rid, ()))
            reached = request.num_computed_tokens - drafts >= request.num_tokens
            sampled.append(request.verified_tokens(drafts) if reached else [])
            if drafts and reached and self.state_groups:
                # the worker copies a crossed boundary's state in the same pass (vLLM's
                # postprocess_mamba), before the scheduler sees the output or frees the request
                accepted = len(sampled[-1]) - 1
                request.num_computed_tokens = request.num_tokens + accepted
                self._settle_states(request, accepted)
        extra = {}
        if self.scheduler.connector is not None:
            extra["kv_connector_output"] = self._connector_output()
        if self.s.indexed_outputs:
            extra["req_id_to_index"] = {rid: i for i, rid in enumerate(ids)}
        return self.s.ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled, **extra)

    # ---- the worker side of vLLM's offloading connector -------------------------------------

    def _take_outputs(self, report: StepReport, output) -> None:
        """kvprop's records brought up to vLLM's after the output (the tokens it appended, its
        computed counts, the verification's outcome), then the drafts for the next step."""
        proposals = {}
        for rid in report.scheduled:
            request = self.requests.get(rid)
            vreq = self.scheduler.requests.get(rid)
            if request is None or vreq is None:
                continue
            grown = self._catch_up(request, vreq)
            drafts = len(output.scheduled_spec_decode_tokens.get(rid, ()))
            request.drop_drafts()
            request.num_computed_tokens = vreq.num_computed_tokens
            if drafts and grown:
                self.events[EV_SPEC_REJECT if len(grown) <= drafts else EV_SPEC_ACCEPT] += 1
            room = request.max_new_tokens - request.num_output_tokens - 1
            k = min(self.config.speculative_tokens, room)
            if grown and k > 0:
                request.propose_drafts(k)
                proposals[rid] = list(request.spec_token_ids)
        if proposals:
            drafts = self.s.DraftTokenIds(req_ids=list(proposals), draft_token_ids=list(proposals.values()))
            self._call("Scheduler.update_draft_token_ids", self.scheduler.update_draft_token_ids, drafts)
            for rid in proposals:  # vLLM keeps no drafts for a request still in prefill: neither does kvprop
                vreq = self.scheduler.requests[rid]
                if list(vreq.spec_token_ids) != proposals[rid]:
                    self.requests[rid].drop_drafts()
