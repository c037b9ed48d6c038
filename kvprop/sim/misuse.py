"""The misuse rules: the malformed calls a buggy scheduler makes, driven against a target's contract.

An ``Engine`` mixin (``kvprop.sim.engine`` composes it). Each of ``MISUSES`` is one call the
manager facade's caller contract forbids (a negative or too large external-token count, no
new tokens, a second free, a free of a request never admitted, caching past the sequence, a
waiting request handed another's hits). A target says in its ``caller_contract`` what it
does with each; one it says nothing of is not made. The call crosses the boundary like any
other, the hooks judge what the target did with it, and the engine's own records stay as
they were: the mistake is the caller's, not a step.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from kvprop.capabilities import Capabilities
from kvprop.errors import TargetCrash
from kvprop.sim.hooks import Hooks
from kvprop.sim.request import Request
from kvprop.sim.target_calls import TargetCalls

MISUSES = (
    "negative-external",
    "too-many-external",
    "zero-new-tokens",
    "free-twice",
    "free-unadmitted",
    "cache-past-end",
    "stale-hits",
)


class BuggyCaller:
    """Engine mixin: one malformed call of ``MISUSES`` at a time, for a request that suits it."""

    # what it reads of the engine it is mixed into (set by ``Engine.__init__``)
    allocator: Any  # the target's allocator (a layer above the engine): only its caller_contract is read
    capabilities: Capabilities
    target_calls: TargetCalls
    block_size: int
    hooks: Hooks
    # the scheduler's records (kvprop.sim.scheduler): the requests a malformed call is made for
    waiting: deque[Request]
    running: list[Request]
    retired: deque[Request]
    last_hits: tuple | None

    def misuse(self, call: str, index: int) -> str:
        """Make one malformed call of ``MISUSES`` the way a buggy scheduler would, if the target's
        ``caller_contract`` says what it does with it; the hooks judge the outcome. The engine's
        own records are left as they were: the call is the caller's mistake, not a step."""
        contract = self.allocator.caller_contract.get(call) if self.capabilities.caller_contract else None
        if contract is None:
            return f"{call}: not in the target's caller contract, not made"
        target = self._misuse_target(call, index)
        if target is None:
            return f"{call}: no request to make it for"
        request, make = target
        token = self.hooks.before_misuse(self, call, request)
        result = None
        try:
            result = make()
            raised = None
        except TargetCrash as crash:
            raised = crash.error
        self.hooks.after_misuse(self, call, request, token, raised, contract)
        if raised is None and result is not None and call in ("negative-external", "too-many-external", "stale-hits"):
            self.target_calls.free(request)  # a granted allocation for a waiting request: the caller takes it back
        outcome = f"refused ({type(raised).__name__})" if raised is not None else "accepted"
        return f"{call} for {request.request_id}: {outcome}"

    def _misuse_target(self, call: str, index: int):
        """(request, the call to make) for ``call``, or None when no request suits it."""
        b = self.target_calls
        waiting, running, retired = list(self.waiting), list(self.running), list(self.retired)

        def pick(options):
            return options[index % len(options)] if options else None

        if call in ("negative-external", "too-many-external", "free-unadmitted", "stale-hits"):
            request = pick(waiting)
        elif call in ("zero-new-tokens", "cache-past-end"):
            request = pick(running)
        else:
            request = pick(retired)
        if request is None:
            return None
        if call == "negative-external":
            return request, lambda: b.allocate_slots(
                request, 1, num_external_computed_tokens=-1, delay_cache_blocks=True
            )
        if call == "too-many-external":
            return request, lambda: b.allocate_slots(
                request, 1, num_external_computed_tokens=request.num_tokens, delay_cache_blocks=True
            )
        if call == "zero-new-tokens":
            return request, lambda: b.allocate_slots(request, 0)
        if call in ("free-twice", "free-unadmitted"):
            return request, lambda: b.free(request)
        if call == "cache-past-end":
            return request, lambda: b.cache_blocks(request, request.num_tokens + self.block_size)
        if self.last_hits is None or self.last_hits[0] == request.request_id:
            return None
        _, hits, num_hit = self.last_hits
        return request, lambda: b.allocate_slots(
            request, 1, num_new_computed_tokens=num_hit, new_computed_blocks=hits, delay_cache_blocks=True
        )
