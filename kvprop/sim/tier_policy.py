"""Which idle block a bounded external tier evicts to make room for a save.

vLLM's CPU tier holds ``num_chunks`` blocks, one per (block hash, group) key, and a store that
finds too few free evicts idle ones by its ``eviction_policy`` (0.34.0
``v1/kv_offload/cpu/manager.py``, ``prepare_store``; ``cpu/policies/lru.py`` and ``arc.py``).
What every policy must keep is the tier's contract, which the oracles judge: a block being
written (a save in flight) or read (a load in flight) is never evicted, and eviction is all or
nothing (``evict`` returns None and changes nothing when fewer than ``n`` blocks are idle).
Which idle block goes is the policy's choice, which no oracle judges; kvprop's two policies
make it as the literature's do, with one simplification: vLLM records a request's accesses when
it finishes (``on_request_finished``, in prefix order), kvprop when a block is stored or loaded.

- ``lru``: the least recently stored or loaded idle block.
- ``arc``: adaptive replacement (Megiddo and Modha, FAST 2003) as vLLM adapts it: a stored key
  enters the recent list T1, a loaded one moves to the frequent list T2; eviction takes from T1
  while it holds at least the target ``p``, else from T2; evicted keys are remembered in the
  ghost lists B1 and B2, and a store of a remembered key moves ``p`` toward the list it came from.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable, Protocol


class TierPolicy(Protocol):
    def insert(self, key: Hashable) -> None:
        """A key just given room (its save is in flight or landed)."""

    def touch(self, key: Hashable) -> None:
        """A held key read again (a load)."""

    def remove(self, key: Hashable) -> None:
        """A key dropped without eviction (its save failed)."""

    def evict(self, n: int, idle: Callable[[Hashable], bool]) -> list | None:
        """``n`` keys for which ``idle`` holds, removed from the policy; None (nothing changed)
        when fewer are idle."""


class LeastRecentlyUsed:
    def __init__(self, capacity: int):
        self.order: OrderedDict = OrderedDict()  # oldest first

    def insert(self, key) -> None:
        self.order[key] = None
        self.order.move_to_end(key)

    def touch(self, key) -> None:
        if key in self.order:
            self.order.move_to_end(key)

    def remove(self, key) -> None:
        self.order.pop(key, None)

    def evict(self, n: int, idle) -> list | None:
        victims = [key for key in self.order if idle(key)][:n]
        if len(victims) < n:
            return None
        for key in victims:
            del self.order[key]
        return victims


class AdaptiveReplacement:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.target = 0.0  # p: the size T1 is steered to
        self.t1: OrderedDict = OrderedDict()  # seen once, oldest first
        self.t2: OrderedDict = OrderedDict()  # seen again
        self.b1: OrderedDict = OrderedDict()  # evicted from T1
        self.b2: OrderedDict = OrderedDict()  # evicted from T2

    def insert(self, key) -> None:
        if key in self.b1:  # recency would have kept it: T1 may grow
            self.target = min(self.target + max(1, len(self.b2) / len(self.b1)), self.capacity)
        elif key in self.b2:  # frequency would have kept it: T1 shrinks
            self.target = max(self.target - max(1, len(self.b1) / len(self.b2)), 0)
        self.b1.pop(key, None)
        self.b2.pop(key, None)
        self.t1[key] = None

    def touch(self, key) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)

    def remove(self, key) -> None:
        self.t1.pop(key, None)
        self.t2.pop(key, None)

    def evict(self, n: int, idle) -> list | None:
        recent = (key for key in self.t1 if idle(key))
        frequent = (key for key in self.t2 if idle(key))
        chosen: list[tuple[Hashable, bool]] = []  # (key, from T1)
        size = len(self.t1)
        for _ in range(n):
            key = next(recent, None) if size >= int(self.target) else None
            from_t1 = key is not None
            if key is None:
                key = next(frequent, None)
            if key is None:
                key, from_t1 = next(recent, None), True
            if key is None:
                return None
            size -= from_t1
            chosen.append((key, from_t1))
        for key, from_t1 in chosen:
            if from_t1:
                del self.t1[key]
                self.b1[key] = None
            else:
                del self.t2[key]
                self.b2[key] = None
        for ghost in (self.b1, self.b2):
            while len(ghost) > self.capacity:
                ghost.popitem(last=False)
        return [key for key, _ in chosen]


class NoEviction:
    """An unbounded tier's policy: it never evicts, so it keeps no order of its keys (nothing to
    record on the saves and loads of the common, unbounded case)."""

    def insert(self, key) -> None:
        return None

    def touch(self, key) -> None:
        return None

    def remove(self, key) -> None:
        return None

    def evict(self, n: int, idle) -> list | None:
        return None


POLICIES: dict[str, Callable[[int], TierPolicy]] = {"lru": LeastRecentlyUsed, "arc": AdaptiveReplacement}


def tier_policy(name: str, capacity: int | None) -> TierPolicy:
    """The policy ``name`` for a tier of ``capacity`` blocks; for an unbounded one (None), none."""
    return NoEviction() if capacity is None else POLICIES[name](capacity)
