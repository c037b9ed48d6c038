"""The data oracle in SGLang's terms: what a forward pass reads from SGLang's KV buffers is what
the request's own tokens computed there.

kvprop's worker for SGLang (``kvprop.targets.sglang.engine``) writes, at each position a batch
computes, a fingerprint of the tokens up to and including it into the KV slot SGLang's
``req_to_token`` row names (the full-attention layer's buffer, and the sliding-window layer's
through SGLang's own full-to-SWA slot translation), for the whole batch, and then each request
reads its computed prefix, as a layer stores the batch's keys before its attention reads: every
full-attention position, and in the sliding-window layer the W positions before the first token
it computes (SGLang's window excludes the token itself: ``kvprop.targets.sglang.shape.
window_positions``). A slot that was freed and reused, a prefix matched from a node whose slots
were evicted, or a window slot freed too early reads back another fingerprint.
A cached node's slots are judged at every full sweep, against the fingerprints of its path.
"""

from __future__ import annotations

from kvprop.errors import Violation

MODULUS = (1 << 23) - 1  # fingerprints stay exact in the float32 buffers SGLang's pools hold
UNWRITTEN = 0.0  # what SGLang's zero-initialised buffers hold before a write


def extend_fingerprints(fingerprints: list[int], tokens) -> list[int]:
    """``fingerprints`` grown to one per token: each one hashes every token up to its own, so two
    positions agree only where the prefixes agree; never 0 (an unwritten slot)."""
    h = fingerprints[-1] if fingerprints else 1
    for token in tokens[len(fingerprints) :]:
        h = (h * 1_000_003 + int(token) + 7) % MODULUS + 1
        fingerprints.append(h)
    return fingerprints


def check_read(request_id: str, layer: str, positions: range, slots, values, expected) -> None:
    """``values``, read from ``slots`` for ``positions``, equal the request's own fingerprints."""
    for pos, slot, got, want in zip(positions, slots, values, expected, strict=True):
        if got != want:
            what = "was never written" if got == UNWRITTEN else "holds another prefix's KV"
            raise Violation(
                "sglang-kv-data",
                f"{request_id} reads position {pos} of the {layer} layer from KV slot {slot}, which {what} "
                f"(read {got:.0f}, its own tokens computed {want})",
                requests=[request_id],
            )


def check_tree_data(root, value_of, read_full) -> None:
    """Every cached node's full-attention slots hold the fingerprints of its path from the root
    (``root``: a walkable tree's root; ``value_of(node)``: its full-attention slots, or None;
    ``read_full(slots)``: the values those slots hold). Each node extends its parent's
    fingerprints by its own tokens."""
    stack: list[tuple] = [(child, [], []) for child in root.children.values()]
    while stack:
        node, above, fingerprints = stack.pop()
        tokens = [*above, *(int(t) for t in node.key.token_ids)]  # SGLang's RadixKey
        fingerprints = extend_fingerprints(list(fingerprints), tokens)
        value = value_of(node)
        slots = [int(s) for s in value] if value is not None else []
        if slots:
            expected = fingerprints[len(above) :]
            for i, (slot, got, want) in enumerate(zip(slots, read_full(slots), expected, strict=False)):
                if got != want:
                    raise Violation(
                        "sglang-cached-kv-data",
                        f"a cached node's KV slot {slot} (position {len(above) + i} of its path) does not hold "
                        f"what its tokens computed (read {got:.0f}, expected {want})",
                    )
        stack.extend((child, tokens, fingerprints) for child in node.children.values())
