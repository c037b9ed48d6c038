"""Prefill checkpoints of a state group: where a chunk may save a state it passes.

A state group in align mode saves the state after a chunk's last token. Some kernels can
also save, in the same forward pass, the state after an earlier token of the chunk (vLLM
0.33.0: ``MambaSpec.num_prefill_checkpoint_blocks``, set by mamba_mixer2, GDN and KDA
layers); the scheduler then need not end a chunk where a state must be cached. Three parts
of vLLM apply the same rule, each on its own: the worker (``compute_mamba_prefill_checkpoints``)
writes the state, the manager reserves a block for it and keys it, the scheduler stops
cutting the chunk. kvprop's engine, allocator and checks call these functions the same way
(docs/design.md §2 "Prefill checkpoints").

For a chunk of positions [start, end), ``unit`` the hash unit and ``bs`` the block size:
the checkpoint is the last unit boundary before the chunk's last token; the chunk saves it
when the chunk starts on a unit boundary, the checkpoint is at least a unit past the start
and inside the chunk, the kernel's ``alignment`` divides its offset into the chunk, and the
column it goes to, the one before the new running state (``cdiv(end, bs) - 2``), is past the
column of the state the chunk starts from.
"""

from __future__ import annotations

from kvprop.allocator.specs import cdiv


def checkpoint_position(num_tokens: int, unit: int) -> int:
    """The last unit boundary before token ``num_tokens`` (vLLM's
    ``get_mamba_prefill_checkpoint_position`` without EAGLE's drop or hash lookahead)."""
    return max(0, (num_tokens - 1) // unit * unit)


def checkpoint_column(end: int, block_size: int) -> int:
    """The table column a checkpoint of a chunk ending at ``end`` is written to."""
    return cdiv(end, block_size) - 2


def saves_checkpoint(start: int, end: int, position: int, unit: int, block_size: int, alignment) -> bool:
    """Whether a chunk [start, end) saves the state after ``position`` (vLLM's
    ``is_mamba_prefill_checkpoint_valid``); ``alignment`` None: the kernel saves none."""
    if alignment is None:
        return False
    return (
        start % unit == 0
        and checkpoint_column(end, block_size) > (start - 1) // block_size
        and start + unit <= position
        and start < position < end
        and (position - start) % alignment == 0
    )


def chunk_checkpoint(start: int, end: int, unit: int, block_size: int, alignment) -> int:
    """The position whose state the chunk [start, end) saves in its checkpoint column, or 0."""
    position = checkpoint_position(end, unit)
    return position if saves_checkpoint(start, end, position, unit, block_size, alignment) else 0
