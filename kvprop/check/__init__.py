"""Everything that judges: the violation kinds, the invariants, the decision oracles, the
incremental mirror, the checker.

Verified, for every target, through its view and the engine's own records: the invariants
of ``kinds.INVARIANTS``, each violation kind of ``kinds.KINDS`` naming the one it breaks.
``docs/design.md`` §4 lists both (generated from them by ``kvprop facts``) and says why each
holds; §6 says what is not checked, and "What is not modelled" which shapes are never built.

May import ``kvprop.allocator``, ``kvprop.sim`` and ``kvprop.errors``.
"""
