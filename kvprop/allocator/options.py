"""How a configuration option is declared: one attrs field whose metadata says what the option
means, how a trace spells it, what the minimiser tries in its place and how the swarm draws it.

The trace format (``kvprop.search.trace``), the minimiser (``kvprop.repro.minimise``), the
sampler (``kvprop.search.alphabet``) and the generated facts of ``docs/design.md`` read these
declarations, so adding an option is its field in ``kvprop.allocator.specs`` and the code that
models it (docs/design.md, "Adding a configuration option").
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import attrs

OPTION = "kvprop.option"  # the metadata key of a field's declaration


class _Required:
    """A trace must spell the option: it has been in every trace format."""

    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()


@attrs.frozen
class Option:
    """One option's declaration.

    ``types``: the JSON types a trace may spell it with (``type(None)`` for null).
    ``absent``: the value a trace without the field ran with (traces written before the option
    existed), or REQUIRED.
    ``simpler``: what the minimiser tries in its place, simplest first: a tuple of values (a
    value is tried only while the current one is none of them or comes later in the tuple), or
    a function of the current value giving the values to try; empty: never changed.
    ``draw``: how the swarm draws it, ``draw(chooser, config) -> value`` from the sampler's side
    stream once every other value is drawn; None where the sampler's shape code draws it.
    Targets other than kvprop's own get a drawn option only where their ``Shapes.options``
    names it: an adapter builds only the options it maps to its engine."""

    doc: str
    types: tuple
    absent: Any = REQUIRED
    simpler: tuple | Callable[[Any], Iterable[Any]] = ()
    draw: Callable[[Any, Any], Any] | None = None

    def candidates(self, current) -> list:
        """The values the minimiser tries in place of ``current``, simplest first."""
        if callable(self.simpler):
            return list(self.simpler(current))
        values = list(self.simpler)
        return values[: values.index(current)] if current in values else values


def smaller(value: int, lo: int) -> Iterable[int]:
    """Integers below ``value`` down to ``lo``, simplest first: ``lo``, half of ``value``, one less."""
    seen = set()
    for v in (lo, value // 2, value - 1):
        if lo <= v < value and v not in seen:
            seen.add(v)
            yield v


def option(default: Any = attrs.NOTHING, *, validator, doc: str, types: tuple, kw_only: bool = True, **declared):
    """An attrs field declaring a configuration option (see ``Option`` for ``declared``)."""
    return attrs.field(
        default=default,
        validator=validator,
        kw_only=kw_only,
        metadata={OPTION: Option(doc=doc, types=types, **declared)},
    )


@attrs.frozen
class Declared:
    """An option where it lives: ``level`` "allocator" (``AllocatorConfig``) or "engine"
    (``EngineConfig``), its field's ``name``, ``default`` and declaration."""

    level: str
    name: str
    default: Any
    option: Option

    def value(self, config):
        """Its value in an ``EngineConfig``."""
        return getattr(config.allocator if self.level == "allocator" else config, self.name)

    def set(self, config, value):
        """``config`` (an ``EngineConfig``) with this option at ``value``; ConfigError where that
        is no valid configuration."""
        if self.level == "allocator":
            return attrs.evolve(config, allocator=attrs.evolve(config.allocator, **{self.name: value}))
        return attrs.evolve(config, **{self.name: value})


def declared(**levels: type) -> tuple[Declared, ...]:
    """Every field of the classes in ``levels`` that declares an option, level by level, in
    declaration order (the order of a trace's config object)."""
    return tuple(
        Declared(level, f.name, f.default, f.metadata[OPTION])
        for level, cls in levels.items()
        for f in attrs.fields(cls)
        if OPTION in f.metadata
    )
