"""13. Replaying the KV cache events reproduces the cache map.

A router outside the engine (vLLM's KV events consumers) learns what the cache holds only
from the events. After every drain, the keys it has seen stored and not removed since the
last clear must be exactly the cache map's keys, counted per block: one key may name
several blocks, and each was announced once. The ledger holds what a replaying router
holds; a removal of a key it does not hold is wrong at once, and so is a hit's block
announced again (the full report) under a key it does not hold. Events carry keys, not block
ids, so this checks key presence, not which block holds a key (invariant 4 does that).
"""

from __future__ import annotations

from collections import Counter

from kvprop.allocator.events import Cleared, Reannounced, Removed, Stored
from kvprop.errors import Violation


class EventLedger:
    """The cache map as a router replaying the events sees it: key -> number of blocks."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()

    def apply(self, events) -> set:
        """Replays ``events``; returns the keys they name."""
        named = set()
        for event in events:
            if not isinstance(event, Cleared):
                named.add(event.key)
            if isinstance(event, Stored):
                self.counts[event.key] += 1
            elif isinstance(event, Reannounced):
                if self.counts[event.key] <= 0:
                    del self.counts[event.key]
                    raise Violation(
                        "events-reannounce-unheld",
                        f"a hit's block announced again under {event.key}, which the events replayed so far "
                        f"do not hold: a router would learn a prefix this group does not have",
                    )
            elif isinstance(event, Removed):
                if self.counts[event.key] <= 0:
                    del self.counts[event.key]
                    raise Violation(
                        "events-unknown-removal",
                        f"a removed event for {event.key}, which the events replayed so far do not hold",
                    )
                self.counts[event.key] -= 1
                if not self.counts[event.key]:
                    del self.counts[event.key]
            elif isinstance(event, Cleared):
                named.update(self.counts)
                self.counts.clear()
            else:
                raise TypeError(f"not a KV cache event: {event!r}")
        return named

    def compare(self, view) -> None:
        """Every key, as the full sweep does."""
        actual = Counter(key for key, _ in view.cache_map_items())
        if actual != self.counts:
            self._diverged(actual, actual.keys() | self.counts.keys())

    def compare_keys(self, view, keys) -> None:
        """Only ``keys``: those the events since the last comparison named and those of the
        blocks whose state changed (their old and new keys), the only ones that can have
        diverged since; needs a view that counts one key's blocks (``cache_count``)."""
        actual = {key: view.cache_count(key) for key in keys}
        if any(n != self.counts.get(key, 0) for key, n in actual.items()):
            self._diverged(Counter(actual), keys)

    def _diverged(self, actual: Counter, keys) -> None:
        key = min((k for k in keys if actual[k] != self.counts[k]), key=repr)  # the same one either way
        raise Violation(
            "events-diverge",
            f"replaying the KV cache events gives {self.counts[key]} block(s) under {key}, "
            f"the cache map holds {actual[key]}",
        )
