"""The constructor calls that build vLLM's scheduler, kept as they are made.

``config.build_scheduler`` makes every vLLM object through a ``Recipe``: the object is built
at once, and the call that built it (class, arguments, the attribute set on it afterwards) is
kept in order. A reproducer for vLLM's maintainers (``kvprop report``) then states exactly the
scheduler the target drove, as the constructor calls of the release's own classes, instead of
rebuilding vLLM's configuration objects from their fields (``VllmConfig`` and ``ModelConfig``
derive fields of their own as they are built, so their fields do not rebuild them).
"""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen
class Made:
    """``name = cls(*args, **kwargs)``."""

    name: str
    cls: type
    args: tuple
    kwargs: tuple  # (keyword, value) pairs, in the order passed


@attrs.frozen
class Assigned:
    """``name.attr = value``, on an object made before."""

    name: str
    attr: str
    value: Any


@attrs.frozen
class Checked:
    """``name.method()``: one of vLLM's start-up checks, run on an object made before."""

    name: str
    method: str


@attrs.define
class Recipe:
    """The calls, in order; ``model_dir`` is the folder whose ``config.json`` (``model``) stands
    for the model, which a script writes for itself; ``env``, the environment variables set while
    the scheduler is built."""

    steps: list = attrs.field(factory=list)
    model_dir: str | None = None
    model: dict | None = None
    env: dict = attrs.field(factory=dict)
    _names: dict = attrs.field(factory=dict)  # id(object) -> (name, object)

    def make(self, name: str, cls, *args, **kwargs):
        made = cls(*args, **kwargs)
        self.steps.append(Made(name, cls, args, tuple(kwargs.items())))
        self._names[id(made)] = (name, made)
        return made

    def assign(self, made, attr: str, value) -> None:
        setattr(made, attr, value)
        self.steps.append(Assigned(self._made_name(made), attr, value))

    def check(self, made, method: str) -> None:
        self.steps.append(Checked(self._made_name(made), method))
        getattr(made, method)()

    def _made_name(self, made) -> str:
        name = self.name_of(made)
        if name is None:
            raise ValueError(f"a {type(made).__name__} this recipe did not make")
        return name

    def express(self, made, source: str) -> None:
        """State ``made`` in a script as ``source``: a call that builds it on any release (the
        script defines the function it names), where its class's fields differ between releases."""
        self._names[id(made)] = (source, made)

    def name_of(self, x) -> str | None:
        """The name ``x`` was made under, if this recipe made it."""
        found = self._names.get(id(x))
        return found[0] if found is not None and found[1] is x else None
