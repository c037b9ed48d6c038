"""17. A router keeping the KV cache events as a set believes exactly what each medium holds.

The consumers of the events, KV-aware routers, route on a *set* keyed by block hash and
medium, not the per-block count invariant 13 replays: NVIDIA Dynamo's ``RadixTree::apply_event``
(``lib/kv-router/src/radix_tree.rs``) adds the worker to a block's set of workers on a store,
drops it on a removal (one removal forgets the block) and forgets every block of the worker on
all-cleared; llm-d's ``Pool.digestEvents`` (``pkg/kvcache/kvevents/pool.go``) adds and evicts
one (pod, device tier) entry per hash, the tier read from the event's ``medium`` ("gpu" when
absent). ``RouterView`` replays the events so, all-cleared forgetting every medium as Dynamo
does, and after every drain holds it to what the engine holds: every key it holds on the GPU is
in the cache map and every key on the CPU is a hit of the offload tier's own lookup
(``router-advertises-absent``); every key the cache map holds, and every key a tier that
publishes events holds, is one it holds (``router-forgets-resident``).

A per-block stream breaks the second where one key names several blocks: stored twice and
removed once, a counting replay still holds the key, a set forgot it. Keys are kvprop's
(block hash, group): vLLM's events name the group (``group_idx``), which both routers cited
leave out.
"""

from __future__ import annotations

import attrs

from kvprop.allocator.events import CPU, GPU, Cleared, Reannounced, Removed, Stored
from kvprop.errors import Violation


@attrs.define
class RouterView:
    """What a router replaying the events believes resident: (key, medium) pairs."""

    held: set = attrs.field(factory=set)
    known: dict = attrs.field(factory=dict)  # medium -> every key the events ever named on it

    def apply(self, events) -> dict:
        """Replays ``events``; returns, per medium, the keys they name (every key known on the
        medium after an all-cleared, which forgets them all)."""
        named: dict = {}
        for event in events:
            if isinstance(event, Cleared):
                for medium, keys in self.known.items():
                    named.setdefault(medium, set()).update(keys)
                self.held.clear()
                continue
            self.known.setdefault(event.medium, set()).add(event.key)
            named.setdefault(event.medium, set()).add(event.key)
            if isinstance(event, Stored | Reannounced):  # a router cannot tell a hit announced again
                self.held.add((event.key, event.medium))
            elif isinstance(event, Removed):
                self.held.discard((event.key, event.medium))
        return named

    def judge(self, view, tier, named: dict | None = None) -> None:
        """17, on the keys ``named`` since the last judgement (per medium, with the GPU's the
        keys of blocks that moved), or on every key (None): the cache map's and the router's,
        and every key ever named on the CPU. ``tier`` is the offload tier's lookup, or None
        where the engine has none (its keys are then not judged)."""
        if named is None:
            resident = {key for key, _ in view.cache_map_items()}
            gpu = resident | {key for key, medium in self.held if medium == GPU}
            self._judge(GPU, gpu, resident.__contains__)
            cpu = self.known.get(CPU, set()) | {key for key, medium in self.held if medium == CPU}
        else:
            self._judge(GPU, named.get(GPU, ()), lambda key: view.cache_count(key) > 0)
            cpu = named.get(CPU, set())
        if tier is not None:
            self._judge(CPU, cpu, tier.holds, publishes=tier.publishes)

    def _judge(self, medium: str, keys, holds, publishes: bool = True) -> None:
        """Each of ``keys`` is believed on ``medium`` exactly while ``holds`` says it is there
        (None: unknown); a key the medium holds is required only where it ``publishes`` events."""
        for key in sorted(keys, key=repr):  # the same find whatever the set's order
            resident = holds(key)
            if resident is None:
                continue  # a key the medium cannot be asked about
            believed = (key, medium) in self.held
            if believed and not resident:
                raise Violation(
                    "router-advertises-absent",
                    f"a router replaying the KV cache events as a set holds {key} on the {medium}, "
                    f"which the {medium} does not hold: it would send a request there for a prefix that is gone",
                )
            if resident and not believed and publishes:
                raise Violation(
                    "router-forgets-resident",
                    f"the {medium} holds {key}, which a router replaying the KV cache events as a set does not "
                    f"hold: a removal or an all-cleared forgot it while the {medium} kept it, or it was never "
                    "announced",
                )
