"""vLLM's scheduler with batches in flight: its engine core's batch queue, kvprop the model runner.

With ``EngineConfig.pipeline_depth`` above 1 the scheduler target builds vLLM's
``AsyncScheduler`` (``kvprop.targets.vllm.config``) and each engine step is one turn of
``kvprop.sim.pipeline.BatchQueue``, the shape of ``EngineCore.step_with_batch_queue``
(``vllm/v1/engine/core.py``, 0.34.0): ``schedule()`` hands out a batch, which the worker runs
when its output is taken, through the block ids that batch gave it, and ``update_from_output``
takes the output of the oldest batch in flight. Between the two, kvprop's operations abort,
stop or add requests and reset the prefix cache, as a client does while a batch runs.

The model runner samples what the positions a batch computed decode to (the token after a
batch's last position), whatever happened to the request since: an output that comes back
after its request was preempted is the one the pass computed, which vLLM delivers as stale
(``Scheduler._preempt_request``). kvprop's record of a request mirrors vLLM's counters: its
computed tokens include those in flight, its placeholders are vLLM's ``num_output_placeholders``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from kvprop.sim.pipeline import Batch, Row
from kvprop.sim.step_report import StepReport


class SchedulerBatches:
    """SchedulerEngine mixin: ``kvprop.sim.pipeline.Pipelined`` over vLLM's own scheduler."""

    scheduler: Any
    requests: dict
    worker: dict
    hooks: Any
    report: StepReport | None
    s: Any  # vLLM's scheduler API (kvprop.targets.vllm.loading.import_scheduler)
    # the engine's own (kvprop.targets.vllm.scheduler, kvprop.sim.pipeline)
    _call: Callable[..., Any]
    _hand_to_worker: Callable[[Any], dict]
    _run_pass: Callable[[Batch], None]
    _dispatch: Callable[[list[Row]], None]
    _take_outputs: Callable[[StepReport, Any], None]
    # the worker side of vLLM's offloading connector (kvprop.targets.vllm.offload)
    stores_due: list
    _start_transfers: Callable[[Any], None]
    _before_pass: Callable[[Any], None]
    _after_pass: Callable[[Any, list], None]
    _connector_output: Callable[[], Any]

    def fenced_blocks(self) -> Counter:
        """Block id -> the references vLLM's deferred frees hold: a freed request's blocks while
        its last batch is in flight (``Scheduler.deferred_frees``, 0.24.0 on; kvprop.sim.fence)."""
        if not self.s.fences_frees or not self.scheduler.deferred_frees:
            return Counter()
        return Counter(block.block_id for _, blocks in self.scheduler.deferred_frees for block in blocks)

    def has_work(self) -> bool:
        """The engine core schedules while the scheduler holds unfinished requests (``has_requests``)."""
        return bool(self._call("Scheduler.has_requests", self.scheduler.has_requests))

    def schedule_batch(self) -> Batch:
        report = self.report = StepReport()
        self.hooks.step_starts(self)
        try:
            output = self._call("Scheduler.schedule", self.scheduler.schedule)
            starts = self._hand_to_worker(output)
            report.copies = [(c.src_block_id, c.dst_block_id) for c in self._copies(output)]
            batch = Batch(report, output=output)
            meta = self._connector_meta(output)
            if meta is not None:
                # the worker takes the batch's transfers as it launches it: the stores a reused
                # block owes are flushed, and a load runs outside the stream, not after the
                # batches still in flight (what vLLM's deferred-free fence is for)
                self._start_transfers(meta)
            for rid, n in output.num_scheduled_tokens.items():
                report.scheduled[rid] = n
                request = self.requests[rid]
                vreq = self.scheduler.requests[rid]
                request.num_computed_tokens = vreq.num_computed_tokens
                request.num_in_flight += n
                request.num_output_placeholders = vreq.num_output_placeholders
                samples = starts[rid] + n >= request.num_tokens  # the chunk reaches every token known
                tables = [list(table) for table in self.worker[rid]]
                batch.rows.append(Row(request, starts[rid], n, tables, samples))
            self._dispatch(batch.rows)
        finally:
            self.report = None
        return batch

    def complete_batch(self, batch: Batch) -> StepReport:
        report = self.report = StepReport(copies=batch.report.copies)
        try:
            meta = self._connector_meta(batch.output)
            self._before_pass(meta)
            self._run_pass(batch)
            due, self.stores_due = self.stores_due, []
            self._after_pass(meta, due)
            ids, sampled = [], []
            for row in batch.rows:
                request = row.request
                ids.append(request.request_id)
                sampled.append([request.token_after(row.start + row.num_tokens - 1)] if row.samples else [])
                if self.requests.get(request.request_id) is request:
                    request.num_in_flight -= row.num_tokens
                    request.num_stale = max(0, request.num_stale - row.num_tokens)
            extra = {"req_id_to_index": {rid: i for i, rid in enumerate(ids)}} if self.s.indexed_outputs else {}
            if self.scheduler.connector is not None:
                extra["kv_connector_output"] = self._connector_output()
            model_output = self.s.ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled, **extra)
            self._call("Scheduler.update_from_output", self.scheduler.update_from_output, batch.output, model_output)
            self._take_outputs(StepReport(scheduled=dict(batch.report.scheduled)), batch.output)
            for row in batch.rows:
                vreq = self.scheduler.requests.get(row.request.request_id)
                if vreq is not None and self.requests.get(row.request.request_id) is row.request:
                    row.request.num_output_placeholders = vreq.num_output_placeholders
        finally:
            self.report = None
        return report

    @staticmethod
    def _connector_meta(output):
        """The connector's metadata a batch carries (None without a connector)."""
        return getattr(output, "kv_connector_metadata", None)

    @staticmethod
    def _copies(output) -> list:
        """The block copies a batch's pass runs first (vLLM 0.30.0 on; hits inside a block)."""
        return list(getattr(output, "kv_cache_block_copies", None) or ())
