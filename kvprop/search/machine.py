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
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar, TypedDict, cast

from hypothesis import currently_in_test_context, event, reject
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

from kvprop.allocator.specs import EngineConfig
from kvprop.capabilities import ANY_SHAPE, Shapes
from kvprop.errors import ConfigError, TargetCrash, Violation
from kvprop.search import alphabet as ops
from kvprop.search.harness import Harness
from kvprop.targets import shapes_of

if TYPE_CHECKING:
    from kvprop.search.journal import Journal
    from kvprop.search.trace import Trace


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


class Counters(TypedDict):
    """What a machine class has run: examples begun, rule steps, refused shapes by reason, and
    the built ones by pipeline depth."""

    examples: int
    steps: int
    refused: Counter[str]
    depths: Counter[int]


# A failing example: its configuration, its operations, what it raised, whether in the drain.
Found = tuple[EngineConfig, tuple[ops.Operation, ...], Violation | TargetCrash, bool]


def _example_starts() -> None:
    """Nothing: the fuzz worker puts its own hook on its machine class (``on_example``)."""


class KVCacheMachine(RuleBasedStateMachine):
    """Drives kvprop's engine over the allocator of ``target``/``variant``; checks every invariant after every rule.

    The class attributes are the run's: ``machine_for`` makes a class per allocator with its own
    records, which every example (an instance) adds to."""

    variant: ClassVar[str | None] = None
    target: ClassVar[str | None] = None
    device: ClassVar[str | None] = None
    checks: ClassVar[bool] = True
    events_seen: ClassVar[set[str]] = set()
    failures: ClassVar[list[Found]] = []
    counters: ClassVar[Counters] = {"examples": 0, "steps": 0, "refused": Counter(), "depths": Counter()}
    # in a supervised worker: each example is written as it runs (kvprop.search.journal)
    journal: ClassVar[Journal | None] = None
    shapes: ClassVar[Shapes] = ANY_SHAPE  # the configurations the target declares it builds
    run_seed: ClassVar[int | None] = None  # the Hypothesis seed of the run, for the journal
    # called as each example starts (the fuzz worker reports progress and stops runs here)
    on_example: ClassVar[Callable[[], None]] = staticmethod(_example_starts)

    # each example's own, set in __init__
    harness: Harness | None  # built by configure
    steps: list[ops.Operation]
    failed: bool
    reported: set[str]  # the events this example has reported
    weights: tuple[int, ...]

    # No return annotation: Hypothesis seeds a derandomized run from the class's signature (this
    # method's), and an added ``-> None`` would move every CI run onto other examples.
    def __init__(self):
        super().__init__()
        self.harness = None
        self.steps = []
        self.failed = False
        self.reported = set()
        self.weights = ()

    @initialize(config=configs(), weights=swarm_weights())
    def configure(self, config, weights):
        type(self).on_example()
        self.weights = weights
        counters = type(self).counters
        counters["examples"] += 1
        journal = type(self).journal
        if journal is not None:  # in a supervised worker: no process of the last example lives on
            from kvprop.search.descendants import end_descendants
            from kvprop.search.trace import Trace

            end_descendants()
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
        counters["depths"][config.pipeline_depth] += 1

    def record_failure(self, error: Violation | TargetCrash, at_drain: bool) -> None:
        """Keep what failed as a plain trace: (config, operations, error, failed in the drain)."""
        harness = self.harness
        assert harness is not None  # only an operation or the drain fails, and configure built the harness first
        type(self).failures.append((harness.config, tuple(self.steps), error, at_drain))

    def run(self, op: ops.Operation) -> None:
        harness = self.harness
        assert harness is not None  # configure, the initialize rule, built it: Hypothesis runs it first
        self.steps.append(op)
        type(self).counters["steps"] += 1
        try:
            harness.apply(op)
        except (Violation, TargetCrash) as e:
            self.failed = True
            self.record_failure(e, at_drain=False)
            raise
        for name in harness.engine.events:
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


def seed_alone_decides() -> None:
    """Hypothesis (6.131 on) mixes the literal constants of every local module the process has
    imported into its draws, so the same seed explored differently in a process that happened to
    have imported more of kvprop (a CI worker that had run the command line's tests found a variant
    only past 1,000 examples; a fresh process, at 478). A search must depend on its seed and budget
    alone: the pool of local constants is pinned empty (Hypothesis's own global constants stay).
    Hypothesis is pinned (constraints.txt); the hook it replaces is its provider's module function."""
    from hypothesis.internal.conjecture import providers

    empty = providers.Constants(
        integers=providers.SortedSet(),
        floats=providers.SortedSet(key=providers.float_to_int),
        bytes=providers.SortedSet(),
        strings=providers.SortedSet(),
    )
    providers._get_local_constants = lambda: empty
    providers.CONSTANTS_CACHE.cache.clear()


def machine_for(
    variant: str | None = None, target: str | None = None, device: str | None = None, checks: bool = True
) -> type[KVCacheMachine]:
    """A machine class bound to one allocator, with its own event and failure records."""
    from kvprop.targets.variants import get_variant

    seed_alone_decides()

    get_variant(variant)
    name = f"KVCacheMachine_{(variant or target or 'correct').replace('-', '_').replace(':', '_').replace('.', '_')}"
    records: dict[str, object] = {
        "variant": variant,
        "target": target,
        "device": device,
        "checks": checks,
        "events_seen": set(),
        "failures": [],
        "counters": {"examples": 0, "steps": 0, "refused": Counter(), "depths": Counter()},
        "shapes": shapes_of(target),
    }
    # ``type`` makes a subclass of KVCacheMachine, which the type checker reads as a plain ``type``
    return cast(type[KVCacheMachine], type(name, (KVCacheMachine,), records))


def failure_trace(machine: type[KVCacheMachine]) -> Trace:
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
