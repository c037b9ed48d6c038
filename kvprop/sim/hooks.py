"""The hooks: where the engine lets a harness look inside a step, as blocks change hands.

The engine (``kvprop.sim.engine``) and its mixins call them around every allocation, at the
connector hand-off and before every write; the default checks nothing, and the checker
(``kvprop.check.checker``) implements them. They live apart from the engine so that each
mixin can name the type of the engine's ``hooks`` without importing the engine that
composes it.
"""

from __future__ import annotations


class Hooks:
    """Where a harness checks state inside a step; the default checks nothing."""

    def before_allocation(self, engine, request, num_new_tokens: int, kwargs: dict):
        return None

    def allocation_crashed(self, engine, request, token) -> str | None:
        """allocate_slots raised (the TargetCrash propagates after this returns): a sentence the
        crash's message carries, saying which rule the raise broke, or None."""
        return None

    def after_hit(self, engine, request, hits, num_hit: int) -> None:
        """get_computed_blocks answered ``request`` at admission."""

    def before_misuse(self, engine, call: str, request):
        return None

    def after_misuse(self, engine, call: str, request, token, raised, contract: str) -> None:
        """A malformed call was made; ``raised`` is what the target raised (None: it accepted)."""

    def after_allocation(self, engine, request, token, result, computed: int) -> None:
        pass

    def after_free(self, engine, request) -> None:
        pass

    def at_handoff(self, engine, request, tables, num_local: int, num_external: int) -> None:
        """The blocks allocated for external tokens are about to be handed to the connector."""

    def after_offer(self, engine, request, num_local: int, num_external: int) -> None:
        """The connector's tier offered ``num_external`` tokens of ``request`` beyond its local hit
        of ``num_local``."""

    def before_load_write(self, engine, request, block_ids) -> None:
        """An asynchronous load is about to write ``block_ids`` ((group, block id) pairs)."""

    def load_resolved(self, engine, request, ok: bool, num_local: int) -> None:
        """The scheduler has handled ``request``'s asynchronous load, which landed (``ok``) or
        failed; ``num_local``: the tokens it had computed before the load."""

    def before_execute(self, engine, report) -> None:
        """The step's scheduling is decided (``report``); its copies and writes come next."""

    def before_write(self, engine, request, group: int, table, start: int, num_tokens: int) -> None:
        """``request`` is about to compute positions [start, start + num_tokens) of ``group`` into ``table``."""

    def before_state_write(self, engine, request, group: int, source, start: int, targets) -> None:
        """``request`` is about to advance state group ``group`` from the state after ``start``
        tokens, in block ``source`` (None: from nothing), writing each ``(block, index, n)`` of
        ``targets``: the state after ``n`` tokens into the block at table index ``index``."""

    def step_starts(self, engine) -> None:
        """A step begins: nothing of it has been allocated or computed yet."""

    def before_read(self, engine, request_id: str, layer: str, positions, slots, expected) -> None:
        """An engine that holds its KV in its own buffers (SGLang's): ``request_id``'s forward pass
        is about to read ``positions`` of ``layer`` from ``slots``, which must hold ``expected``."""
