"""How many blocks the loads in flight still take, whether the pool has room for one more, and a load's end.

A mixin of the scheduler (``kvprop.sim.scheduler``). A loading or loaded request holds its
blocks and cannot be preempted, so an asynchronous load is admitted only where the pool keeps
what every other load takes to finish, and, while a request runs, what its next verification
step takes (vLLM's in-flight reservation, ``Scheduler._inflight_prefill_reserved_blocks``,
0.24.0 on, and ``Scheduler._spec_decode_step_blocks``, 0.33.0).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from kvprop.allocator.specs import EngineConfig, GroupSpec, cdiv
from kvprop.errors import RequestError
from kvprop.sim.connector import Connector
from kvprop.sim.events import EV_LOAD_FAIL
from kvprop.sim.hooks import Hooks
from kvprop.sim.request import Request, Status
from kvprop.sim.target_calls import TargetCalls


class LoadRoom:
    """Scheduler mixin: the blocks loads and drafts keep back."""

    # what it reads of the engine it is mixed into (set by ``Engine.__init__`` and the scheduler)
    config: EngineConfig
    specs: tuple[GroupSpec, ...]
    state_groups: frozenset[int]
    target_calls: TargetCalls
    view: Any  # the target's view (kvprop.targets.protocol.View, a layer above the engine)
    running: list[Request]
    loading: dict[str, Request]
    loaded: list[Request]
    admitted_at: dict[str, int]
    hooks: Hooks
    connector: Connector | None
    events: Counter
    release: Callable[[Request], None]
    _retire: Callable[[Request, Status], None]
    _wait_again: Callable[[Request, str], None]
    max_blocks_needed: Callable[[int], int]  # the scheduler's

    def blocks_to_finish(self, request: Request) -> int:
        """At most the blocks ``request`` still takes to hold its whole sequence: the entries its
        tables lack (every entry counted as a new block, skipped or not)."""
        held = sum(len(table) for table in self.target_calls.get_block_ids(request.request_id))
        return max(0, self.max_blocks_needed(request.num_tokens) - held)

    @property
    def draft_step_tokens(self) -> int:
        """Slots one verification step takes past the sequence when drafts are on: the token
        after it, the drafts and the lookahead (vLLM 0.33.0's ``num_spec_decode_tokens``)."""
        k = self.config.speculative_tokens
        return 1 + k + self.config.lookahead if k else 0

    def draft_step_blocks(self) -> int:
        """Blocks one verification step may take in every group but a state group's (which counts
        its scratch columns already), kept back beside an async load's own need while a request
        runs, so that it can still take its next step: without it a load and a decoding request
        can preempt each other forever (two requests, each admitted with a load while the other
        runs, each preempted one token from its end; a walker's find). vLLM
        0.33.0 keeps them back always (``Scheduler._spec_decode_step_blocks``); with nothing
        running, kvprop's engine does not, so that a load alone in the pool is always admitted
        (``add_request`` takes only requests whose whole sequence fits)."""
        if not self.running:
            return 0
        n = self.draft_step_tokens
        return sum(cdiv(n, spec.block_size) for g, spec in enumerate(self.specs) if g not in self.state_groups)

    def reserved_for_loads(self, request: Request) -> int:
        """Blocks the other loads in flight or done still take to finish (vLLM's in-flight
        reservation, ``Scheduler._inflight_prefill_reserved_blocks``, 0.24.0 on)."""
        others = [*self.loading.values(), *self.loaded]
        return sum(self.blocks_to_finish(r) for r in others if r is not request and r.status is not Status.ABORTING)

    def _leaves_room_for_loads(self, request: Request, num_computed: int) -> bool:
        """An asynchronous load is admitted only when, after it takes all it can, the pool still
        holds what every other load takes to finish: a loading or loaded request holds its blocks
        and cannot be preempted, so loads admitted beside each other could otherwise hold the
        pool between them with none able to continue."""
        takes = self.max_blocks_needed(num_computed)
        return self.view.num_free_blocks - takes >= self.reserved_for_loads(request) + self.draft_step_blocks()

    def finish_load(self, request_id: str, ok: bool) -> None:
        """An asynchronous load completes (``ok``) or fails: the request then starts again without
        the connector ("recompute") or ends with an error ("fail")."""
        request = self.loading.get(request_id)
        if request is None:
            raise RequestError(f"finish_load: no load in flight for {request_id!r}; in flight: {sorted(self.loading)}")
        connector = self.connector
        assert connector is not None  # a load in flight is one the connector started
        load = connector.pending[request_id]
        if ok:
            self.hooks.before_load_write(self, request, load.block_ids)
        connector.finish_load(request_id, ok)
        del self.loading[request_id]
        if request.status is Status.ABORTING:
            self.release(request)
            self._retire(request, Status.ABORTED)
        elif ok:
            request.num_computed_tokens += request.pending_external
            self.target_calls.cache_blocks(request, request.num_computed_tokens)
            request.status = Status.LOADED
            self.loaded.append(request)
            self.loaded.sort(key=lambda r: self.admitted_at[r.request_id])
        elif self.config.load_failure_policy == "fail":
            # vLLM's default policy: the request ends with an error (FINISHED_ERROR)
            self.release(request)
            self._retire(request, Status.FAILED)
            self.events[EV_LOAD_FAIL] += 1
        else:
            self.release(request)
            request.load_failed = True
            self._wait_again(request, EV_LOAD_FAIL)
        request.pending_external = 0
        self.hooks.load_resolved(self, request, ok, load.num_local)
