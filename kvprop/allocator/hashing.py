"""Chained block hashes.

A block's hash covers its parent's hash, its token ids and extra keys, so equal hashes
mean equal prefixes. Python's tuple-of-int hash is deterministic across processes (only
str/bytes hashing is salted, and ``None`` is avoided because its hash varies before 3.12),
which makes hashes reproducible from a trace while costing a fraction of a digest.
"""

from __future__ import annotations

from collections.abc import Sequence

ROOT_HASH = 0x5EED_C0DE_B10C_0000
MASK63 = (1 << 63) - 1


def hash_block(parent: int, tokens: Sequence[int], extra: int = 0) -> int:
    return hash((parent, tuple(tokens), extra)) & MASK63


def chain_hashes(tokens: Sequence[int], block_size: int, start: int = 0, parent: int = ROOT_HASH) -> list[int]:
    """Hashes of the full blocks of ``tokens`` from block index ``start`` on, chained from ``parent``."""
    out = []
    for i in range(start, len(tokens) // block_size):
        parent = hash_block(parent, tokens[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out


def prefix_hash(previous: int, token: int) -> int:
    """Rolling hash of a token prefix, one position at a time (fingerprints build on it)."""
    return hash((previous, token)) & MASK63


def fingerprint(group: int, position: int, prefix: int) -> int:
    """What group ``group`` stores at ``position`` for a prefix whose rolling hash is ``prefix``."""
    return hash((group, position, prefix)) & MASK63


def state_fingerprint(group: int, num_tokens: int, prefix: int) -> int:
    """What a state group's block holds after exactly the first ``num_tokens`` tokens, whose
    rolling hash is ``prefix``: one value, in the block's first slot."""
    return fingerprint(group, -num_tokens, prefix)
