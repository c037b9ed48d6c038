"""The deferred-free fence: a request's blocks wait for its last batch in flight.

With batches in flight (``max_concurrent_batches > 1``) and a KV connector that loads
(``is_kv_consumer``), vLLM's scheduler sets ``defer_block_free``: the connector's load into a
block runs outside the GPU stream, so it is not ordered after a write a batch in flight still
makes there. A request freed while its last batch is in flight (aborted, finished by a stop
condition, preempted) has its blocks taken from it (``pop_blocks_for_free``) but returned to the
pool only once that batch's output is processed (``Scheduler._free_request_blocks``,
``_drain_deferred_frees`` at the head of ``update_from_output``). Steps are counted only where
they schedule tokens: ``sched_step_seq`` as a batch is scheduled, ``processed_step_seq`` as its
output comes back; a request keeps the step it was last scheduled in (``last_sched_seq``), and
its blocks are freed at once when that step is processed. ``vllm/v1/core/sched/scheduler.py``,
0.24.0 to 0.34.0; from 0.30.0 a request whose blocks cannot be freed at once is no preemption
victim ("A deferred free will not help with immediate allocation").
"""

from __future__ import annotations

from collections import Counter, deque

import attrs


@attrs.define
class FreeFence:
    """The scheduler's step counters and its deferred frees, oldest fence first."""

    scheduled: int = 0  # sched_step_seq: batches scheduled with tokens
    processed: int = 0  # processed_step_seq: their outputs processed
    deferred: deque = attrs.field(factory=deque)  # (fence, block ids in table order)

    def batch_scheduled(self) -> int:
        """A batch with tokens is scheduled: its step number, which its requests record."""
        self.scheduled += 1
        return self.scheduled

    def frees_at_once(self, last_scheduled: int) -> bool:
        """Whether a request last scheduled in step ``last_scheduled`` can be freed now."""
        return last_scheduled <= self.processed

    def defer(self, block_ids: list[int]) -> None:
        """A request's blocks, taken from it, wait for every step scheduled so far."""
        if block_ids:
            self.deferred.append((self.scheduled, block_ids))

    def batch_processed(self) -> list[list[int]]:
        """A batch with tokens is back: the deferred frees its step releases, oldest first. The
        fences are in order, so the first pending one stops the drain."""
        self.processed += 1
        released = []
        while self.deferred and self.deferred[0][0] <= self.processed:
            released.append(self.deferred.popleft()[1])
        return released

    def held(self) -> Counter:
        """Block id -> the references the deferred frees hold on it."""
        return Counter(block_id for _, block_ids in self.deferred for block_id in block_ids)
