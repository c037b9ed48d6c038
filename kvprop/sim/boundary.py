"""The line between the engine and the allocator under test.

Every manager-facade call the engine makes crosses it. An exception raised on the far
side is the target's own crash — a finding (``TargetCrash``, kind ``target-crash``) — and
is told apart here from an error of kvprop's engine or checks, which is never a finding.
A ``Violation`` raised by a check the target calls back into passes through unchanged.
"""

from __future__ import annotations

from kvprop.errors import TargetCrash, Violation


class Boundary:
    """The allocator's facade calls, each turning an exception from the target into a TargetCrash."""

    __slots__ = ("allocator",)

    def __init__(self, allocator):
        self.allocator = allocator

    def get_computed_blocks(self, request):
        try:
            return self.allocator.get_computed_blocks(request)
        except (Violation, TargetCrash):
            raise
        except Exception as e:  # noqa: BLE001 - whatever the target raises is its crash
            raise TargetCrash("get_computed_blocks", e) from e

    def allocate_slots(self, request, num_new_tokens, **kwargs):
        try:
            return self.allocator.allocate_slots(request, num_new_tokens, **kwargs)
        except (Violation, TargetCrash):
            raise
        except Exception as e:  # noqa: BLE001
            raise TargetCrash("allocate_slots", e) from e

    def free(self, request) -> None:
        try:
            self.allocator.free(request)
        except (Violation, TargetCrash):
            raise
        except Exception as e:  # noqa: BLE001
            raise TargetCrash("free", e) from e

    def cache_blocks(self, request, num_computed_tokens: int) -> None:
        try:
            self.allocator.cache_blocks(request, num_computed_tokens)
        except (Violation, TargetCrash):
            raise
        except Exception as e:  # noqa: BLE001
            raise TargetCrash("cache_blocks", e) from e

    def reset_prefix_cache(self) -> bool:
        try:
            return self.allocator.reset_prefix_cache()
        except (Violation, TargetCrash):
            raise
        except Exception as e:  # noqa: BLE001
            raise TargetCrash("reset_prefix_cache", e) from e

    def get_block_ids(self, request_id: str):
        try:
            return self.allocator.get_block_ids(request_id)
        except (Violation, TargetCrash):
            raise
        except Exception as e:  # noqa: BLE001
            raise TargetCrash("get_block_ids", e) from e
