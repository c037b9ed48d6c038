"""The retention contract: which counted-as-cached blocks may lack their hash.

vLLM's contract (docs/design.md §8.3): a sliding-window or state block is worth a hash only
if some hit the policy serves can use it. A hit ending at block boundary ``e`` uses the
``need`` blocks before ``e`` (one, for a state group); the policy serves hits ending at

- every boundary (retention interval None),
- the boundaries a later request is known to resume at: the block boundary at or below the
  prompt's last token, and the shared-prefix junction of the lookup that admitted the
  request (any interval that is not None),
- every multiple of the interval (interval > 0).

Every other block may be counted as cached and stay unhashed; no hit can reach it, so a
lookup never misses it. This module states the contract from the hit side, independently of
how an allocator computes its mask (``kvprop.allocator.retention``), so that the two check
each other.
"""

from __future__ import annotations

from kvprop.allocator.specs import Mamba, SlidingWindow


def retained_indices(spec, interval: int | None, request, num_blocks: int, eagle: bool = False):
    """Block indices below ``num_blocks`` that must carry their hash once counted as cached;
    None when every one must (no retention applies to ``spec``).

    With the EAGLE drop (windows only) a hit ending at ``e`` reads the block after ``e`` too,
    and the hits the policy serves are those an EAGLE lookup lands on: one block below where a
    resend of the prompt (its last token) and a longer sibling (its length) look up to, a
    junction and the block before it."""
    if isinstance(spec, SlidingWindow):
        need = spec.hit_blocks_needed + eagle
    elif isinstance(spec, Mamba):
        need = 1  # a state hit at a boundary needs exactly the state block before it
    else:
        return None
    bs, prompt = spec.block_size, request.num_prompt_tokens
    if interval is None:
        return None if need > 0 else frozenset()
    junction = request.shared_prefix_boundary
    if eagle:  # the hit's end, then the block the lookup read past it
        hits = {max((prompt - 1) // bs - 1, 0), max(prompt // bs - 1, 0)}
        hits |= {junction // bs, junction // bs - 1} if junction > 0 else set()
        ends = {hit + 1 for hit in hits}
    else:
        ends = {(prompt - 1) // bs} | ({junction // bs} if junction > 0 else set())
    if interval > 0:  # every multiple of the interval (past the block after it, with the drop)
        ends.update(range(interval // bs + eagle, num_blocks + need + 1 + eagle, interval // bs))
    return frozenset(i for end in ends for i in range(max(0, end - need), min(end, num_blocks)))
