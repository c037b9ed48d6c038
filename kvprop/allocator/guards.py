"""Whether kvprop's allocator asserts its own preconditions.

On by default: the pool refuses to pop an empty queue, free a free block or cache a block
twice. An allocator under test (vLLM's, a user's) need not have such guards, so a bug
variant found only because one of them fired proves nothing about the invariants. With
``ENABLED = False`` (``kvprop fuzz --no-guards``, ``kvprop bugs --no-guards``) the allocator
runs unguarded, and a find shows which invariant catches the bug on its own. A trace records
the setting it ran with (``Trace.guards``) and runs with it again (``held``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

ENABLED = True


@contextlib.contextmanager
def held(enabled: bool) -> Iterator[None]:
    """Run the block with the guards ``enabled`` (or not), then restore the setting."""
    global ENABLED
    before, ENABLED = ENABLED, enabled
    try:
        yield
    finally:
        ENABLED = before
