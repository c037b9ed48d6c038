"""kvprop's own trace minimiser, for what the walker finds.

Delta debugging over the operations, then simpler arguments, then a simpler
configuration, keeping a candidate only while it still fails with the same kind of
violation, until no single removal or simplification fails any more.
"""

from __future__ import annotations

import time
from functools import partial

import attrs

from kvprop import interrupt
from kvprop.allocator.options import smaller
from kvprop.allocator.specs import OPTIONS, FullAttention
from kvprop.errors import ConfigError, TargetError
from kvprop.search.alphabet import PROMPT_PRODUCERS, AddLargeRequest, AddRequest
from kvprop.search.execute import execute
from kvprop.search.trace import Failure, Trace


class Minimiser:
    """``best`` is always a trace that fails like the original: read it after an interrupt too.

    ``progress(best, replays)`` is called whenever a smaller failing trace is kept."""

    def __init__(
        self,
        trace: Trace,
        signature,
        variant=None,
        target=None,
        device=None,
        max_replays: int = 20_000,
        progress=None,
        executor=None,
        deadline: float | None = None,
    ):
        self.best = trace
        self.signature = signature
        self.variant, self.target, self.device = variant, target, device
        self.replays = 0
        self.max_replays = max_replays
        self.progress = progress
        # executor(trace) -> Failure | None; kvprop's commands pass a supervised worker's
        # (kvprop.search.supervisor), so that a candidate that kills the target is judged, not fatal
        self.executor = executor or self._in_process
        self.deadline = deadline  # time.monotonic() past which no candidate runs (a hang's replays cost its timeout)
        self.out_of_time = False

    def _in_process(self, candidate: Trace) -> Failure | None:
        return execute(candidate, variant=self.variant, target=self.target, device=self.device)

    def fails(self, candidate: Trace) -> Failure | None:
        """The candidate's failure if it fails the same way (same kind, same exception), else None."""
        if self.replays >= self.max_replays:
            return None
        if self.deadline is not None and time.monotonic() >= self.deadline:
            self.out_of_time = True
            return None
        interrupt.check()
        self.replays += 1
        try:
            failure = self.executor(candidate)
        except (ConfigError, TargetError):  # a candidate configuration the target refuses
            return None
        return failure if failure is not None and failure.signature == self.signature else None

    def accept(self, candidate: Trace) -> bool:
        failure = self.fails(candidate)
        if failure is None:
            return False
        steps = candidate.steps[: failure.step + 1]  # nothing after the failure matters
        self.best = attrs.evolve(candidate, steps=steps, failure=failure)
        if self.progress is not None:
            self.progress(self.best, self.replays)
        return True

    def run(self) -> Trace:
        if not self.accept(self.best):
            raise ValueError(f"the trace does not fail with {self.signature[0]!r}; nothing to minimise")
        while True:
            size = (len(self.best.steps), self._weight(self.best))
            self.remove_steps()
            self.simplify_arguments()
            self.simplify_config()
            if (len(self.best.steps), self._weight(self.best)) < size:
                continue
            if not self.fill_with_large_requests() and not self.remove_pairs():
                return self.best

    @staticmethod
    def _weight(trace: Trace) -> int:
        a = trace.config.allocator
        return (
            sum(v for op in trace.steps for v in attrs.astuple(op))
            + a.num_blocks
            + 10 * len(a.groups)
            + trace.config.token_budget
            + trace.config.lookahead
            + trace.config.speculative_tokens
        )

    def remove_steps(self) -> None:
        """ddmin: remove chunks, halving the chunk size down to single operations."""
        chunk = max(1, len(self.best.steps) // 2)
        while chunk >= 1:
            i = 0
            while i < len(self.best.steps):
                if self.accept(self.best.with_steps(without(self.best.steps, i, i + chunk))):
                    continue
                i += chunk
            chunk //= 2

    def remove_pairs(self, at_most: int = 16) -> bool:
        """Two operations that only fail together once both are gone (e.g. a prompt and the step
        that uses it) survive single removals: on a short trace, try every pair."""
        steps = self.best.steps
        if len(steps) > at_most:
            return False
        for i in range(len(steps)):
            for j in range(i + 1, len(steps)):
                if self.accept(self.best.with_steps(without(without(steps, j, j + 1), i, i + 1))):
                    return True
        return False

    def fill_with_large_requests(self) -> bool:
        """Try one large request in place of a run of small ones that fill the pool: keeps a
        candidate that fails the same way with fewer operations. Returns whether it shrank."""
        steps = self.best.steps
        for i, op in enumerate(steps):
            if not isinstance(op, AddRequest):
                continue
            large = AddLargeRequest(parent=op.parent, seed=op.seed)
            for j in range(len(steps), i, -1):
                if sum(isinstance(s, AddRequest) for s in steps[i:j]) < 2:
                    break
                # a run of k producers becomes one: later parents shift by k - 1
                candidate = without(steps[:i] + (large,) + steps[i:], i + 1, j + 1)
                if self.accept(self.best.with_steps(candidate)):
                    return True
        return False

    def simplify_arguments(self) -> None:
        for i in range(len(self.best.steps)):
            if i >= len(self.best.steps):
                break
            op = self.best.steps[i]
            for name, (lo, _) in type(op).ARGS.items():
                for value in smaller(getattr(self.best.steps[i], name), lo):
                    steps = list(self.best.steps)
                    steps[i] = attrs.evolve(steps[i], **{name: value})
                    if self.accept(self.best.with_steps(steps)):
                        break

    def simplify_config(self) -> None:
        """Keep the first simpler configuration that still fails, then start over from it: a
        candidate drawn from an older configuration could undo an accepted simplification."""
        while any(
            config is not None and config != self.best.config and self.accept(attrs.evolve(self.best, config=config))
            for config in _simpler_configs(self.best.config)
        ):
            pass


def without(steps, start: int, stop: int) -> tuple:
    """``steps`` less ``steps[start:stop]``, with every later ``parent`` index re-pointed at the
    prompt it named before (parents count back from the most recent prompt), where that survives."""
    out, producers_seen, kept_producers, dropped_before = [], 0, 0, []
    for k, op in enumerate(steps):
        produces = isinstance(op, PROMPT_PRODUCERS)
        if start <= k < stop:
            if produces:
                dropped_before.append(producers_seen)
                producers_seen += 1
            continue
        if produces and producers_seen:
            target = producers_seen - 1 - op.parent % producers_seen
            if target not in dropped_before:
                shift = sum(1 for d in dropped_before if d < target)
                op = attrs.evolve(op, parent=kept_producers - 1 - (target - shift))
        out.append(op)
        if produces:
            producers_seen += 1
            kept_producers += 1
    return tuple(out)


def _valid(make):
    """``make()``, or None where the configuration it builds is not valid (a retention interval
    left with no group to thin, a synchronous connector with a state group)."""
    try:
        return make()
    except ConfigError:
        return None


def _with_allocator(config, **changes):
    """``config`` with those allocator fields changed; None where that is no valid allocator."""
    return _valid(lambda: attrs.evolve(config, allocator=attrs.evolve(config.allocator, **changes)))


def _with_drafts(config, k: int):
    """``config`` with ``k`` drafts, its state groups' scratch columns to match."""
    groups = tuple(attrs.evolve(g, speculative_blocks=k) if g.kind == "mamba" else g for g in config.allocator.groups)
    return _valid(
        lambda: attrs.evolve(config, speculative_tokens=k, allocator=attrs.evolve(config.allocator, groups=groups))
    )


def _simpler_configs(config):
    """Simpler configurations, simplest first; None stands for one that is not valid."""
    a = config.allocator
    groups = a.groups
    candidates = []
    if len(groups) > 1:
        candidates += [groups[:i] + groups[i + 1 :] for i in range(len(groups))]
    candidates += [tuple(FullAttention(g.block_size) if g.kind != "full" else g for g in groups)]
    for new_groups in candidates:
        yield _with_allocator(config, groups=new_groups)
    checkpoints = {g.checkpoint for g in groups if g.kind == "mamba"} - {None}
    if checkpoints:  # no prefill checkpoints, then the finest kernel grid
        for simpler in (None, 1) if checkpoints != {1} else (None,):
            new = tuple(attrs.evolve(g, checkpoint=simpler) if g.kind == "mamba" else g for g in groups)
            yield _with_allocator(config, groups=new)
    for declared in OPTIONS:  # each option's own simpler values (kvprop.allocator.options)
        for value in declared.option.candidates(declared.value(config)):
            yield _valid(partial(declared.set, config, value))
    for k in smaller(config.speculative_tokens, 0):
        yield _with_drafts(config, k)
    for g, spec in enumerate(groups):
        for field in ("window", "chunk"):
            value = getattr(spec, field, None)
            if value is None:
                continue
            for less in smaller(value, spec.block_size if field == "chunk" else 1):
                if field == "chunk" and less % spec.block_size:
                    continue
                new = groups[:g] + (attrs.evolve(spec, **{field: less}),) + groups[g + 1 :]
                yield _with_allocator(config, groups=new)


def minimiser_for(
    trace: Trace, variant=None, target=None, device=None, progress=None, executor=None, deadline=None
) -> Minimiser:
    """A minimiser for ``trace``, which must fail (ValueError otherwise); past ``deadline`` (a
    ``time.monotonic()`` value) it runs no more candidates and returns the best so far."""
    minimiser = Minimiser(trace, None, variant, target, device, progress=progress, executor=executor, deadline=deadline)
    first = minimiser.executor(trace)
    if first is None:
        raise ValueError("the trace passes; nothing to minimise")
    minimiser.signature = first.signature
    return minimiser


def minimise(trace: Trace, variant=None, target=None, device=None, progress=None) -> Trace:
    """The smallest trace found that fails like ``trace`` (which must fail)."""
    return minimiser_for(trace, variant, target, device, progress).run()
