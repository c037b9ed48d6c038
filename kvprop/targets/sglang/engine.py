"""SGLang's scheduler and radix cache as a kvprop target (``--target sglang``).

kvprop's operations reach SGLang as the requests a server receives: a request arrives (the
scheduler validates it and clips its generation as ``handle_generate_request`` does), a client
disconnects (``abort_request``), the model samples EOS for a request (kvprop's ``Finish``), an
operator flushes the cache (``flush_cache``), and the event loop turns (``Step``). Admission,
chunking, eviction and retraction under decode memory pressure are SGLang's own; kvprop does not
retract a request of its choosing (``Preempt`` is not made: SGLang's ``retract_decode`` picks).

The engine plays the model: at each batch SGLang prepared, it reads what every request's forward
pass reads from SGLang's KV buffers (judged by ``kvprop.check.sglang_data``), then writes each
computed position's fingerprint into the slots SGLang's ``req_to_token`` row names. kvprop's
records mirror SGLang's requests (waiting, running, ended) so that the operations pick among
them as for any target. ``kvprop.check.checker`` judges this engine in SGLang's terms
(``kvprop.check.sglang``) after every operation and every step.
"""

from __future__ import annotations

from collections import Counter

import attrs

from kvprop.allocator.specs import EngineConfig
from kvprop.capabilities import NONE
from kvprop.check.sglang import pool_totals
from kvprop.check.sglang_data import extend_fingerprints
from kvprop.errors import RequestError
from kvprop.sim.engine import StepReport
from kvprop.sim.events import EV_EVICT, EV_PREEMPT, EV_REHIT
from kvprop.sim.hooks import Hooks
from kvprop.sim.request import Status, arrival, live
from kvprop.sim.target_calls import OwnLoopCalls
from kvprop.targets.sglang.scheduler import SglangScheduler
from kvprop.targets.sglang.shape import sglang_config, window_positions

TOKEN_OFFSET = 3  # kvprop's token t is SGLang's t + 3: the tiny model's ids below 3 are special (EOS is 2)


def build_engine(config: EngineConfig, device=None, hooks=None, canary: bool = False, tree_core: str = "python"):
    """The target's entry point: it builds the whole engine (``own_scheduler``). SGLang's pools
    live where its CPU build puts them; ``device`` other than the CPU is refused."""
    from kvprop.errors import ConfigError

    name = "sglang" if tree_core == "python" else f"sglang-{tree_core}"
    if device not in (None, "cpu"):
        raise ConfigError(f"target {name!r} runs SGLang's CPU build: device must be 'cpu', got {device!r}")
    if canary:
        raise ConfigError(f"target {name!r}: the canary fault is kvprop's engine's; it does not apply here")
    return SglangEngine(config, hooks=hooks, tree_core=tree_core)


def build_rust_core_engine(config: EngineConfig, device=None, hooks=None, canary: bool = False):
    """``--target sglang-rust``: the same loop over SGLang's Rust tree core, the default core of
    the releases that ship one (``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND``, 0.5.19 on)."""
    return build_engine(config, device, hooks, canary, tree_core="rust")


@attrs.define
class SglangRecord:
    """kvprop's record of one SGLang request: what the operations and the drain read."""

    request_id: str
    prompt: list
    max_new_tokens: int
    status: Status = Status.WAITING
    num_output_tokens: int = 0
    retracted: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + self.num_output_tokens


@attrs.define
class SglangView:
    """What the operations read of the pool, in blocks: pages."""

    engine: SglangEngine
    num_blocks: int
    block_size: int

    @property
    def num_free_blocks(self) -> int:
        return self.engine.scheduler.allocator.available_size() // self.block_size


class SglangEngine(OwnLoopCalls):
    """kvprop's engine interface over an ``SglangScheduler``."""

    terms = "sglang"  # judged in SGLang's terms (kvprop.check.checker)
    preempts_on_request = False
    fails_loads = False
    connector = None
    capabilities = NONE

    def __init__(self, config: EngineConfig, hooks: Hooks | None = None, tree_core: str = "python"):
        self.config = config
        self.hooks = hooks or Hooks()
        self.sglang = attrs.evolve(sglang_config(config), tree_core=tree_core)
        self.scheduler = SglangScheduler(self.sglang, forward=self._forward)
        self.release = self.scheduler.release
        self.view = SglangView(self, config.allocator.num_blocks, config.allocator.block_size)
        self.requests: dict[str, SglangRecord] = {}
        self.waiting: list[SglangRecord] = []
        self.running: list[SglangRecord] = []
        self.retired: list[str] = []
        self.loading: dict = {}
        self.loaded: tuple = ()
        self.events: Counter = Counter()
        self.next_id = 0
        self._fingerprints: dict[str, list[int]] = {}
        self._evicted = False
        self._aborted: set[str] = set()
        kv = self.scheduler.kvcache
        # the full-attention layer is 1 beside a window layer 0 (SglangScheduler's SWAKVPool), else 0
        self._full = kv.get_key_buffer(1 if self.sglang.swa else 0)[:, 0, 0]
        self._window = kv.get_key_buffer(0)[:, 0, 0] if self.sglang.swa else None
        self._observe_evictions()

    # ---- observing SGLang ------------------------------------------------------------------
    def _observe_evictions(self) -> None:
        """The tree's eviction entry points call through unchanged; an eviction that freed
        cached tokens is counted as kvprop's eviction event."""
        tree = self.scheduler.tree_cache
        for name in ("evict", "evict_for_alloc") if self.release.evict_for_alloc else ("evict",):
            real = getattr(tree, name)  # the bound method the instance attribute wraps

            def observed(*args, _real=real, **kwargs):
                before = tree.evictable_size()
                result = _real(*args, **kwargs)
                self._evicted = self._evicted or tree.evictable_size() < before
                return result

            setattr(tree, name, observed)

    # ---- the model -------------------------------------------------------------------------
    def _forward(self, batch) -> None:
        self._hook(self._forward_pass, batch)

    def _forward_pass(self, batch) -> None:
        """The batch writes the positions it computes, then each request reads its computed
        prefix. A layer stores the whole batch's new keys and values before its attention reads
        (``set_kv_buffer`` ahead of the kernel in every backend's ``forward_extend`` and
        ``forward_decode``), so a slot handed to one request while another still attends it is
        read back overwritten, whichever comes first in the batch."""
        rel, rows = self.release, self.scheduler.req_to_token_pool.req_to_token
        extend = batch.forward_mode.is_extend()
        passes = []
        for req in batch.reqs:
            tokens = [*req.origin_input_ids, *req.output_ids]
            if extend:
                start, end = rel.prefix_len(req), rel.extend_end(req)
            else:
                end = len(tokens)
                start = end - 1
            expected = extend_fingerprints(self._fingerprints.setdefault(req.rid, []), tokens)
            slots = rows[rel.req_pool_idx(req), :end].tolist()
            self._write(slots[start:end], expected[start:end])
            passes.append((req.rid, start, slots, expected))
        window = self.sglang.sliding_window
        for rid, start, slots, expected in passes:
            self.hooks.before_read(self, rid, "full-attention", range(start), slots[:start], expected)
            if self._window is not None and window is not None:
                attended = window_positions(start, window)
                self.hooks.before_read(self, rid, "sliding-window", attended, slots[attended.start : start], expected)

    def _write(self, slots: list[int], values: list[int]) -> None:
        if not slots:
            return
        self._full[slots] = self.scheduler.sg.torch.tensor(values, dtype=self._full.dtype)
        if self._window is not None:
            swa = self.window_slots(slots)
            self._window[swa] = self.scheduler.sg.torch.tensor(values, dtype=self._window.dtype)

    def window_slots(self, slots: list[int]) -> list[int]:
        """The sliding-window pool's slots for full-pool ``slots`` (SGLang's own translation)."""
        torch = self.scheduler.sg.torch
        return self.scheduler.kvcache.translate_loc_from_full_to_swa(torch.tensor(slots)).tolist()

    def read(self, layer: str, slots: list[int]) -> list[float]:
        """What ``slots`` of ``layer`` hold (full-pool slots; the window layer's are translated)."""
        if layer == "full-attention":
            return self._full[slots].tolist()
        assert self._window is not None
        return self._window[self.window_slots(slots)].tolist()

    def differential_state(self) -> dict:
        """What two tree cores fed the same walk must agree on (``kvprop agree --target
        sglang-rust``; SGLang means its cores to agree, and tests them against one interface): the
        slots each live request's row holds, what the tree caches, and each pool's available,
        evictable and protected totals (``pool_totals``, which conservation judges too)."""
        sched, rel = self.scheduler, self.release
        rows = sched.req_to_token_pool.req_to_token
        held = {
            req.rid: rows[rel.req_pool_idx(req), : req.kv.kv_allocated_len].tolist()
            for req in sched.live_requests()
            if rel.holds_kv(req)
        }
        cached = sorted(sched.tree_cache.all_values_flatten().tolist())
        return {"rows": held, "cached slots": cached, "pools": pool_totals(sched)}

    # ---- operations ------------------------------------------------------------------------
    def add_request(self, prompt, max_new_tokens: int) -> SglangRecord:
        prompt = arrival(prompt, max_new_tokens)
        rid = f"r{self.next_id}"
        self.next_id += 1
        sglang_prompt = [t + TOKEN_OFFSET for t in prompt]
        req = self._call(
            "Scheduler.handle_generate_request", self.scheduler.add_request, rid, sglang_prompt, max_new_tokens
        )
        record = SglangRecord(rid, prompt, req.sampling_params.max_new_tokens)
        self.requests[rid] = record
        self.waiting.append(record)
        return record

    def max_blocks_needed(self, num_tokens: int) -> int:
        """Pages a request of ``num_tokens`` holds at most, counted per kvprop group as the
        operations count them (SGLang's full pool holds them; a window pool holds fewer)."""
        return len(self.config.allocator.groups) * -(-num_tokens // self.sglang.page_size)

    def get(self, request_id: str) -> SglangRecord:
        return live(self.requests, request_id)

    def abort(self, request_id: str) -> None:
        self.get(request_id)
        self._call("Scheduler.abort_request", self.scheduler.abort, request_id)
        if self.scheduler.request(request_id) is None:  # a waiting request leaves at once
            self._end(request_id, Status.ABORTED)
        else:  # a running one finishes on its next forward, the chunked one at the next step's start
            self._aborted.add(request_id)

    def why_not_finish(self, request_id: str) -> str | None:
        """None: SGLang finishes a request on whatever token the model samples next."""
        return None

    def finish(self, request_id: str) -> None:
        record = self.get(request_id)
        if record.status is not Status.RUNNING:
            raise RequestError(f"finish: request {request_id!r} is {record.status.value}, only running ones can finish")
        self.scheduler.stop(request_id)

    def preempt(self, request_id: str) -> None:
        raise RequestError("preempt: SGLang retracts by its own policy, under decode memory pressure; not made")

    def misuse(self, call: str, index: int) -> str:
        return "not made: SGLang's target declares no caller contract (malformed calls are not made)"

    def reset_prefix_cache(self) -> bool:
        flushed = bool(self._call("Scheduler.flush_cache", self.scheduler.reset_prefix_cache))
        if flushed:
            self._fingerprints = {rid: fps for rid, fps in self._fingerprints.items() if rid in self.requests}
        return flushed

    def take_kv_events(self) -> None:
        return None

    def offload_tier(self) -> None:
        return None

    def in_flight(self) -> int:
        """Batches in flight: none, SGLang's normal loop processes each batch's result in its turn."""
        return 0

    def stall_signature(self, report: StepReport):
        """A step that ran no batch: the requests waiting and the pool as they stand (SGLang's
        loop is deterministic, so two such steps alike repeat forever); None after a batch."""
        if report.scheduled or report.finished:
            return None
        sched = self.scheduler
        tree = sched.tree_cache
        return (tuple(r.rid for r in sched.waiting_queue), sched.allocator.available_size(), tree.evictable_size())

    # ---- a step ----------------------------------------------------------------------------
    def step(self) -> StepReport:
        self._evicted = False
        result = self._call("Scheduler.event_loop_normal", self.scheduler.step)
        report = StepReport(scheduled=dict(result.scheduled))
        for rid in result.admitted:
            record, req = self.requests[rid], self.scheduler.request(rid)  # None: it finished in this step
            if record.retracted and req is not None and self.release.prefix_len(req) > 0:
                self.events[EV_REHIT] += 1
            record.status, record.retracted = Status.RUNNING, False
            self.waiting.remove(record)
            self.running.append(record)
            report.admitted.append(rid)
        for rid in result.retracted:
            record = self.requests[rid]
            record.status, record.retracted = Status.WAITING, True
            self.running.remove(record)
            self.waiting.append(record)
            self.events[EV_PREEMPT] += 1
            report.preempted.append(rid)
        for rid in result.finished:
            if rid in self.requests:
                self._end(rid, Status.ABORTED if rid in self._aborted else Status.FINISHED)
                report.finished.append(rid)
        for record in self.running:
            req = self.scheduler.request(record.request_id)
            if req is not None:
                record.num_output_tokens = len(req.output_ids)
        if self._evicted:
            self.events[EV_EVICT] += 1
        return report

    def _end(self, request_id: str, status: Status) -> None:
        record = self.requests.pop(request_id)
        record.status = status
        (self.waiting if record in self.waiting else self.running).remove(record)
        self.retired.append(request_id)
        self._fingerprints.pop(request_id, None)
        self._aborted.discard(request_id)
