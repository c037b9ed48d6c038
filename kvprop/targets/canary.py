"""The canary: a fault kvprop can switch on over any target, to prove the checks still bite.

``kvprop fuzz --canary`` first searches the target being fuzzed with this fault on and
refuses to start unless the search finds it. The fault lives in the engine, not in the
allocator, so it works for kvprop's allocator, vLLM's and a user's alike: the first time a
request would give its blocks back (finish, abort, preemption, failed load), the engine
forgets to call ``free``. The request's blocks stay in its tables while it is retired or
waiting, which the table and liveness invariants must report.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvprop.sim.engine import Engine as _MixedInto
else:
    _MixedInto = object

CANARY = "lost-free"


class LostFree(_MixedInto):
    """Engine mixin: the first free is skipped (and the hook that would see it).

    Its base is ``object``; ``with_canary`` puts it before an engine class, whose ``release``
    the later frees reach, so the type checker reads it as a subclass of ``Engine``."""

    canary_fired = False

    def release(self, request) -> None:
        if not self.canary_fired:
            self.canary_fired = True
            return
        super().release(request)


def with_canary(engine_class: type) -> type:
    return type(f"Canary{engine_class.__name__}", (LostFree, engine_class), {})
