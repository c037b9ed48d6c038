"""The harness both drivers apply operations to: an engine, its checker and the prompts seen so far."""

from __future__ import annotations

from kvprop.allocator.specs import EngineConfig
from kvprop.check.checker import Checker, drain
from kvprop.errors import LimitError, RequestError
from kvprop.search.tokens import fresh_tokens, show_tokens
from kvprop.targets import build_engine

# The prompts a trace derives, all together: far beyond what a walk produces, well within memory.
MAX_PROMPT_TOKENS = 20_000_000


class Harness:
    """An engine, its checker and the prompts seen so far; ``apply`` checks every invariant."""

    def __init__(
        self,
        config: EngineConfig,
        variant: str | None = None,
        device: str | None = None,
        checks: bool = True,
        target=None,
        canary: bool = False,
        full_sweeps: bool = False,
        journal=None,
    ):
        self.config = config
        self.journal = journal  # kvprop.search.journal.Journal: each operation is written before it runs
        # full_sweeps: every check sweeps every block and table, the reference the incremental
        # checks are tested against (tests/test_incremental.py)
        self.checker = Checker(enabled=checks, full_every=1 if full_sweeps else Checker.FULL_EVERY)
        self.engine = build_engine(
            config, variant=variant, target=target, device=device, hooks=self.checker, canary=canary
        )
        self.prompts: list[list[int]] = []
        self.prompt_tokens = 0
        if journal is not None:
            journal.built()

    def derive_tokens(self, parent: int, cut: int, extra: int, seed: int) -> list[int]:
        """The ``parent``-th most recent prompt less its last ``cut`` tokens, then ``extra`` fresh
        ones: counting from the most recent makes chains of shared prefixes (A, A+x, A+x+y) common,
        and ``cut=0`` (what minimising tends to) shares the whole parent."""
        source = self.prompts[-1 - parent % len(self.prompts)] if self.prompts else []
        base = source[: max(0, len(source) - cut)]
        self.prompt_tokens += len(base) + extra
        if self.prompt_tokens > MAX_PROMPT_TOKENS:
            raise LimitError(
                f"the operations derive prompts of more than {MAX_PROMPT_TOKENS:,} tokens in all; "
                f"no walk produces that (is the trace hand-made?)"
            )
        return base + fresh_tokens(seed + 31 * len(base), extra, self.config.vocab)

    def add_request(self, prompt: list[int], max_new_tokens: int) -> str:
        self.prompts.append(prompt)  # even if rejected: every producing operation adds one prompt
        try:
            request = self.engine.add_request(prompt, max_new_tokens)
        except RequestError as e:
            return f"rejected: {e}"
        return f"{request.request_id} = {show_tokens(prompt)} (+{max_new_tokens} new)"

    def apply(self, op) -> str:
        if self.journal is not None:
            self.journal.operation(op)
        outcome = op.apply(self)
        self.checker.check_all(self.engine)
        return outcome

    def drain(self) -> int:
        if self.journal is None:
            return drain(self.engine, self.checker)
        self.journal.drain()
        return drain(self.engine, self.checker, on_step=self.journal.beat)
