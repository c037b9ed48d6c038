"""Prefix-cache retention: which sliding-window and state blocks are worth a hash.

A sliding-window hit ending at block boundary ``e`` needs the ``need`` blocks just before
``e`` (``SlidingWindow.hit_blocks_needed``) and nothing earlier. vLLM (0.30.0 on, production
default interval 0; ``SlidingWindowManager.reachable_block_mask``) hashes only blocks some
retained hit end can use, and still counts the others as cached:

- interval None: every block boundary is a retained end (dense, except a one-token window,
  whose hits need no block at all);
- interval 0: only the ends a later request is known to resume at — the last full block
  boundary before the prompt's last token, and the shared-prefix junction the lookup that
  admitted the request reported (``request.shared_prefix_boundary``);
- interval I > 0: those, and every multiple of I.

kvprop has one block size, so vLLM's alignment unit is the block size. The EAGLE drop
(``AllocatorConfig.eagle``) makes a hit at ``e`` need one block more, the one after ``e``:
every tail ends one block later and is one block longer (vLLM's ``shift`` and
``_contiguous_blocks_for_hit``), and the ends a later request resumes at are those an EAGLE
lookup lands on (``replay_boundaries`` with ``use_eagle``, and the block before a junction).
"""

from __future__ import annotations


def resume_boundaries(request, eagle: bool = False) -> tuple[int, ...]:
    """Token positions a later request replaying ``request``'s prompt may resume at: the
    prompt's last token (``replay_boundaries`` in vLLM's coordinator) and, when the lookup
    that admitted it found one, the shared-prefix junction. With the EAGLE drop: a block below
    where a resend and a longer sibling look up to, and the block before the junction too."""
    junction = request.shared_prefix_boundary
    prompt = request.num_prompt_tokens
    if not eagle:
        return (prompt - 1, junction) if junction > 0 else (prompt - 1,)
    bs = request.block_size
    ends = {max((prompt - 1) // bs * bs - bs, 0), max(prompt // bs * bs - bs, 0)}
    if junction > 0:
        ends |= {junction, junction - bs}
    return tuple(sorted(ends))


def kept_block_mask(spec, interval: int | None, boundaries, start: int, end: int, eagle: bool = False) -> list[bool]:
    """For block indices ``start..end-1`` of a sliding-window group: whether the block is hashed."""
    bs, need, shift = spec.block_size, spec.hit_blocks_needed + eagle, int(eagle)
    if interval is None:
        return [need > 0] * (end - start)
    per = interval // bs
    tails: set[int] = set()
    for boundary in boundaries:
        last = boundary // bs + shift
        tails.update(range(max(0, last - need), last))
    return [
        i in tails or (per > 0 and (need >= per or (i >= shift and (i - shift) % per >= per - need)))
        for i in range(start, end)
    ]


def kept_state_mask(spec, interval: int | None, boundaries, start: int, end: int) -> list[bool] | None:
    """For block indices ``start..end-1`` of a Mamba group: whether the state block is hashed.
    A Mamba hit at boundary ``e`` needs exactly the one state block before ``e`` (vLLM's
    ``MambaManager.reachable_block_mask``); None means every block."""
    if interval is None:
        return None
    bs, per = spec.block_size, interval // spec.block_size
    if interval > 0 and per <= 1:
        return None
    ends = {boundary // bs - 1 for boundary in boundaries}
    return [i in ends or (per > 1 and (i + 1) % per == 0) for i in range(start, end)]
