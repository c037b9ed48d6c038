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
    None when every one must (no retention applies to ``spec``). With the EAGLE drop a window's
    hit needs one block more (modelled with dense retention: every block then)."""
    if isinstance(spec, SlidingWindow):
        need = spec.hit_blocks_needed + eagle
    elif isinstance(spec, Mamba):
        need = 1  # a state hit at a boundary needs exactly the state block before it
    else:
        return None
    bs = spec.block_size
    if interval is None:
        return None if need > 0 else frozenset()
    ends = {(request.num_prompt_tokens - 1) // bs}
    junction = getattr(request, "shared_prefix_boundary", 0)
    if junction > 0:
        ends.add(junction // bs)
    if interval > 0:
        ends.update(range(interval // bs, num_blocks + need + 1, interval // bs))
    return frozenset(i for end in ends for i in range(max(0, end - need), min(end, num_blocks)))
