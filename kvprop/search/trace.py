"""Traces: a configuration plus the operations applied to it, as durable JSON.

Hypothesis's database entries die with any edit of the machine or a Hypothesis upgrade;
a trace only needs the operation alphabet, so it replays across both.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs

from kvprop import __version__
from kvprop.allocator.specs import AllocatorConfig, ChunkedLocal, EngineConfig, FullAttention, SlidingWindow
from kvprop.errors import KvpropError, Violation
from kvprop.search.alphabet import OPERATION_BY_NAME

FORMAT = "kvprop-trace/1"


class TraceError(KvpropError):
    """A trace file is malformed or incompatible; the message says what and where."""


@attrs.frozen
class Failure:
    """Where a replay failed: the step index (len(steps) means the final drain), a kind, a message."""

    step: int
    kind: str
    message: str

    def describe(self) -> str:
        return f"step {self.step}: {self.message}"


def failure_kind(error: BaseException) -> str:
    return error.kind if isinstance(error, Violation) else type(error).__name__


@attrs.frozen
class Trace:
    config: EngineConfig
    steps: tuple
    variant: str | None = None
    target: str | None = None
    drain: bool = True
    seed: int | None = None
    engine: str = "walk"
    failure: Failure | None = None

    def with_steps(self, steps) -> Trace:
        return attrs.evolve(self, steps=tuple(steps))


# ---- JSON ---------------------------------------------------------------------------------

SPEC_KINDS = {"full": FullAttention, "sliding_window": SlidingWindow, "chunked_local": ChunkedLocal}


def config_to_dict(config: EngineConfig) -> dict:
    a = config.allocator
    return {
        "groups": [{"kind": s.kind, **attrs.asdict(s)} for s in a.groups],
        "num_blocks": a.num_blocks,
        "enable_caching": a.enable_caching,
        "token_budget": config.token_budget,
        "lookahead": config.lookahead,
        "connector": config.connector,
        "vocab": config.vocab,
    }


def _require(d, key, where, types):
    if not isinstance(d, dict) or key not in d:
        raise TraceError(f"{where}: missing field {key!r}")
    value = d[key]
    if not isinstance(value, types) or (
        isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,))
    ):
        raise TraceError(f"{where}.{key}: expected {getattr(types, '__name__', types)}, got {value!r}")
    return value


def config_from_dict(d) -> EngineConfig:
    from kvprop.errors import ConfigError

    groups = []
    for i, g in enumerate(_require(d, "groups", "config", list)):
        kind = _require(g, "kind", f"config.groups[{i}]", str)
        if kind not in SPEC_KINDS:
            raise TraceError(f"config.groups[{i}].kind: {kind!r} is not one of {sorted(SPEC_KINDS)}")
        fields = {k: v for k, v in g.items() if k != "kind"}
        try:
            groups.append(SPEC_KINDS[kind](**fields))
        except (TypeError, ConfigError) as e:
            raise TraceError(f"config.groups[{i}]: {e}") from e
    try:
        return EngineConfig(
            AllocatorConfig(
                tuple(groups), _require(d, "num_blocks", "config", int), _require(d, "enable_caching", "config", bool)
            ),
            token_budget=_require(d, "token_budget", "config", int),
            lookahead=_require(d, "lookahead", "config", int),
            connector=_require(d, "connector", "config", str),
            vocab=_require(d, "vocab", "config", int),
        )
    except ConfigError as e:
        raise TraceError(f"config: {e}") from e


def op_to_dict(op) -> dict:
    return {"op": type(op).__name__, **attrs.asdict(op)}


def op_from_dict(d, where: str):
    name = _require(d, "op", where, str)
    cls = OPERATION_BY_NAME.get(name)
    if cls is None:
        raise TraceError(f"{where}.op: unknown operation {name!r}; known: {', '.join(OPERATION_BY_NAME)}")
    args = {k: v for k, v in d.items() if k != "op"}
    if set(args) != set(cls.ARGS):
        raise TraceError(f"{where}: {name} takes arguments {sorted(cls.ARGS)}, got {sorted(args)}")
    for k, v in args.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise TraceError(f"{where}.{k}: expected an integer >= 0, got {v!r}")
    return cls(**args)


def to_dict(trace: Trace) -> dict:
    return {
        "format": FORMAT,
        "kvprop_version": __version__,
        "engine": trace.engine,
        "seed": trace.seed,
        "variant": trace.variant,
        "target": trace.target,
        "config": config_to_dict(trace.config),
        "steps": [op_to_dict(op) for op in trace.steps],
        "drain": trace.drain,
        "failure": attrs.asdict(trace.failure) if trace.failure else None,
    }


def from_dict(d) -> Trace:
    if not isinstance(d, dict):
        raise TraceError(f"a trace is a JSON object, got {type(d).__name__}")
    fmt = d.get("format")
    if fmt != FORMAT:
        raise TraceError(f"format: expected {FORMAT!r}, got {fmt!r} (is this a kvprop trace file?)")
    steps = tuple(op_from_dict(s, f"steps[{i}]") for i, s in enumerate(_require(d, "steps", "trace", list)))
    failure = d.get("failure")
    if failure is not None:
        try:
            failure = Failure(int(failure["step"]), str(failure["kind"]), str(failure["message"]))
        except (KeyError, TypeError, ValueError) as e:
            raise TraceError(f"failure: expected {{step, kind, message}}, got {failure!r}") from e
    return Trace(
        config=config_from_dict(_require(d, "config", "trace", dict)),
        steps=steps,
        variant=d.get("variant"),
        target=d.get("target"),
        drain=bool(d.get("drain", True)),
        seed=d.get("seed"),
        engine=str(d.get("engine", "walk")),
        failure=failure,
    )


def save(trace: Trace, path: Path) -> None:
    path.write_text(json.dumps(to_dict(trace), indent=1) + "\n")


def load(path) -> Trace:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise TraceError(f"cannot read trace {str(path)!r}: {e.strerror}") from e
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceError(f"{path}: not JSON ({e.msg} at line {e.lineno} column {e.colno})") from e
    try:
        return from_dict(data)
    except TraceError as e:
        raise TraceError(f"{path}: {e}") from e
