"""The Hypothesis state machine: thin rules over the shared operation alphabet.

Requests live in the engine and are picked by drawn index, not held in consumed bundles,
which shrinks far better. The configuration is drawn per test case in ``configure`` (the
swarm: Hypothesis varies which rules run, the sampler varies the allocator's shape).
"""

from __future__ import annotations

from hypothesis import event, reject
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from kvprop.errors import ConfigError
from kvprop.search import alphabet as ops
from kvprop.search.harness import Harness


class HypothesisChooser:
    def __init__(self, draw):
        self.draw = draw

    def integer(self, lo: int, hi: int) -> int:
        return self.draw(st.integers(lo, hi))

    def pick(self, options):
        return self.draw(st.sampled_from(options))


@st.composite
def configs(draw):
    return ops.sample_config(HypothesisChooser(draw))


def operation(op_class) -> st.SearchStrategy:
    return st.builds(op_class, **{name: st.integers(lo, hi) for name, (lo, hi) in op_class.ARGS.items()})


class KVCacheMachine(RuleBasedStateMachine):
    """Drives kvprop's engine over the allocator of ``target``/``variant``; checks every invariant after every rule."""

    variant: str | None = None
    target: str | None = None
    device: str | None = None
    checks: bool = True
    events_seen: set = set()
    failures: list = []
    counters: dict = {"examples": 0, "steps": 0}

    def __init__(self):
        super().__init__()
        self.harness: Harness | None = None
        self.steps: list = []
        self.failed = False
        self.reported: set = set()

    @initialize(config=configs())
    def configure(self, config):
        type(self).counters["examples"] += 1
        try:
            self.harness = Harness(
                config, variant=self.variant, target=self.target, device=self.device, checks=self.checks
            )
        except ConfigError:
            if self.target in (None, "kvprop"):
                raise
            reject()  # a shape this target cannot build: draw another

    def record_failure(self, error: BaseException, at_drain: bool) -> None:
        """Keep what failed as a plain trace: (config, operations, error, failed in the drain)."""
        type(self).failures.append((self.harness.config, tuple(self.steps), error, at_drain))

    def run(self, op) -> None:
        self.steps.append(op)
        type(self).counters["steps"] += 1
        try:
            self.harness.apply(op)
        except BaseException as e:
            self.failed = True
            self.record_failure(e, at_drain=False)
            raise
        for name in self.harness.engine.events:
            if name not in self.reported:
                self.reported.add(name)
                type(self).events_seen.add(name)
                event(name)

    @rule(op=operation(ops.AddRequest))
    def add_request(self, op):
        self.run(op)

    @rule(op=operation(ops.AddLargeRequest))
    def add_large_request(self, op):
        self.run(op)

    @rule(op=operation(ops.Step))
    def step(self, op):
        self.run(op)

    # Preconditions only skip rules that would be no-ops, so every drawn step does something.
    @precondition(lambda self: self.harness.engine.connector is not None)
    @rule(op=operation(ops.PublishPrefix))
    def publish_prefix(self, op):
        self.run(op)

    @precondition(lambda self: bool(self.harness.engine.loading))
    @rule(op=operation(ops.FinishLoad))
    def finish_load(self, op):
        self.run(op)

    @precondition(lambda self: bool(self.harness.engine.running))
    @rule(op=operation(ops.Preempt))
    def preempt(self, op):
        self.run(op)

    @precondition(lambda self: bool(self.harness.engine.requests))
    @rule(op=operation(ops.Abort))
    def abort(self, op):
        self.run(op)

    @precondition(lambda self: bool(self.harness.engine.running))
    @rule(op=operation(ops.Finish))
    def finish(self, op):
        self.run(op)

    @rule(op=operation(ops.ResetPrefixCache))
    def reset_prefix_cache(self, op):
        self.run(op)

    def teardown(self):
        if self.harness is None or self.failed:
            return
        try:
            self.harness.drain()
        except BaseException as e:
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
            "counters": {"examples": 0, "steps": 0},
        },
    )


def failure_trace(machine: type):
    """The machine's last failing example as a kvprop trace (replayable, minimisable)."""
    from kvprop.search.trace import Failure, Trace, failure_kind

    config, steps, error, at_drain = machine.failures[-1]
    return Trace(
        config=config,
        steps=steps,
        variant=machine.variant,
        target=machine.target,
        engine="hypothesis",
        failure=Failure(len(steps) - (not at_drain), failure_kind(error), str(error)),
    )


def trace_length(trace) -> int:
    """Rule steps in a trace, counting the final drain as one when that is where it fails."""
    return len(trace.steps) + (trace.failure is not None and trace.failure.step >= len(trace.steps))
