"""The Hypothesis state machine: one rule over the shared operation alphabet.

Requests live in the engine and are picked by drawn index, not held in consumed bundles,
which shrinks far better. Each test case draws, in ``configure``, the allocator's shape and
the swarm weights with the walker's own samplers (``sample_config``, ``sample_weights``), and
then one rule, ``operation``, draws every step's operation by those weights from the
operations that would do something now. Hypothesis would otherwise pick its rules uniformly
and its bounded integers with a strong lean to the low end: a third of the shapes without
prefix caching, half with one group or a pool under 8 blocks; with its own rule choice it
needed several times the walker's steps to find the motivating bug.
"""

from __future__ import annotations

import functools
from collections import Counter

from hypothesis import currently_in_test_context, event, reject
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

from kvprop.capabilities import ANY_SHAPE
from kvprop.errors import ConfigError, TargetCrash, Violation
from kvprop.search import alphabet as ops
from kvprop.search.harness import Harness
from kvprop.targets import shapes_of


@functools.cache
def evenly(lo: int, hi: int) -> st.SearchStrategy:
    """An integer spread evenly over ``lo..hi``, built once per range (building a strategy at
    every step cost more than the step)."""
    return st.sampled_from(range(lo, hi + 1))


class HypothesisChooser:
    """Choices from Hypothesis, spread evenly over the range as the walker's are (see above)."""

    def __init__(self, draw):
        self.draw = draw

    def integer(self, lo: int, hi: int) -> int:
        return self.draw(evenly(lo, hi))

    def pick(self, options):
        return self.draw(st.sampled_from(options))

    def side(self) -> HypothesisChooser:
        """The same stream: Hypothesis shrinks every draw, wherever it comes from."""
        return self


RUNNER = st.runner()  # the machine itself


@st.composite
def configs(draw):
    """A configuration of the shapes the machine's target declares (the runner is the machine
    itself: drawing it takes nothing from the example's choices)."""
    return ops.sample_config(HypothesisChooser(draw), type(draw(RUNNER)).shapes)


@st.composite
def swarm_weights(draw):
    return ops.sample_weights(HypothesisChooser(draw))


# Each operation's arguments as (name, strategy) pairs, built once; drawing them one by one
# costs less per step than ``st.builds``.
ARGUMENTS = {
    op_class: tuple((name, st.integers(lo, hi)) for name, (lo, hi) in op_class.ARGS.items())
    for op_class in ops.OPERATIONS
}


@st.composite
def next_operations(draw):
    """The next step: an operation drawn by this example's weights among those ``ready`` now
    (an operation without ``ready`` always is), then its arguments."""
    choices = draw(RUNNER).choices()
    op_class = choices[draw(evenly(0, len(choices) - 1))]
    return op_class(**{name: draw(strategy) for name, strategy in ARGUMENTS[op_class]})


class KVCacheMachine(RuleBasedStateMachine):
    """Drives kvprop's engine over the allocator of ``target``/``variant``; checks every invariant after every rule."""

    variant: str | None = None
    target: str | None = None
    device: str | None = None
    checks: bool = True
    events_seen: set = set()
    failures: list = []
    counters: dict = {"examples": 0, "steps": 0, "refused": Counter()}
    journal = None  # in a supervised worker: each example is written as it runs (kvprop.search.journal)
    shapes = ANY_SHAPE  # the configurations the target declares it builds
    run_seed: int | None = None  # the Hypothesis seed of the run, for the journal

    def __init__(self):
        super().__init__()
        self.harness: Harness | None = None
        self.steps: list = []
        self.failed = False
        self.reported: set = set()
        self.weights: tuple = ()

    @staticmethod
    def on_example() -> None:
        """Called as each example starts (the fuzz worker reports progress and stops runs here)."""

    @initialize(config=configs(), weights=swarm_weights())
    def configure(self, config, weights):
        type(self).on_example()
        self.weights = weights
        counters = type(self).counters
        counters["examples"] += 1
        journal = type(self).journal
        if journal is not None:
            from kvprop.search.trace import Trace

            header = Trace(config, (), self.variant, self.target, seed=type(self).run_seed, driver="hypothesis")
            journal.begin(header)
        try:
            self.harness = Harness(
                config,
                variant=self.variant,
                target=self.target,
                device=self.device,
                checks=self.checks,
                journal=journal,
            )
        except ConfigError as e:
            if self.target in (None, "kvprop"):
                raise
            counters["refused"][str(e)] += 1
            reject()  # a shape this target cannot build: draw another (the refusal is counted)

    def record_failure(self, error: BaseException, at_drain: bool) -> None:
        """Keep what failed as a plain trace: (config, operations, error, failed in the drain)."""
        type(self).failures.append((self.harness.config, tuple(self.steps), error, at_drain))

    def run(self, op) -> None:
        self.steps.append(op)
        type(self).counters["steps"] += 1
        try:
            self.harness.apply(op)
        except (Violation, TargetCrash) as e:
            self.failed = True
            self.record_failure(e, at_drain=False)
            raise
        for name in self.harness.engine.events:
            if name not in self.reported:
                self.reported.add(name)
                type(self).events_seen.add(name)
                if currently_in_test_context():  # a printed program replays outside Hypothesis
                    event(name)

    def choices(self) -> list:
        """The operations to draw from now, each repeated as often as its weight."""
        ready = ops.ready_operations(self.weights, self.harness)
        return [op_class for op_class, weight in ready for _ in range(weight)]

    @rule(op=next_operations())
    def operation(self, op):
        self.run(op)

    def teardown(self):
        if self.harness is None or self.failed:
            return
        try:
            self.harness.drain()
        except (Violation, TargetCrash) as e:
            self.record_failure(e, at_drain=True)
            raise


def machine_for(
    variant: str | None = None, target: str | None = None, device: str | None = None, checks: bool = True
) -> type:
    """A machine class bound to one allocator, with its own event and failure records."""
    from kvprop.targets.variants import get_variant

    get_variant(variant)
    name = f"KVCacheMachine_{(variant or target or 'correct').replace('-', '_').replace(':', '_').replace('.', '_')}"
    return type(
        name,
        (KVCacheMachine,),
        {
            "variant": variant,
            "target": target,
            "device": device,
            "checks": checks,
            "events_seen": set(),
            "failures": [],
            "counters": {"examples": 0, "steps": 0, "refused": Counter()},
            "shapes": shapes_of(target),
        },
    )


def failure_trace(machine: type):
    """The machine's last failing example as a kvprop trace (replayable, minimisable)."""
    from kvprop.search.trace import Trace, failure_from

    config, steps, error, at_drain = machine.failures[-1]
    return Trace(
        config=config,
        steps=steps,
        variant=machine.variant,
        target=machine.target,
        driver="hypothesis",
        failure=failure_from(error, len(steps) - (not at_drain)),
    )


def trace_length(trace) -> int:
    """Rule steps in a trace, counting the final drain as one when that is where it fails."""
    return len(trace.steps) + (trace.failure is not None and trace.failure.step >= len(trace.steps))
