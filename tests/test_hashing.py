"""Chained block hashes: deterministic, prefix-sensitive, only over full blocks."""

from __future__ import annotations

import os
import subprocess
import sys

from kvprop.allocator.hashing import ROOT_HASH, chain_hashes, fingerprint, hash_block, prefix_hash
from kvprop.sim.request import Request


def test_hash_block_is_deterministic():
    """Equal inputs give equal hashes (a trace replays to the same cache keys)."""
    assert hash_block(ROOT_HASH, [1, 2, 3]) == hash_block(ROOT_HASH, (1, 2, 3))
    assert hash_block(5, [1], 7) == hash_block(5, [1], 7)


def test_hash_block_depends_on_parent_tokens_and_extra():
    """Each input of the hash changes it."""
    base = hash_block(ROOT_HASH, [1, 2])
    assert hash_block(ROOT_HASH + 1, [1, 2]) != base
    assert hash_block(ROOT_HASH, [2, 1]) != base
    assert hash_block(ROOT_HASH, [1, 2], extra=1) != base


def test_hashes_are_non_negative_63_bit():
    """Hashes are masked to 63 bits so they fit an int64 tensor and are never negative."""
    for tokens in ([0], [1, 2, 3], [-5, 7]):
        h = hash_block(ROOT_HASH, tokens)
        assert 0 <= h < 1 << 63


def test_chain_hashes_are_chained():
    """Block i's hash is hash(block i-1's hash, block i's tokens), starting from the fixed root."""
    tokens = [1, 2, 3, 4, 5, 6]
    h = chain_hashes(tokens, 2)
    assert h[0] == hash_block(ROOT_HASH, [1, 2])
    assert h[1] == hash_block(h[0], [3, 4])
    assert h[2] == hash_block(h[1], [5, 6])


def test_chain_hashes_cover_only_full_blocks():
    """A partial last block has no hash."""
    assert len(chain_hashes([1, 2, 3, 4, 5], 2)) == 2
    assert chain_hashes([1], 2) == []


def test_chain_hashes_from_a_start_index_continue_the_chain():
    """Hashing from block ``start`` with the previous hash as parent extends the same chain."""
    tokens = list(range(8))
    full = chain_hashes(tokens, 2)
    assert chain_hashes(tokens, 2, start=2, parent=full[1]) == full[2:]


def test_equal_blocks_after_different_prefixes_hash_differently():
    """Prefix sensitivity: the same block tokens after a different prefix is a different block."""
    a = chain_hashes([1, 1, 7, 7], 2)
    b = chain_hashes([2, 2, 7, 7], 2)
    assert a[1] != b[1]


def test_shared_prefix_shares_hashes_until_the_first_difference():
    """Two prompts share exactly the hashes of their common full blocks."""
    a = chain_hashes([1, 2, 3, 4, 5, 6], 2)
    b = chain_hashes([1, 2, 3, 4, 9, 6], 2)
    assert a[:2] == b[:2]
    assert a[2] != b[2]


def test_request_block_hashes_match_chain_hashes_as_tokens_grow():
    """A request's incremental hashes equal the batch chain over its tokens."""
    r = Request("r", [3, 1, 4, 1, 5], 4, 2, 10)
    assert r.block_hashes == chain_hashes([3, 1, 4, 1, 5], 2)
    r.append_token(9)
    assert r.block_hashes == chain_hashes([3, 1, 4, 1, 5, 9], 2)
    assert len(r.block_hashes) == 3


def test_prefix_hash_and_fingerprint_are_position_and_group_sensitive():
    """Fingerprints differ per group, position and prefix, so misplaced data reads back wrong."""
    p1 = prefix_hash(ROOT_HASH, 1)
    p2 = prefix_hash(p1, 1)
    assert p1 != p2
    assert fingerprint(0, 0, p1) != fingerprint(1, 0, p1)
    assert fingerprint(0, 0, p1) != fingerprint(0, 1, p1)
    assert fingerprint(0, 1, p1) != fingerprint(0, 1, p2)


def test_hashes_are_reproducible_across_processes():
    """No per-process salt: a fresh interpreter computes the same chain (PYTHONHASHSEED varies)."""
    code = "from kvprop.allocator.hashing import chain_hashes; print(chain_hashes([1, 2, 3, 4], 2))"
    outs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
        outs.add(out.stdout.strip())
    assert outs == {str(chain_hashes([1, 2, 3, 4], 2))}
