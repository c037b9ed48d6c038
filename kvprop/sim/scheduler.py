"""The scheduler: which requests run in a step, how much of each, and what becomes of them.

An ``Engine`` mixin (``kvprop.sim.engine`` composes it). One ``step`` schedules running
requests first (decode or the next prefill chunk), preempting the lowest-priority running
request when slots run out, then continues requests whose load is done, then admits waiting
requests under the token budget; the worker (``kvprop.sim.worker``) executes the step, and the
scheduler then takes each request's progress (verification, the sampled token, the end). It
owns the requests' records and queues, their lifecycle (finish, abort, preemption, an external
load's completion) and the room kept for loads in flight; where a state group's
prefill chunk may end is ``kvprop.sim.chunking``'s. ``release`` is the seam where a
request's blocks go back, which a scheduler target and the canary take over.

What it reads of the engine it is mixed into is declared at the top of ``Scheduler`` and
``ChunkRules``: the engine's own attributes and the worker's calls it makes.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from kvprop.allocator.specs import Mamba, cdiv
from kvprop.capabilities import Capabilities
from kvprop.errors import RequestError, TargetCrash
from kvprop.sim.chunking import ChunkRules
from kvprop.sim.connector import Connector
from kvprop.sim.events import (
    EV_ABORT_LOAD,
    EV_CROSS_GROUP,
    EV_EVICT,
    EV_PREEMPT,
    EV_REHIT,
    EV_SKIP,
    EV_SPEC_ACCEPT,
    EV_SPEC_REJECT,
)
from kvprop.sim.hooks import Hooks
from kvprop.sim.load_room import LoadRoom
from kvprop.sim.request import Request, Status, arrival, live
from kvprop.sim.step_report import StepReport
from kvprop.sim.target_calls import TargetCalls


class Scheduler(ChunkRules, LoadRoom):
    """Engine mixin: the requests, their queues and each step's scheduling."""

    # what it reads of the engine it is mixed into, beyond ChunkRules' (set by ``Engine.__init__``)
    capabilities: Capabilities
    target_calls: TargetCalls
    view: Any  # the target's view (kvprop.targets.protocol.View, a layer above the engine)
    hooks: Hooks
    connector: Connector | None
    # the worker's calls it makes (kvprop.sim.worker)
    _execute: Callable[[StepReport], None]
    _forget_states: Callable[[str], None]
    _settle_states: Callable[[Request, int], None]
    # the pipeline's (kvprop.sim.pipeline): its batch queue (None synchronously) and its rule
    batches: Any
    _decode_waits: Callable[[Request], bool]
    in_flight: Callable[[], int]
    frees_at_once: Callable[[Request], bool]  # and its deferred-free fence (kvprop.sim.fence)
    _free_blocks: Callable[[Request], None]

    # What an engine whose own scheduler is in charge may not do, as the drivers ask it
    # (kvprop.targets.vllm.scheduler says why for vLLM's): preempt when asked, fail a load.
    preempts_on_request = True

    @property
    def fails_loads(self) -> bool:
        return True

    def _init_scheduler(self) -> None:
        config = self.config
        self._init_chunking()
        # The scheduler caches a request's blocks again after each step that gave it a token,
        # before it frees a finished one (vLLM's ``update_from_output``): with drafts (the blocks
        # the accepted tokens filled), and from 0.34.0 with a state group and prefix caching too
        # ("Publish finalized states before retirement or completion"). With a state group and
        # no drafts the call caches nothing the allocation had not (366 walks each on kvprop's
        # allocator and on vLLM 0.34.0's manager: the same cache keys after every operation with
        # and without it); it is made as vLLM's scheduler makes it.
        self.caches_after_output = config.allocator.enable_caching and (
            config.speculative_tokens > 0 or bool(self.state_groups)
        )
        self.tells_steps = self.capabilities.step_notice
        self.copies_blocks = self.capabilities.block_copies
        # blocks a request's copies of shared blocks may take beyond its tables (max_blocks_needed)
        self.copy_reserve = len(self.specs) if config.allocator.partial_hits else 0
        self.registry: dict[int, tuple] = {}  # block hash -> (block index, prefix hashes): what it names
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loading: dict[str, Request] = {}
        self.loaded: list[Request] = []  # loads done, oldest admission first: continued before any admission
        self.admissions = 0  # how many admissions so far: each request's place in that order
        self.admitted_at: dict[str, int] = {}
        self.events: Counter = Counter()
        self.next_id = 0
        self.retired: deque[Request] = deque(maxlen=8)  # recently ended, for a buggy caller to free again
        self.last_hits: tuple | None = None  # (request id, hits, hit tokens) of the latest admission with a hit

    # ---- requests ---------------------------------------------------------------------------

    def max_blocks_needed(self, num_tokens: int) -> int:
        """At most what a request of ``num_tokens`` holds at once: a block per position and
        group, plus a state group's scratch columns, plus, when hits may end inside a block, the
        copy each group takes of a shared block (on admission after such a hit, or, in a state
        group, after keying its own running block). Without that copy in the pool a preempted
        request whose hit ends inside a block could never be admitted again."""
        scratch = sum(spec.speculative_blocks for spec in self.specs if isinstance(spec, Mamba))
        return len(self.specs) * cdiv(num_tokens + self.config.lookahead, self.block_size) + scratch + self.copy_reserve

    def add_request(self, prompt, max_new_tokens: int) -> Request:
        prompt = arrival(prompt, max_new_tokens)
        need = self.max_blocks_needed(len(prompt) + max_new_tokens)
        usable = self.config.allocator.usable_blocks
        if need > usable:
            raise RequestError(
                f"add_request: a request of {len(prompt)} prompt + {max_new_tokens} new tokens may need {need} blocks "
                f"({len(self.specs)} groups x ceil(({len(prompt)}+{max_new_tokens}+lookahead {self.config.lookahead})"
                f"/{self.block_size}), plus state groups' scratch columns and, with hits inside a block, one copy "
                f"per group) but the pool has only {usable} usable "
                f"blocks; it could never finish"
            )
        rid = f"r{self.next_id}"
        self.next_id += 1
        request = Request(
            rid, prompt, max_new_tokens, self.block_size, self.config.vocab, self.registry, self.config.allocator.unit
        )
        self.requests[rid] = request
        self.waiting.append(request)
        return request

    def get(self, request_id: str) -> Request:
        return live(self.requests, request_id)

    def is_admitted(self, request: Request) -> bool:
        return request.status in (Status.RUNNING, Status.LOADING, Status.LOADED, Status.ABORTING)

    def release(self, request: Request) -> None:
        """Give ``request``'s blocks back (finish, abort, preemption, a failed load): the seam a
        scheduler target takes over with its own scheduler's free, and the canary's fault
        (``kvprop.targets.canary``) skips once."""
        self.admitted_at.pop(request.request_id, None)
        self._free_blocks(request)
        self._forget_states(request.request_id)
        self.hooks.after_free(self, request)

    def _retire(self, request: Request, status: Status) -> None:
        request.status = status
        del self.requests[request.request_id]
        self.retired.append(request)

    def abort(self, request_id: str) -> None:
        request = self.get(request_id)
        if request.status is Status.LOADING:
            # The load still writes into the request's blocks: free them when it resolves.
            request.status = Status.ABORTING
            self.events[EV_ABORT_LOAD] += 1
            return
        if request.status is Status.ABORTING:
            return
        if request.status in (Status.RUNNING, Status.LOADED):
            (self.running if request.status is Status.RUNNING else self.loaded).remove(request)
            self.release(request)
        else:
            self.waiting.remove(request)
        self._retire(request, Status.ABORTED)

    def finish(self, request_id: str) -> None:
        """A stop condition hit early (e.g. a stop string): the running request ends now."""
        request = self.get(request_id)
        if request.status is not Status.RUNNING:
            raise RequestError(
                f"finish: request {request_id!r} is {request.status.value}, only running ones can finish"
            )
        self.running.remove(request)
        self.release(request)
        self._retire(request, Status.FINISHED)

    def preempt(self, request_id: str) -> None:
        request = self.get(request_id)
        if request.status is not Status.RUNNING:
            raise RequestError(
                f"preempt: request {request_id!r} is {request.status.value}, only running ones can be preempted"
            )
        self.running.remove(request)
        self._preempt(request)

    def _preempt(self, request: Request) -> None:
        if self.connector is not None and self.connector.unread:
            view, rid = self.view, request.request_id
            self._flush_saves(b for g in range(len(self.specs)) for b in view.request_block_ids(g, rid) or ())
        self.release(request)
        request.num_preemptions += 1
        self._wait_again(request, EV_PREEMPT)

    def _wait_again(self, request: Request, event: str) -> None:
        """``request`` gave its blocks back (``event``: a preemption, a failed load) and waits at
        the head of the queue to start again from nothing computed."""
        request.num_computed_tokens = 0
        request.num_stale, request.num_output_placeholders = request.num_in_flight, 0  # its output in flight is stale
        request.drop_drafts()
        request.status = Status.WAITING
        self.waiting.appendleft(request)
        self.events[event] += 1

    def reset_prefix_cache(self) -> bool:
        return self.target_calls.reset_prefix_cache()

    # ---- external loads ---------------------------------------------------------------------

    def take_kv_events(self) -> list | None:
        """The target's KV cache events since the last call; None when they are off."""
        if not self.config.allocator.enable_kv_cache_events:
            return None
        return self.target_calls.take_events()

    def offload_tier(self):
        """The offload tier a router learns of from the events (invariant 17): none, kvprop's
        connector publishes no events. A target whose tier does returns its lookup."""
        return None

    # ---- scheduling -------------------------------------------------------------------------

    def _allocate(self, request: Request, num_new_tokens: int, **kwargs):
        token = self.hooks.before_allocation(self, request, num_new_tokens, kwargs)
        held = self._table_lengths(request) if self.connector is not None and self.connector.unread else None
        try:
            result = self.target_calls.allocate_slots(request, num_new_tokens, **kwargs)
        except TargetCrash as crash:
            note = self.hooks.allocation_crashed(self, request, token)
            if note is None:
                raise
            crash.error.add_note(note)
            raise TargetCrash(crash.call, crash.error) from crash.error
        if result is not None and held is not None:
            view, rid = self.view, request.request_id
            self._flush_saves(
                b for g, before in enumerate(held) for b in (view.request_block_ids(g, rid) or ())[before:]
            )
        computed = (
            request.num_computed_tokens
            + kwargs.get("num_new_computed_tokens", 0)
            + kwargs.get("num_external_computed_tokens", 0)
        )
        if result is not None and any(spec.skipped_tokens(computed) >= self.block_size for spec in self.specs):
            self.events[EV_SKIP] += 1
        self.hooks.after_allocation(self, request, token, result, computed)
        return result

    def _table_lengths(self, request: Request) -> list[int]:
        """How many entries each of ``request``'s tables holds (0 where it holds none)."""
        view, rid = self.view, request.request_id
        return [len(view.request_block_ids(g, rid) or ()) for g in range(len(self.specs))]

    def _flush_saves(self, block_ids) -> None:
        """``block_ids`` were just handed out again (an allocation's new entries, a copy's
        destination) or given back by a preempted request: the saves still reading any of them
        read them now, before anything is written there (vLLM 0.34.0's ``jobs_to_flush``)."""
        if self.connector is not None and self.connector.unread:
            self.connector.flush(block_ids)

    def finish_save(self, job_id: int, ok: bool) -> None:
        """An asynchronous save to the external tier completes (``ok``) or fails."""
        if self.connector is None or job_id not in self.connector.saves:
            in_flight = sorted(self.connector.saves) if self.connector is not None else []
            raise RequestError(f"finish_save: no save {job_id} in flight; in flight: {in_flight}")
        self.connector.finish_save(job_id, ok)

    def why_not_finish(self, request_id: str) -> str | None:
        """Why ``Finish`` is not made for ``request_id`` now, or None: kvprop's scheduler finishes any request."""
        return None

    def step(self) -> StepReport:
        """One engine step: schedule, execute, take the output; with batches in flight, one turn of
        the batch queue instead (``kvprop.sim.pipeline``)."""
        if self.batches is not None:
            return self.batches.turn(self)
        report = StepReport()
        evictions = self.view.num_evictions if self.capabilities.evictions else 0
        self._schedule(report)
        self.hooks.before_execute(self, report)
        self._execute(report)
        self._advance(report)
        if self.capabilities.evictions and self.view.num_evictions > evictions:
            self.events[EV_EVICT] += 1
        return report

    def _schedule(self, report: StepReport) -> None:
        """What runs this step: running requests first (preempting under pressure), then loaded
        and waiting ones; the block copies the allocator queued."""
        if self.tells_steps:
            self.target_calls.new_step_starts()
        self.hooks.step_starts(self)
        budget = self.config.token_budget
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            start = request.num_computed_tokens
            left = request.num_tokens_with_spec + request.num_output_placeholders - start
            n = 0 if self._decode_waits(request) else self._chunk(request, start, min(left, budget))
            if n == 0:
                i += 1
                continue
            while (blocks := self._allocate(request, n, num_lookahead_tokens=self.config.lookahead)) is None:
                if not self.frees_at_once(self.running[-1]):
                    break  # a deferred free will not help this allocation (vLLM 0.30.0 on)
                victim = self.running.pop()
                self._preempt(victim)
                report.preempted.append(victim.request_id)
                if victim is request:
                    break
            if blocks is None:
                break  # vLLM: "Cannot schedule this request" (it preempted itself, or the fence holds)
            if request.status is Status.RUNNING:
                report.scheduled[request.request_id] = n
                budget -= n
                i += 1
        if not report.preempted:
            budget = self._admit(report, budget)
        if self.copies_blocks:
            report.copies = self.target_calls.take_kv_cache_block_copies()
            self._flush_saves(dest for _, dest in report.copies)

    def _admit(self, report: StepReport, budget: int) -> int:
        budget = self._continue_loaded(report, budget)
        if self.loaded:
            return budget  # the oldest admissions wait for room first: nothing passes them
        skipped: list[Request] = []
        try:
            return self._admit_waiting(report, budget, skipped)
        finally:
            self.waiting.extendleft(reversed(skipped))  # back at the head, in their order (vLLM's skip_request)

    @staticmethod
    def _waits_for_output(request: Request) -> bool:
        """A preempted request whose output is still in flight waits for it: resuming now could
        sample a position that output delivers (vLLM 0.34.0 ``Scheduler.schedule``)."""
        return request.num_stale > 0

    def _admit_waiting(self, report: StepReport, budget: int, skipped: list) -> int:
        while self.waiting and budget > 0:
            request = self.waiting[0]
            if self._waits_for_output(request):
                skipped.append(self.waiting.popleft())
                continue
            hits, num_hit = self._lookup(request)
            self.hooks.after_hit(self, request, hits, num_hit)
            if num_hit:
                self.last_hits = (request.request_id, hits, num_hit)
            ext, load_async = 0, False
            if self.connector is not None and not request.load_failed:
                ext = self.connector.num_new_matched_tokens(request, num_hit)
                self.hooks.after_offer(self, request, num_hit, ext)
                load_async = ext > 0 and self.connector.mode == "async"
            if self._batch_full() and not load_async:
                break  # vLLM's loads_only: a full batch still starts asynchronous loads
            remaining = min(request.num_tokens - num_hit - ext, budget)
            n = 0 if load_async else self._chunk(request, num_hit + ext, remaining)
            if n == 0 and remaining > 0 and not load_async:
                break  # a state group's chunk cannot end anywhere in this step's budget
            if load_async and not self._leaves_room_for_loads(request, num_hit + ext):
                break
            self._note_admission_events(request, hits, num_hit, ext, n)
            result = self._allocate(
                request,
                n,
                num_new_computed_tokens=num_hit,
                new_computed_blocks=hits,
                num_lookahead_tokens=self.config.lookahead,
                num_external_computed_tokens=ext,
                delay_cache_blocks=ext > 0,
            )
            if result is None:
                break
            self.waiting.popleft()
            report.admitted.append(request.request_id)
            self.admissions += 1
            self.admitted_at[request.request_id] = self.admissions
            request.num_computed_tokens = num_hit
            if ext > 0:
                assert self.connector is not None  # external tokens are the connector's offer
                tables = self.target_calls.get_block_ids(request.request_id)
                self.hooks.at_handoff(self, request, tables, num_hit, ext)
                self.connector.start_load(request, self.view.null_block_id, tables, num_hit, ext)
                if load_async:
                    request.status = Status.LOADING
                    request.pending_external = ext
                    self.loading[request.request_id] = request
                    continue
                request.num_computed_tokens += ext
                self.target_calls.cache_blocks(request, min(request.num_computed_tokens + n, request.num_tokens))
            request.status = Status.RUNNING
            self.running.append(request)
            report.scheduled[request.request_id] = n
            budget -= n
        return budget

    def _continue_loaded(self, report: StepReport, budget: int) -> int:
        """Requests whose load is done continue first, oldest admission first, each once its next
        chunk fits: until then it holds its blocks and cannot be preempted (it is not running),
        as vLLM keeps a finished load's request waiting with its blocks."""
        while self.loaded and budget > 0 and not self._batch_full():
            request = self.loaded[0]
            start = request.num_computed_tokens
            n = self._chunk(request, start, min(request.num_tokens - start, budget))
            if n == 0 or self._allocate(request, n, num_lookahead_tokens=self.config.lookahead) is None:
                break
            self.loaded.pop(0)
            request.status = Status.RUNNING
            self.running.append(request)
            report.scheduled[request.request_id] = n
            budget -= n
        return budget

    def _batch_full(self) -> bool:
        """``max_num_seqs`` requests run: none joins them this step (vLLM 0.34.0,
        ``Scheduler.schedule``: ``num_running >= self.max_num_active_reqs``)."""
        cap = self.config.max_num_seqs
        return cap is not None and len(self.running) >= cap

    def stall_signature(self, report: StepReport):
        """What a step that changed nothing leaves the same (None: the step did something). An
        engine step is a function of this state, so a second step with the same signature
        means none will ever change it: the drain judges liveness then."""
        busy = self.running or self.loading or self.in_flight()
        if report.scheduled or report.admitted or report.preempted or report.finished or busy:
            return None
        progress = tuple((r.request_id, r.status, r.num_computed_tokens) for r in self.requests.values())
        return self.view.num_free_blocks, progress

    def _lookup(self, request):
        """The target's hit for ``request``. A target may add vLLM's third value (0.30.0 on), the
        shared-prefix junction, which a scheduler stores on the request at every lookup for the
        allocator's retention to read (``kvprop.allocator.retention``); none means 0."""
        result = self.target_calls.get_computed_blocks(request)
        request.shared_prefix_boundary = result[2] if len(result) > 2 else 0
        return result[0], result[1]

    def _note_admission_events(self, request, hits, num_hit, ext, n) -> None:
        if num_hit and request.num_preemptions:
            self.events[EV_REHIT] += 1
        if ext and num_hit and len(hits) > 1:
            need = self.max_blocks_needed(num_hit + ext + n)
            head = set(self.view.free_queue_prefix(need))
            if any(b.block_id in head for group in hits for b in group):
                self.events[EV_CROSS_GROUP] += 1

    # ---- after the pass ---------------------------------------------------------------------

    def _advance(self, report: StepReport) -> None:
        """Each scheduled request's progress after the pass: verification, the sampled token, the end."""
        for rid, n in report.scheduled.items():
            request = self.requests[rid]
            request.num_computed_tokens += n
            verified = bool(request.spec_token_ids) and request.num_computed_tokens >= request.num_tokens
            if verified:
                self._verify(request)
            if request.num_computed_tokens == request.num_tokens:
                if request.num_output_tokens + 1 >= request.max_new_tokens:
                    if self.caches_after_output:
                        self.target_calls.cache_blocks(request, request.num_computed_tokens)
                    self.running.remove(request)
                    self.release(request)
                    self._retire(request, Status.FINISHED)
                    report.finished.append(rid)
                    continue
                request.append_token(request.next_token())
                self._propose(request)
                if self.caches_after_output:
                    self.target_calls.cache_blocks(request, request.num_computed_tokens)

    def _verify(self, request: Request) -> None:
        """The verification pass of a decode step: accepted drafts become tokens and the computed
        count steps back over the rejected ones, whose slots stay allocated for later steps to
        overwrite (vLLM's ``Scheduler.update_from_output``)."""
        drafts = request.num_computed_tokens - request.num_tokens
        accepted = request.verify_drafts(drafts)
        request.num_computed_tokens = request.num_tokens
        self.events[EV_SPEC_REJECT if accepted < drafts else EV_SPEC_ACCEPT] += 1
        if self.state_groups:
            self._settle_states(request, accepted)

    def _propose(self, request: Request) -> None:
        """Drafts for the next step, as many as the request may still emit after the token that
        verifies them (so a step never appends past ``max_new_tokens``)."""
        room = request.max_new_tokens - request.num_output_tokens - 1
        k = min(self.config.speculative_tokens, room)
        if k > 0:
            request.propose_drafts(k)
