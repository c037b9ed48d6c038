"""The target's calls: the line between the engine and the allocator under test.

Every manager-facade call the engine makes crosses it (``TargetCalls``). An exception
raised on the far side is the target's own crash — a finding (``TargetCrash``, kind
``target-crash``) — and is told apart here from an error of kvprop's engine or checks,
which is never a finding.
A ``Violation`` raised by a check the target calls back into passes through unchanged.

``SystemExit`` raised by the target is its crash too. Every other ``BaseException``
(``KeyboardInterrupt``, ``asyncio.CancelledError``, a test framework's outcome) is only in a
supervised worker (``supervised``), where Ctrl-C is ignored and kvprop raises none of its own,
so it can only come from target code; in kvprop's own process a ``KeyboardInterrupt`` is the
user's Ctrl-C.
"""

from __future__ import annotations

from kvprop.errors import RequestError, TargetCrash, Violation

TARGET_ERRORS: tuple = (Exception, SystemExit)


def supervised() -> None:
    """This process is a supervised worker: whatever the target raises is its crash."""
    global TARGET_ERRORS
    TARGET_ERRORS = (BaseException,)


class TargetCalls:
    """The allocator's facade calls, each turning an exception from the target into a TargetCrash."""

    __slots__ = ("allocator",)

    def __init__(self, allocator):
        self.allocator = allocator

    def _cross(self, call: str, *args, **kwargs):
        try:
            return getattr(self.allocator, call)(*args, **kwargs)
        except (Violation, TargetCrash):
            raise
        except TARGET_ERRORS as e:  # whatever the target raises is its crash
            raise TargetCrash(call, e) from e

    def get_computed_blocks(self, request):
        return self._cross("get_computed_blocks", request)

    def allocate_slots(self, request, num_new_tokens, **kwargs):
        return self._cross("allocate_slots", request, num_new_tokens, **kwargs)

    def free(self, request) -> None:
        self._cross("free", request)

    def pop_blocks_for_free(self, request) -> list[int]:
        return self._cross("pop_blocks_for_free", request)

    def free_popped_blocks(self, block_ids: list[int]) -> None:
        self._cross("free_popped_blocks", block_ids)

    def cache_blocks(self, request, num_computed_tokens: int) -> None:
        self._cross("cache_blocks", request, num_computed_tokens)

    def reset_prefix_cache(self) -> bool:
        return self._cross("reset_prefix_cache")

    def new_step_starts(self) -> None:
        self._cross("new_step_starts")

    def take_kv_cache_block_copies(self) -> list:
        return self._cross("take_kv_cache_block_copies")

    def take_events(self) -> list:
        return self._cross("take_events")

    def get_block_ids(self, request_id: str):
        return self._cross("get_block_ids", request_id)


class HookFailed(Exception):
    """Carries an error of kvprop's own code out through the target's, so the call re-raises the
    original instead of reporting it as the target's crash."""


class OwnLoopCalls:
    """The calls of an engine whose target runs its own scheduling loop and calls kvprop back from
    inside it (vLLM's ``Scheduler``, SGLang's event loop): ``_call`` makes a call into the target,
    ``_hook`` runs kvprop's code from inside one. A ``Violation`` and a ``RequestError`` (a refusal
    of the request, kvprop's or the engine's) pass through; an error of kvprop's own is re-raised as
    itself; anything else the target raised is its crash."""

    _hook_error: BaseException | None = None

    def _hook(self, fn, *args):
        try:
            return fn(*args)
        except Violation:
            raise
        except Exception as e:
            self._hook_error = e
            raise HookFailed() from e

    def _call(self, what: str, fn, *args):
        self._hook_error = None
        try:
            return fn(*args)
        except (Violation, TargetCrash, RequestError):
            raise
        except TARGET_ERRORS as e:
            if self._hook_error is not None:
                raise self._hook_error from None
            raise TargetCrash(what, e) from e
