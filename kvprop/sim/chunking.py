"""Where a prefill chunk may end when a state group caches its states at block boundaries.

A mixin of the scheduler (``kvprop.sim.scheduler``). With a state group in align mode
(vLLM's ``mamba_cache_mode="align"``) a state is cached only at a block boundary, at the
prompt's last hash boundary when hits may end inside a block, at the shared-prefix
junction, or at the prefill's checkpoint: a chunk ends where the state it leaves can be
kept, as vLLM 0.33.0's ``Scheduler._mamba_block_aligned_split`` cuts it. Without such a
group a chunk is what the budget allows.
"""

from __future__ import annotations

from kvprop.allocator.checkpoint import checkpoint_position, saves_checkpoint
from kvprop.allocator.specs import EngineConfig, GroupSpec, Mamba


class ChunkRules:
    """Scheduler mixin: ``_chunk`` and what it asks."""

    # what it reads of the engine it is mixed into (set by ``Engine.__init__``)
    config: EngineConfig
    specs: tuple[GroupSpec, ...]
    state_groups: frozenset[int]
    block_size: int

    # Whether a final chunk saving the prefill's checkpoint may run past the next block boundary
    # when it starts inside a block (vLLM 0.33.0's scheduler; ``_chunk``). kvprop's never does.
    checkpoint_skips_block_stop = False

    def _init_chunking(self) -> None:
        state_specs = [spec for spec in self.specs if isinstance(spec, Mamba)]  # the state groups'
        self.state_aligned = any(spec.mode == "align" for spec in state_specs)
        # the state groups' prefill-checkpoint alignment (AllocatorConfig requires them all alike)
        self.checkpoint_alignment = next((spec.checkpoint for spec in state_specs), None)

    def _chunk(self, request, start: int, num_tokens: int) -> int:
        """Tokens to compute from ``start``: ``num_tokens``, cut so that a prefill chunk of a state
        group in align mode ends where a state may be cached (vLLM 0.33.0's
        ``Scheduler._mamba_block_aligned_split``, without EAGLE's drop): a
        non-final chunk ends on a block boundary (unless that leaves nothing and a block is wider
        than the step's budget), and no chunk runs past the next block boundary when it starts
        inside a block, past the last block boundary before the request's last token, past the
        prompt's last hash boundary when hits may end inside a block (where the state is keyed),
        or past the junction; a final chunk that saves the prefill's checkpoint itself needs
        neither of the two before the junction. 0 means the request is not scheduled in this
        step.

        vLLM 0.33.0 also lets such a chunk run past the next block boundary when it starts
        inside a block, judged before the junction may cut the chunk: the block it starts in
        (a hit's copy) or the chunk's end then holds a state that is not its block's, and is
        cached as if it were (docs/findings.md). kvprop's scheduler always stops there."""
        if not self.state_aligned:
            return num_tokens
        prefill_end = request.prefill_end
        if start >= prefill_end:
            return num_tokens
        bs, end = self.block_size, start + num_tokens
        internal = self._saves_prompt_checkpoint(start, end, prefill_end)
        if end < prefill_end:
            aligned = end // bs * bs
            if aligned > start or bs <= self.config.token_budget:
                end = aligned
        junction = request.shared_prefix_boundary
        last_cached = 0 if internal else max(0, (request.num_tokens - 1) // bs * bs)
        tail = 0 if internal else self._prompt_tail(request)
        stops = (
            (start // bs + 1) * bs if start % bs and not (internal and self.checkpoint_skips_block_stop) else 0,
            last_cached,
            tail if last_cached < tail < request.num_prompt_tokens else 0,
            start + (junction - start) // bs * bs if start < junction < end else 0,
        )
        end = min((s for s in stops if start < s < end), default=end)
        return max(end - start, 0)

    def _saves_prompt_checkpoint(self, start: int, end: int, prefill_end: int) -> bool:
        """Whether the final prefill chunk [start, end) saves the state at the prefill's
        checkpoint itself (kvprop.allocator.checkpoint), so no stop is needed for it: vLLM's
        scheduler asks this of the first state group, and only when every state group saves
        checkpoints (kvprop requires them all alike)."""
        unit = self.config.allocator.unit
        return end >= prefill_end and saves_checkpoint(
            start, end, checkpoint_position(prefill_end, unit), unit, self.block_size, self.checkpoint_alignment
        )

    def _prompt_tail(self, request) -> int:
        """The prompt's last hash-unit boundary below its last token when hits may end inside a
        block, else 0."""
        allocator = self.config.allocator
        return (request.num_prompt_tokens - 1) // allocator.unit * allocator.unit if allocator.partial_hits else 0
