"""The state census (kvprop.check.census): every field kvprop's engine keeps is judged by a
named check, derived with a reason, or a setting; so is every call of the view a target implements."""

from __future__ import annotations

import typing
from collections import defaultdict

import attrs
import pytest

from kvprop.capabilities import Capabilities
from kvprop.check.census import CENSUS, VIEW, Judged
from kvprop.check.kinds import KINDS
from kvprop.search import walk
from kvprop.search.execute import run
from kvprop.search.harness import Harness
from kvprop.targets import shapes_of
from kvprop.targets.protocol import View

WALKS = 60  # enough seeds that every group kind, both coordinators and the connector are built


def _fields(obj) -> set[str]:
    names = set(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        names |= set(getattr(cls, "__slots__", ()))
    return names - {"__weakref__", "__dict__"}


def _parts(engine):
    manager = engine.allocator
    yield engine
    yield manager
    yield manager.pool
    yield manager.pool.free_queue
    yield manager.coordinator
    yield from manager.coordinator.managers
    yield from manager.pool.blocks[:2]
    yield engine.memory
    if engine.connector is not None:
        yield engine.connector
    yield from list(engine.requests.values())[:2]


@pytest.fixture(scope="module")
def observed() -> dict[type, set[str]]:
    """Each class met over the walks -> the fields its objects had."""
    seen: dict[type, set[str]] = defaultdict(set)
    for seed in range(WALKS):
        begun = walk.start(seed, 200, None, shapes_of(None))
        harness = Harness(begun.config)

        def look(*_, engine=harness.engine):
            for part in _parts(engine):
                seen[type(part)] |= _fields(part)

        run(harness, walk.operations(begun, harness, []), drain=True, on_step=look)
    return seen


def _named(cls: type) -> set[str]:
    return {field for base in cls.__mro__ for field in CENSUS.get(base.__name__, {})}


def test_every_field_of_the_engine_state_is_named_in_the_census(observed):
    unnamed = {cls.__name__: sorted(fields - _named(cls)) for cls, fields in observed.items() if fields - _named(cls)}
    assert unnamed == {}, (
        "fields with no judge: name each in kvprop/check/census.py (Judged by the kinds that fail when it "
        "goes wrong, Derived with the reason, or a Setting)"
    )


def test_the_census_names_no_field_the_engine_lacks(observed):
    met = {base.__name__ for cls in observed for base in cls.__mro__}
    fields_of = defaultdict(set)
    for cls, fields in observed.items():
        for base in cls.__mro__:
            fields_of[base.__name__] |= fields
    stale = {name: sorted(set(entries) - fields_of[name]) for name, entries in CENSUS.items() if name in met}
    assert {name: f for name, f in stale.items() if f} == {}
    assert set(CENSUS) - met == set()


def test_every_kind_the_census_names_exists():
    named = {
        kind
        for entries in [*CENSUS.values(), VIEW]
        for j in entries.values()
        if isinstance(j, Judged)
        for kind in j.kinds
    }
    assert named - set(KINDS) == set()


def test_every_call_of_the_view_and_its_capabilities_is_named():
    hints = set(typing.get_type_hints(View)) | {n for n in vars(View) if not n.startswith("_")}
    promised = {call for f in attrs.fields(Capabilities) for call in f.metadata["calls"]}
    assert hints | promised == set(VIEW)
