"""A find's signature: what tells one bug from another, so that a campaign counts distinct
findings rather than traces.

The key is the violated kind (with the crashing exception's type, a dead worker's signal or
exit status, or what a stalled request waits for: ``kvprop.check.stall``) and the operation it
was detected at (the drain at the end when no operation
failed). Traces of one bug mostly share it; a bug detected at several operations (at a step in
one walk, at the drain in another) has one key per operation, and a triaged-findings file lists
each. The configuration features present say what the find involves: on a minimised trace,
where the minimiser has dropped every option the failure does not need, they are the features
that expose it. Sizes (blocks, token budget, alphabet) are not features.
"""

from __future__ import annotations

import re
from pathlib import Path

import attrs

from kvprop.allocator.specs import OPTIONS, EngineConfig, Mamba
from kvprop.search.trace import Trace

KEY = re.compile(r"^[a-z][a-z-]*(?::[^@\n]{1,80})?@[A-Za-z]+$")  # kind[:exception or cause]@operation


@attrs.frozen
class Signature:
    kind: str
    exception: str | None
    operation: str  # the operation's class name, or "drain"
    features: tuple[str, ...]

    @property
    def key(self) -> str:
        """``kind[:exception]@operation``: the same for every trace of one bug."""
        return f"{self.kind}{':' + self.exception if self.exception else ''}@{self.operation}"

    def to_dict(self) -> dict:
        return {"key": self.key, **attrs.asdict(self), "features": list(self.features)}


def features(config: EngineConfig) -> tuple[str, ...]:
    """The configuration's features: its group kinds, then every option away from its default."""
    kinds = sorted({spec.kind for spec in config.allocator.groups})
    changed = [
        f"{d.name}={d.value(config)}"
        for d in OPTIONS
        if d.name not in ("num_blocks", "token_budget", "vocab") and d.value(config) != d.default
    ]
    checkpoints = {spec.checkpoint for spec in config.allocator.groups if isinstance(spec, Mamba)} - {None}
    return (f"groups={'+'.join(kinds)}", *changed, *(["checkpoints"] if checkpoints else []))


def signature_of(trace: Trace) -> Signature:
    """The signature of a failing trace (ValueError for one that passes)."""
    failure = trace.failure
    if failure is None:
        raise ValueError("a trace that passes has no signature")
    step = failure.step
    operation = type(trace.steps[step]).__name__ if step < len(trace.steps) else "drain"
    return Signature(failure.kind, failure.exception, operation, features(trace.config))


MAX_TRIAGED_BYTES = 1 << 20


def read_triaged(path: Path) -> frozenset[str]:
    """The signature keys a triaged-findings file lists: a JSON object ``{"triaged": [{"signature":
    KEY, "finding": WHAT}, ...]}``, each key ``kind[:exception]@operation`` of a known kind. Data
    only; a TraceError names what is wrong."""
    import json

    from kvprop.search.trace import TraceError, known_kinds, read_regular

    try:
        data = json.loads(read_regular(path, MAX_TRIAGED_BYTES, "triaged-findings"))
    except ValueError as e:
        raise TraceError(f"{path}: not JSON: {e}") from e
    entries = data.get("triaged") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise TraceError(f'{path}: expected {{"triaged": [{{"signature": ..., "finding": ...}}, ...]}}')
    keys = []
    for i, entry in enumerate(entries):
        key = entry.get("signature") if isinstance(entry, dict) else None
        if not isinstance(key, str) or KEY.match(key) is None:
            raise TraceError(f"{path}: triaged[{i}].signature must be kind[:exception]@operation, got {key!r}")
        if key.split("@")[0].split(":")[0] not in known_kinds():
            raise TraceError(f"{path}: triaged[{i}].signature names no known kind: {key!r}")
        keys.append(key)
    return frozenset(keys)
