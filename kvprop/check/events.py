"""13. Replaying the KV cache events reproduces the cache map.

A router outside the engine (vLLM's KV events consumers) learns what the cache holds only
from the events. After every drain, the keys it has seen stored and not removed since the
last clear must be exactly the cache map's keys, never counted more often than the map holds
blocks under them. vLLM announces every block (one key may name several blocks, each
announced once, so the replay counts per block); kvprop's pool announces a key once, when it
enters the map and when its last block leaves (invariant 17, ``kvprop.check.router``); both
replay to the map's keys. The ledger holds what a counting router holds; a removal of a key
it does not hold is wrong at once, and so is a hit's block announced again (the full report)
under a key it does not hold. Events carry keys, not block ids, so this checks key presence,
not which block holds a key (invariant 4 does that). Only the block pool's events (medium
GPU) name the cache map: an offload tier's are judged by invariant 17 alone.
"""

from __future__ import annotations

from collections import Counter

from kvprop.allocator.events import GPU, Cleared, Reannounced, Removed, Stored
from kvprop.errors import Violation


class EventLedger:
    """The cache map as a router replaying the events sees it: key -> number of blocks."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()

    def apply(self, events) -> set:
        """Replays ``events``; returns the keys they name."""
        named: set = set()
        for event in events:
            if isinstance(event, Cleared):
                named.update(self.counts)
                self.counts.clear()
                continue
            if not isinstance(event, Stored | Reannounced | Removed):
                raise TypeError(f"not a KV cache event: {event!r}")
            if event.medium != GPU:
                continue  # an offload tier's: not the cache map's
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
            else:
                if self.counts[event.key] <= 0:
                    del self.counts[event.key]
                    raise Violation(
                        "events-unknown-removal",
                        f"a removed event for {event.key}, which the events replayed so far do not hold",
                    )
                self.counts[event.key] -= 1
                if not self.counts[event.key]:
                    del self.counts[event.key]
        return named

    def compare(self, view) -> None:
        """Every key, as the full sweep does."""
        actual = Counter(key for key, _ in view.cache_map_items())
        self._judge(actual, actual.keys() | self.counts.keys())

    def compare_keys(self, view, keys) -> None:
        """Only ``keys``: those the events since the last comparison named and those of the
        blocks whose state changed (their old and new keys), the only ones that can have
        diverged since; needs a view that counts one key's blocks (``cache_count``)."""
        self._judge(Counter({key: view.cache_count(key) for key in keys}), keys)

    def _judge(self, actual: Counter, keys) -> None:
        """The replay holds each of ``keys`` exactly while the map does, counted at most as
        often as the map holds blocks under it."""
        wrong = [k for k in keys if (actual[k] > 0) != (self.counts[k] > 0) or self.counts[k] > actual[k]]
        if wrong:
            key = min(wrong, key=repr)  # the same one either way
            raise Violation(
                "events-diverge",
                f"replaying the KV cache events gives {self.counts[key]} block(s) under {key}, "
                f"the cache map holds {actual[key]}",
            )
