"""The pipelined scheduler: batches scheduled ahead of their output, completed oldest first.

A served vLLM runs ``EngineCore.step_with_batch_queue`` (``vllm/v1/engine/core.py``, 0.23.0 to
0.34.0) whenever ``VllmConfig.max_concurrent_batches`` exceeds 1: 2 with its asynchronous
scheduler, one more per further pipeline stage. One turn of its loop schedules a batch while
fewer than that many are in flight (an empty one too, while the scheduler holds requests),
and returns at once unless the queue is now full or nothing more can be scheduled; otherwise
it waits for the oldest batch and hands its output to ``update_from_output``. SGLang's overlap
loop has the same shape at depth 2. ``BatchQueue.turn`` is that loop, one turn per engine
step, for every engine kvprop drives; the engine supplies ``has_work``, ``schedule_batch``
and ``complete_batch``.

The worker executes a batch when it completes, through the block ids the batch was scheduled
with (a GPU stream runs batches in order, and the scheduler learns a batch is done only from
its output): a request aborted, finished or preempted while its batch is in flight is still
written there. Its writes are judged when it is dispatched, the state they run against.
``Pipeline`` is kvprop's own engine's side of it, as vLLM's ``AsyncScheduler``
(``vllm/v1/core/sched/async_scheduler.py``, ``Scheduler._update_after_schedule``,
``update_from_output`` and ``_preempt_request`` of ``vllm/v1/core/sched/scheduler.py``, 0.34.0)
counts a batch in flight: its tokens computed at once and in flight until their output, an
output placeholder per batch that samples, a preempted request's in-flight output delivered but
stale, and no resumption while it is still to come.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from typing import Any, Protocol

import attrs

from kvprop.allocator.hashing import fingerprint
from kvprop.allocator.specs import EngineConfig
from kvprop.sim.events import EV_DEFERRED_FREE, PIPELINE_EVENTS
from kvprop.sim.fence import FreeFence
from kvprop.sim.hooks import Hooks
from kvprop.sim.memory import PagedMemory
from kvprop.sim.request import Request, Status
from kvprop.sim.step_report import StepReport
from kvprop.sim.target_calls import TargetCalls


@attrs.define
class Row:
    """One request's part of a batch: its record, the positions computed, the worker's tables
    when the batch was scheduled, and whether the batch samples its next token."""

    request: Request
    start: int
    num_tokens: int
    tables: list[list[int]]
    samples: bool


@attrs.define
class Batch:
    """A scheduled batch: what its step reported, its rows, and the engine's own record of it
    (vLLM's scheduler output)."""

    report: StepReport
    rows: list[Row] = attrs.field(factory=list)
    output: Any = None
    fence: int = 0  # its step number under the deferred-free fence (kvprop.sim.fence); 0 without


class Pipelined(Protocol):
    """What ``BatchQueue`` drives: an engine that schedules and completes batches apart."""

    events: Counter

    def has_work(self) -> bool: ...

    def schedule_batch(self) -> Batch: ...

    def complete_batch(self, batch: Batch) -> StepReport: ...


@attrs.define
class BatchQueue:
    """The engine core's batch queue (``step_with_batch_queue``): at most ``depth`` batches in flight."""

    depth: int
    in_flight: deque = attrs.field(factory=deque)  # newest first, as vLLM's appendleft / pop

    def turn(self, engine: Pipelined) -> StepReport:
        """One engine step: schedule ahead while there is room, else complete the oldest batch."""
        scheduled = None
        if engine.has_work():
            batch = engine.schedule_batch()
            self.in_flight.appendleft(batch)
            if len(self.in_flight) > 1:
                engine.events[PIPELINE_EVENTS[min(len(self.in_flight), 3) - 2]] += 1
            if len(self.in_flight) < self.depth and (batch.report.scheduled or engine.has_work()):
                return batch.report
            scheduled = batch.report
        if not self.in_flight:
            return StepReport()
        done = engine.complete_batch(self.in_flight.pop())
        if scheduled is not None:
            done.scheduled, done.admitted = scheduled.scheduled, scheduled.admitted
            done.preempted = scheduled.preempted + done.preempted
        return done

    def pending_blocks(self, block_size: int) -> set[int]:
        """The blocks batches in flight will write into: what they do not hold yet."""
        blocks: set[int] = set()
        for batch in self.in_flight:
            for row in batch.rows:
                first, last = row.start // block_size, (row.start + row.num_tokens - 1) // block_size
                for table in row.tables:
                    blocks.update(table[first : last + 1])
        return blocks


class Pipeline:
    """Engine mixin: kvprop's own scheduler with batches in flight (``EngineConfig.pipeline_depth``)."""

    # what it reads of the engine it is mixed into (``kvprop.sim.engine``, the scheduler and the worker)
    config: EngineConfig
    block_size: int
    requests: dict[str, Request]
    running: list[Request]
    waiting: deque[Request]
    hooks: Hooks
    memory: PagedMemory
    target_calls: TargetCalls
    events: Counter
    caches_after_output: bool
    _schedule: Callable[[StepReport], None]
    worker_block_ids: Callable[[str], Any]
    release: Callable[[Request], None]
    _retire: Callable[[Request, Status], None]

    def _init_pipeline(self) -> None:
        depth = self.config.pipeline_depth
        self.batches = BatchQueue(depth) if depth > 1 else None
        self.sched_steps = 0  # schedule() calls so far (vLLM's current_step)
        self.fence = FreeFence() if self.config.fences_frees else None  # kvprop.sim.fence

    def fenced_blocks(self) -> Counter:
        """Block id -> the references deferred frees hold on it (invariant 1 counts them)."""
        return Counter() if self.fence is None else self.fence.held()

    def frees_at_once(self, request: Request) -> bool:
        """Whether ``request``'s blocks return to the pool as soon as it gives them back: always,
        but while the deferred-free fence holds it (its last batch is in flight)."""
        return self.fence is None or self.fence.frees_at_once(request.last_sched_seq)

    def why_not_preempt(self, request_id: str) -> str | None:
        """Why ``Preempt`` is not made for ``request_id`` now, or None: vLLM preempts no request
        whose blocks it cannot free at once (``_request_blocks_can_be_freed``, 0.30.0 on)."""
        if self.frees_at_once(self.requests[request_id]):
            return None
        return f"{request_id}'s last batch is in flight: a preemption would only defer its free"

    def _free_blocks(self, request: Request) -> None:
        """Freed at once, or, while the fence holds ``request`` (its last batch is in flight),
        taken from it and freed when that batch is back."""
        if self.frees_at_once(request):
            self.target_calls.free(request)
            return
        assert self.fence is not None  # only the fence holds a request back
        self.fence.defer(self.target_calls.pop_blocks_for_free(request))
        self.events[EV_DEFERRED_FREE] += 1

    def pending_blocks(self) -> set[int]:
        """The blocks batches in flight will write into (none synchronously): the data oracle
        judges them once their batch is back (a GPU stream orders every later reader after it)."""
        return set() if self.batches is None else self.batches.pending_blocks(self.block_size)

    def in_flight(self) -> int:
        """How many batches are in flight."""
        return 0 if self.batches is None else len(self.batches.in_flight)

    def has_work(self) -> bool:
        """vLLM's ``has_requests``: some request is unfinished."""
        return bool(self.requests)

    def _decode_waits(self, request: Request) -> bool:
        """Whether a running request is not scheduled this step although it has tokens to go: its
        outputs in flight already reach its last token (vLLM 0.34.0 ``Scheduler.schedule``: "avoid
        scheduling an extra step when we are sure that the previous step has reached max_tokens"),
        or, with pipeline stages, it decoded fewer than that many steps ago
        (``next_decode_eligible_step``)."""
        if self.batches is None:
            return False
        placeholders = request.num_output_placeholders
        last = request.num_prompt_tokens + request.max_new_tokens
        if placeholders and request.num_computed_tokens + 2 - placeholders >= last:
            return True
        return self.sched_steps < request.decode_at

    def schedule_batch(self) -> Batch:
        """Schedule one batch and count it in flight (vLLM's ``_update_after_schedule``)."""
        self.sched_steps += 1
        report = StepReport()
        self._schedule(report)
        self.hooks.before_execute(self, report)  # what it schedules, judged as it is dispatched
        batch = Batch(report)
        if self.fence is not None and sum(report.scheduled.values()) > 0:
            batch.fence = self.fence.batch_scheduled()
        stagger = self.config.pipeline_depth - 1  # vLLM's decode_stagger: its pipeline stages
        for rid, n in report.scheduled.items():
            request = self.requests[rid]
            start = request.num_computed_tokens
            tables = [list(t) for t in self.worker_block_ids(rid)]
            request.num_computed_tokens += n
            request.num_in_flight += n
            request.last_sched_seq = batch.fence or request.last_sched_seq
            samples = request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders
            if samples:
                request.num_output_placeholders += 1
                request.decode_at = self.sched_steps + stagger
            batch.rows.append(Row(request, start, n, tables, samples))
        self._dispatch(batch.rows)
        return batch

    def _dispatch(self, rows: list[Row]) -> None:
        """Every row's writes judged as its batch is dispatched: a GPU stream runs a batch before
        anything scheduled after it, so a block a later schedule frees or hands on is written
        by this batch first (the frees that a transfer outside the stream could overtake are
        the connector's, not modelled with batches in flight)."""
        for row in rows:
            for g, table in enumerate(row.tables):
                self.hooks.before_write(self, row.request, g, table, row.start, row.num_tokens)

    def complete_batch(self, batch: Batch) -> StepReport:
        """The batch's pass runs, then its output comes back (vLLM's ``update_from_output``)."""
        report = StepReport(copies=batch.report.copies)
        self._run_pass(batch)
        if batch.fence and self.fence is not None:  # every write up to this batch has run: its fenced frees go back
            for block_ids in self.fence.batch_processed():
                self.target_calls.free_popped_blocks(block_ids)
        for row in batch.rows:
            self._take_row_output(row, report)
        return report

    def _run_pass(self, batch: Batch) -> None:
        """The batch's forward pass: the block copies its schedule queued, then its rows' writes."""
        for source, dest in batch.report.copies:
            self.memory.copy_block(source, dest)
        self._write_rows(batch.rows)

    def _write_rows(self, rows: list[Row]) -> None:
        """Every row's positions written through the tables it was scheduled with."""
        bs, slots, values = self.block_size, [], []
        for row in rows:
            request = row.request
            end = row.start + row.num_tokens
            while request.num_tokens < end and request.status not in (Status.RUNNING, Status.WAITING):
                request.append_token(request.next_token())  # an ended request's outputs, as the model computes them
            for g, table in enumerate(row.tables):
                for p in range(row.start, end):
                    slots.append(table[p // bs] * bs + p % bs)
                    values.append(fingerprint(g, p, request.prefix[p]))
        self.memory.write(slots, values)

    def _take_row_output(self, row: Row, report: StepReport) -> None:
        """One row's output: a stale one is delivered without touching the counters a preemption
        reset; a fresh one resolves a placeholder and appends the sampled token or ends the request."""
        request = row.request
        if self.requests.get(request.request_id) is not request:
            return  # it ended while its batch was in flight: the output is dropped
        request.num_in_flight -= row.num_tokens
        stale = request.num_stale > 0
        if stale:
            request.num_stale -= row.num_tokens
        if not row.samples:
            return
        if not stale:
            request.num_output_placeholders -= 1
        token = request.token_after(row.start + row.num_tokens - 1)
        if request.num_output_tokens + 1 >= request.max_new_tokens:
            self._end_after_output(request, report)
            return
        request.append_token(token)
        if self.caches_after_output and not stale and request.status is Status.RUNNING:
            self.target_calls.cache_blocks(request, request.num_settled_tokens)

    def _end_after_output(self, request: Request, report: StepReport) -> None:
        """Its last token came back: it ends, from the running queue or, preempted, the waiting one."""
        if request.status is Status.RUNNING:
            self.running.remove(request)
            self.release(request)
        else:
            self.waiting.remove(request)
        self._retire(request, Status.FINISHED)
        report.finished.append(request.request_id)
