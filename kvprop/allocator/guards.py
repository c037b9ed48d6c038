"""Whether kvprop's allocator asserts its own preconditions.

On by default: the pool refuses to pop an empty queue, free a free block or cache a block
twice. An allocator under test (vLLM's, a user's) need not have such guards, so a bug
variant found only because one of them fired proves nothing about the invariants. With
``ENABLED = False`` (``kvprop bugs --no-guards``) the allocator runs unguarded, and the
variant suite shows which invariant catches each bug on its own.
"""

ENABLED = True
