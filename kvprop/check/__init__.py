"""Everything that judges: the violation kinds, the invariants, the incremental mirror, the checker.

The checks read a target only through its view (see ``docs/targets.md``) and the engine's
own records, so the same sentences judge every target. ``kinds.KINDS`` lists every
violation kind with its invariant and sentence; ``docs/design.md`` says why each holds and
what is not checked. It may import ``kvprop.allocator``, ``kvprop.sim`` and ``kvprop.errors``.
"""
