"""Prompt tokens: the fresh ones an operation derives from its seed, and how a step log shows a prompt.

Apart from the alphabet, which the harness's type names, so that the harness and the
alphabet do not import each other.
"""

from __future__ import annotations


def fresh_tokens(seed: int, n: int, vocab: int) -> list[int]:
    state = seed * 2654435761 + 12345
    out = []
    for _ in range(n):
        state = (state * 1103515245 + 12345) & 0x7FFFFFFF
        out.append((state >> 16) % vocab)
    return out


def show_tokens(tokens: list[int]) -> str:
    """A prompt as a person reads it in a step log: short ones whole, long ones abridged."""
    if len(tokens) <= 16:
        return str(tokens)
    head = ", ".join(map(str, tokens[:8]))
    tail = ", ".join(map(str, tokens[-4:]))
    return f"[{head}, ... {len(tokens) - 12} more ..., {tail}] ({len(tokens)} tokens)"
