"""Requests: tokens, block hashes and fingerprint prefixes, grown as tokens are appended."""

from __future__ import annotations

import enum
from collections.abc import Sequence

from kvprop.allocator.hashing import ROOT_HASH, hash_block, prefix_hash
from kvprop.errors import RequestError


def arrival(prompt, max_new_tokens) -> list[int]:
    """The prompt of a well-formed arrival, as a list; a RequestError names what is malformed.
    Every engine's ``add_request`` takes requests through here."""
    prompt = list(prompt)
    if not prompt or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in prompt):
        raise RequestError(f"add_request: prompt must be a non-empty list of token ids >= 0, got {prompt!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise RequestError(f"add_request: max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    return prompt


def live(requests: dict, request_id: str):
    """``requests[request_id]``; a RequestError naming the live ones where it is not among them."""
    try:
        return requests[request_id]
    except KeyError:
        raise RequestError(f"unknown request {request_id!r}; live requests: {sorted(requests)}") from None


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    LOADING = "loading"  # admitted, external KV still arriving
    LOADED = "loaded"  # its load done, holding its blocks until the scheduler has room to continue it
    ABORTING = "aborting"  # aborted while loading: blocks held until the load resolves
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"  # its load failed under the "fail" policy


class Request:
    """A prompt plus the tokens decoded so far.

    ``block_hashes`` covers every full block of ``tokens`` and ``prefix`` holds the rolling
    hash of every prefix, so the expected fingerprint of any position is O(1). Hashes chain
    per ``unit`` tokens (vLLM's ``hash_block_size``): ``unit_hashes`` has one per unit, and a
    block's hash is the one at its end (the same list when the unit is the block). Decoded
    tokens depend only on the prefix, so requests that share a prefix keep sharing it.
    """

    __slots__ = (
        "request_id",
        "tokens",
        "num_prompt_tokens",
        "max_new_tokens",
        "block_size",
        "vocab",
        "block_hashes",
        "unit",
        "unit_hashes",
        "prefix",
        "num_computed_tokens",
        "status",
        "num_preemptions",
        "load_failed",
        "pending_external",
        "shared_prefix_boundary",
        "registry",
        "spec_token_ids",
        "spec_prefix",
        "num_in_flight",
        "num_output_placeholders",
        "num_stale",
        "decode_at",
        "last_sched_seq",
    )

    def __init__(
        self,
        request_id: str,
        prompt: Sequence[int],
        max_new_tokens: int,
        block_size: int,
        vocab: int,
        registry: dict[int, tuple] | None = None,
        unit: int | None = None,
    ) -> None:
        self.request_id = request_id
        self.tokens: list[int] = []
        self.num_prompt_tokens = len(prompt)
        self.max_new_tokens = max_new_tokens
        self.block_size = block_size
        self.vocab = vocab
        self.block_hashes: list[int] = []
        self.unit = unit or block_size
        self.unit_hashes: list[int] = self.block_hashes if self.unit == block_size else []
        self.prefix: list[int] = []
        self.num_computed_tokens = 0
        self.status = Status.WAITING
        self.num_preemptions = 0
        self.load_failed = False
        self.pending_external = 0
        self.shared_prefix_boundary = 0  # the junction of the lookup that admitted it (kvprop.allocator.retention)
        self.registry = registry
        self.spec_token_ids: list[int] = []  # drafts proposed after the last sampled token, unverified
        self.spec_prefix: list[int] = []  # the rolling prefix hash through each draft
        # With batches in flight (kvprop.sim.pipeline), as vLLM's Request counts them: tokens
        # scheduled whose output has not come back (inside num_computed_tokens), outputs still to
        # come, the in-flight tokens of a preempted incarnation, the step it may decode again, and
        # the fenced step it was last scheduled in (kvprop.sim.fence).
        self.num_in_flight = 0
        self.num_output_placeholders = 0
        self.num_stale = 0
        self.decode_at = 0
        self.last_sched_seq = 0
        self.extend_tokens(prompt)

    def __repr__(self):
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"{self.status.value})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.tokens) + len(self.spec_token_ids)

    @property
    def prefill_end(self) -> int:
        """Where the request's prefill ends: its prompt, or, resumed after a preemption, every
        token but the last (the outputs it replays; vLLM's scheduler and manager alike)."""
        return max(self.num_prompt_tokens, self.num_tokens - 1)

    @property
    def num_output_tokens(self) -> int:
        return len(self.tokens) - self.num_prompt_tokens

    def extend_tokens(self, tokens) -> None:
        """``append_token`` for many tokens at once (prompts), with the lookups hoisted."""
        prefix, out, unit = self.prefix, self.tokens, self.unit
        previous = prefix[-1] if prefix else ROOT_HASH
        for token in tokens:
            previous = prefix_hash(previous, token)
            prefix.append(previous)
            out.append(token)
            n = len(out)
            if n % unit == 0:
                self._close_unit(n)

    def _close_unit(self, n: int) -> None:
        """Hash the unit ending at ``n`` tokens; at a block's end it is the block's hash too.
        The registry maps each hash to its block's index and the prefixes from the block's
        start to ``n``: what a block cached under it holds (``kvprop.check``)."""
        bs, units = self.block_size, self.unit_hashes
        parent = units[-1] if units else ROOT_HASH
        unit_hash = hash_block(parent, self.tokens[n - self.unit :])
        units.append(unit_hash)
        if units is not self.block_hashes and n % bs == 0:
            self.block_hashes.append(unit_hash)
        if self.registry is not None:
            start = (n - 1) // bs * bs
            self.registry.setdefault(unit_hash, (start // bs, tuple(self.prefix[start:n])))

    def append_token(self, token: int) -> None:
        previous = self.prefix[-1] if self.prefix else ROOT_HASH
        self.tokens.append(token)
        self.prefix.append(prefix_hash(previous, token))
        n = len(self.tokens)
        if n % self.unit == 0:
            self._close_unit(n)

    def keys_in_block(self, index: int, group: int) -> set:
        """The cache keys of this request's prefixes that end inside block ``index`` of ``group``:
        the block's own, and, with a hash unit below the block, each unit boundary's inside it.
        A hit on that block is this request's own if the block carries one of them."""
        scale = self.block_size // self.unit
        return {(h, group) for h in self.unit_hashes[index * scale : (index + 1) * scale]}

    def next_token(self) -> int:
        """The token decoding produces next: a function of the prefix alone."""
        return (self.prefix[-1] >> 17) % self.vocab

    def token_after(self, position: int) -> int:
        """The token decoding produces after ``position``: what a pass whose last position it is samples."""
        return (self.prefix[position] >> 17) % self.vocab

    @property
    def num_settled_tokens(self) -> int:
        """Computed tokens whose batch has come back: what the blocks hold by now."""
        return self.num_computed_tokens - self.num_in_flight

    def prefix_at(self, position: int) -> int:
        """The rolling hash of the tokens through ``position``, drafts included: what a pass that
        computes ``position`` writes (an accepted draft is the token decoding produces, so its
        position's hash is the same either way)."""
        n = len(self.tokens)
        return self.prefix[position] if position < n else self.spec_prefix[position - n]

    def propose_drafts(self, k: int) -> None:
        """A proposer's guesses of the next tokens, each from the prefix through the one before.
        Like an n-gram proposer it may find fewer than ``k`` (1 to ``k``, evenly), and its guess
        agrees with decoding three times in four; both are functions of the prefix hash, so a
        trace replays the same drafts and acceptances."""
        previous, drafts = self.prefix[-1], []
        for _ in range(1 + (previous >> 50) % k):
            token = (previous >> 17) % self.vocab
            if (previous >> 40) % 4 == 0:
                token = (token + 1) % self.vocab
            previous = prefix_hash(previous, token)
            drafts.append(token)
        self.set_drafts(drafts)

    def set_drafts(self, drafts) -> None:
        """``drafts`` as the tokens after the last one, whoever proposed them (a scheduler's
        placeholders included: vLLM pads a new decode with -1, which verification rejects)."""
        previous, prefixes = self.prefix[-1], []
        for token in drafts:
            previous = prefix_hash(previous, token)
            prefixes.append(previous)
        self.spec_token_ids, self.spec_prefix = list(drafts), prefixes

    def verified_tokens(self, num_verified: int) -> list[int]:
        """What a verification pass over the first ``num_verified`` drafts samples: the leading
        drafts decoding agrees with, then the token decoding produces after them."""
        out, previous = [], self.prefix[-1]
        for token, through in zip(self.spec_token_ids[:num_verified], self.spec_prefix, strict=False):
            if token != (previous >> 17) % self.vocab:
                break
            out.append(token)
            previous = through
        return [*out, (previous >> 17) % self.vocab]

    def verify_drafts(self, num_verified: int) -> int:
        """The verification pass over the first ``num_verified`` drafts: the leading ones that
        decoding agrees with become tokens, the rest are dropped. Returns how many were accepted."""
        accepted = self.verified_tokens(num_verified)[:-1]
        self.extend_tokens(accepted)
        self.spec_token_ids, self.spec_prefix = [], []
        return len(accepted)

    def drop_drafts(self) -> None:
        self.spec_token_ids, self.spec_prefix = [], []
