"""Traces: a configuration plus the operations applied to it, as durable JSON.

Hypothesis's database entries die with any edit of the machine or a Hypothesis upgrade;
a trace only needs the operation alphabet, so it replays across both.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs

from kvprop import __version__
from kvprop.allocator import guards as guards_module
from kvprop.allocator.options import REQUIRED
from kvprop.allocator.specs import (
    OPTIONS,
    AllocatorConfig,
    ChunkedLocal,
    EngineConfig,
    FullAttention,
    Mamba,
    SlidingWindow,
)
from kvprop.errors import KvpropError, TargetCrash, Violation, bounded
from kvprop.search import DRIVERS
from kvprop.search.alphabet import OPERATION_BY_NAME

FORMAT = "kvprop-trace/1"
# What a real run can produce, with room to spare; anything beyond is refused, not attempted.
MAX_FILE_BYTES = 16 << 20
MAX_STEPS = 100_000
MAX_TEXT = 100_000
MAX_DIGITS = 20  # an integer in a trace fits in 64 bits; longer ones are refused before conversion
MAX_DEPTH = 6  # trace -> config -> groups -> [i] -> field: nothing a trace holds nests deeper


class TraceError(KvpropError):
    """A trace file is malformed or incompatible; the message says what and where."""


ORIGINS = ("violation", "target-crash", "target-hang", "target-oom")
# The kinds a find can carry: the invariants' kinds, and the target's own failures.
TARGET_KINDS = ("target-crash", "target-hang", "target-oom")


@attrs.frozen
class Failure:
    """Where a replay failed: the step index (len(steps) means the final drain), a kind, a message.

    ``origin`` says what failed: an invariant (``violation``, ``kind`` names it) or the target's
    own code raising (``target-crash``, ``exception`` names the exception type); for an invariant
    whose kind holds several mechanisms, ``exception`` names the one seen (the Violation's
    ``cause``: what a stalled request waits for). An error of
    the harness itself is never a Failure: it propagates as an internal error."""

    step: int
    kind: str
    message: str
    origin: str = "violation"
    exception: str | None = None

    def describe(self) -> str:
        return f"step {self.step}: {self.message}"

    @property
    def signature(self) -> tuple:
        """What the minimiser keeps constant: the violated kind and its cause, or the crashing
        exception's type."""
        return (self.kind, self.exception)


def failure_from(error: Violation | TargetCrash, step: int) -> Failure:
    """The Failure a finding exception stands for (a Violation or a TargetCrash)."""
    if isinstance(error, TargetCrash):
        return Failure(step, "target-crash", str(error), "target-crash", error.exception_type)
    return Failure(step, error.kind, str(error), exception=error.cause)


@attrs.frozen
class Trace:
    config: EngineConfig
    steps: tuple
    variant: str | None = None
    target: str | None = None
    drain: bool = True
    seed: int | None = None
    driver: str = "walk"  # the search driver that found it: one of DRIVERS
    failure: Failure | None = None
    # whether kvprop's allocator ran with its own guards (kvprop.allocator.guards): by default
    # the process's setting, so that a search without them records it in every trace it makes
    guards: bool = attrs.field(factory=lambda: guards_module.ENABLED)

    def with_steps(self, steps) -> Trace:
        return attrs.evolve(self, steps=tuple(steps))


# ---- JSON ---------------------------------------------------------------------------------

SPEC_KINDS = {
    "full": FullAttention,
    "sliding_window": SlidingWindow,
    "chunked_local": ChunkedLocal,
    "mamba": Mamba,
}


def config_to_dict(config: EngineConfig) -> dict:
    """The groups, then every declared option (``kvprop.allocator.specs.OPTIONS``) in order."""
    groups = [{"kind": s.kind, **attrs.asdict(s)} for s in config.allocator.groups]
    return {"groups": groups, **{d.name: d.value(config) for d in OPTIONS}}


def _require(d, key, where, types):
    if not isinstance(d, dict) or key not in d:
        raise TraceError(f"{where}: missing field {key!r}")
    return _typed(d[key], f"{where}.{key}", types)


def _optional(d, key, default, types):
    return _typed(d.get(key, default), f"config.{key}", types)


def _typed(value, where, types):
    types = types if isinstance(types, tuple) else (types,)
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
        raise TraceError(f"{where}: expected {names}, got {_show(value)}")
    if isinstance(value, str) and len(value) > MAX_TEXT:
        raise TraceError(f"{where}: a string of {len(value):,} characters (at most {MAX_TEXT:,})")
    return value


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _only(d: dict, allowed, where: str) -> None:
    unknown = sorted(set(d) - set(allowed))
    if unknown:
        raise TraceError(f"{where}: unknown field(s) {bounded(unknown)}; allowed: {', '.join(sorted(allowed))}")


CONFIG_FIELDS = ("groups", *(d.name for d in OPTIONS))


def config_from_dict(d) -> EngineConfig:
    from kvprop.errors import ConfigError

    _typed(d, "config", dict)
    _only(d, CONFIG_FIELDS, "config")
    groups = []
    for i, g in enumerate(_require(d, "groups", "config", list)):
        _typed(g, f"config.groups[{i}]", dict)
        kind = _require(g, "kind", f"config.groups[{i}]", str)
        if kind not in SPEC_KINDS:
            raise TraceError(f"config.groups[{i}].kind: {kind!r} is not one of {sorted(SPEC_KINDS)}")
        fields = {k: v for k, v in g.items() if k != "kind"}
        _only(fields, [f.name for f in attrs.fields(SPEC_KINDS[kind])], f"config.groups[{i}]")
        try:
            groups.append(SPEC_KINDS[kind](**fields))
        except (TypeError, ConfigError) as e:
            raise TraceError(f"config.groups[{i}]: {e}") from e
    values = {}
    for o in OPTIONS:  # a field a trace lacks ran with the value the option declares for it
        if o.option.absent is REQUIRED:
            values[o.name] = _require(d, o.name, "config", o.option.types)
        else:
            values[o.name] = _optional(d, o.name, o.option.absent, o.option.types)
    try:
        at = {level: {o.name: values[o.name] for o in OPTIONS if o.level == level} for level in ("allocator", "engine")}
        return EngineConfig(AllocatorConfig(tuple(groups), **at["allocator"]), **at["engine"])
    except ConfigError as e:
        raise TraceError(f"config: {e}") from e


def op_to_dict(op) -> dict:
    return {"op": type(op).__name__, **attrs.asdict(op)}


def op_from_dict(d, where: str):
    """An operation; every argument an integer in the range the drivers draw it from."""
    name = _require(d, "op", where, str)
    cls = OPERATION_BY_NAME.get(name)
    if cls is None:
        raise TraceError(f"{where}.op: unknown operation {_show(name)}; known: {', '.join(OPERATION_BY_NAME)}")
    args = {k: v for k, v in d.items() if k != "op"}
    if set(args) != set(cls.ARGS):
        raise TraceError(f"{where}: {name} takes arguments {sorted(cls.ARGS)}, got {sorted(args)}")
    for k, v in args.items():
        lo, hi = cls.ARGS[k]
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise TraceError(f"{where}.{k}: expected an integer in [{lo}, {hi}], got {_show(v)}")
    return cls(**args)


def to_dict(trace: Trace) -> dict:
    return {
        "format": FORMAT,
        "kvprop_version": __version__,
        "driver": trace.driver,
        "seed": trace.seed,
        "variant": trace.variant,
        "target": trace.target,
        "config": config_to_dict(trace.config),
        "steps": [op_to_dict(op) for op in trace.steps],
        "drain": trace.drain,
        **({} if trace.guards else {"guards": False}),  # spelt only when off: a guarded trace reads as ever
        "failure": attrs.asdict(trace.failure) if trace.failure else None,
    }


TRACE_FIELDS = (
    "format", "kvprop_version", "driver", "engine", "seed", "variant", "target", "config", "steps", "drain",
    "guards", "failure",
)  # fmt: skip
FAILURE_FIELDS = ("step", "kind", "message", "origin", "exception")


def _driver(d: dict) -> str:
    """The search driver; traces written before the rename call the field ``engine``."""
    key = "driver" if "driver" in d else "engine"
    driver = _typed(d.get(key, "walk"), key, str)
    if driver not in DRIVERS:
        raise TraceError(f"{key}: expected one of {list(DRIVERS)}, got {_show(driver)}")
    return driver


def _failure(d, num_steps: int) -> Failure | None:
    if d is None:
        return None
    _typed(d, "failure", dict)
    _only(d, FAILURE_FIELDS, "failure")
    step = _require(d, "step", "failure", int)
    if not 0 <= step <= num_steps:
        raise TraceError(
            f"failure.step: expected an integer in [0, {num_steps}] (the steps, then the drain), got {step}"
        )
    origin = _typed(d.get("origin", "violation"), "failure.origin", str)
    if origin not in ORIGINS:
        raise TraceError(f"failure.origin: expected one of {list(ORIGINS)}, got {_show(origin)}")
    kind = _require(d, "kind", "failure", str)
    if kind not in known_kinds():
        raise TraceError(f"failure.kind: {_show(kind)} is not a kind kvprop reports (see docs/design.md)")
    return Failure(
        step,
        kind,
        _require(d, "message", "failure", str),
        origin,
        _typed(d.get("exception"), "failure.exception", (str, type(None))),
    )


def known_kinds() -> frozenset:
    from kvprop.check.kinds import KINDS

    return frozenset(KINDS) | frozenset(TARGET_KINDS)


def from_dict(d) -> Trace:
    """A trace, every field checked for type and range; a TraceError names the first bad one."""
    if not isinstance(d, dict):
        raise TraceError(f"a trace is a JSON object, got {type(d).__name__}")
    fmt = d.get("format")
    if fmt != FORMAT:
        raise TraceError(f"format: expected {FORMAT!r}, got {_show(fmt)} (is this a kvprop trace file?)")
    _only(d, TRACE_FIELDS, "trace")
    raw_steps = _require(d, "steps", "trace", list)
    if len(raw_steps) > MAX_STEPS:
        raise TraceError(f"steps: {len(raw_steps):,} operations (at most {MAX_STEPS:,})")
    steps = tuple(op_from_dict(s, f"steps[{i}]") for i, s in enumerate(raw_steps))
    seed = _typed(d.get("seed"), "seed", (int, type(None)))
    if seed is not None and not 0 <= seed < 1 << 64:
        raise TraceError(f"seed: expected an integer in [0, 2**64), got {seed}")
    _typed(d.get("kvprop_version", ""), "kvprop_version", str)
    return Trace(
        config=config_from_dict(_require(d, "config", "trace", dict)),
        steps=steps,
        variant=_typed(d.get("variant"), "variant", (str, type(None))),
        target=_typed(d.get("target"), "target", (str, type(None))),
        drain=_typed(d.get("drain", True), "drain", bool),
        guards=_typed(d.get("guards", True), "guards", bool),  # traces written before the field ran guarded
        seed=seed,
        driver=_driver(d),
        failure=_failure(d.get("failure"), len(steps)),
    )


def save(trace: Trace, path: Path) -> None:
    path.write_text(json.dumps(to_dict(trace), indent=1) + "\n", encoding="utf-8")


def load(path) -> Trace:
    """Read and validate a trace file: UTF-8 JSON of at most MAX_FILE_BYTES, data only."""
    path = Path(path)
    try:
        text = read_regular(path, MAX_FILE_BYTES, "trace").decode("utf-8")
    except UnicodeDecodeError as e:
        raise TraceError(f"{path}: not UTF-8 text (byte {e.start}); a trace is a JSON file") from e
    try:
        data = parse_json(text)
        _check_depth(data)
    except ValueError as e:
        raise TraceError(f"{path}: {e}") from e
    try:
        return from_dict(data)
    except TraceError as e:
        raise TraceError(f"{path}: {e}") from e


def read_regular(path: Path, limit: int, what: str) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes. A FIFO, device or socket is
    refused without being opened (opening a FIFO blocks; a device can be endless)."""
    import stat

    try:
        mode = path.stat()
        if not stat.S_ISREG(mode.st_mode):
            raise TraceError(f"{str(path)!r} is not a regular file; a {what} is a JSON file")
        if mode.st_size > limit:
            raise TraceError(f"{path}: {mode.st_size:,} bytes; a {what} file is at most {limit:,}")
        with open(path, "rb") as f:
            return f.read(limit + 1)
    except OSError as e:
        raise TraceError(f"cannot read {what} {str(path)!r}: {e.strerror}") from e


def _bounded_int(text: str) -> int:
    digits = text.lstrip("-")
    if len(digits) > MAX_DIGITS:
        raise ValueError(f"an integer of {len(digits):,} digits (at most {MAX_DIGITS})")
    return int(text)


def _no_float(text: str):
    raise ValueError(f"a number {text[:20]!r} that is not an integer (a trace holds integers only)")


def parse_json(text: str):
    """JSON data with integers of at most MAX_DIGITS digits and no floats, NaN or Infinity; a
    ValueError says what was wrong."""
    try:
        return json.loads(text, parse_int=_bounded_int, parse_float=_no_float, parse_constant=_no_float)
    except RecursionError:
        raise ValueError(f"JSON nested too deeply (at most {MAX_DEPTH} levels)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None


def _check_depth(data) -> None:
    level = [data]
    for _ in range(MAX_DEPTH + 1):
        level = [v for x in level for v in (x.values() if isinstance(x, dict) else x if isinstance(x, list) else ())]
        if not level:
            return
    raise ValueError(f"JSON nested deeper than {MAX_DEPTH} levels; a trace is not")
