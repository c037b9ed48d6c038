"""What a find on the ``vllm-scheduler`` target asks of vLLM's ``Scheduler``, recorded while it is replayed.

On this target vLLM schedules; kvprop adds requests, plays the model runner and the offloading
connector's worker, and ends requests. A reproducer (``kvprop report``) plays the same parts
with vLLM alone, so what it needs is what kvprop decided, not what vLLM did: the calls that
built the scheduler (``Recipe``), each request as it arrived, each step, each load the worker
completed or failed outside a step, each request ended, each prefix-cache reset — and the
model's outputs, which kvprop's model derives from the prefix alone: every token a request
decodes and the drafts an n-gram proposer offers at each length (``Model``), so the script's
model runner answers any schedule the release makes, not only the recorded one. The drain is
one act: the script drains as kvprop's drain does (``kvprop.check.checker.drain``).
"""

from __future__ import annotations

import attrs

from kvprop.errors import ConfigError
from kvprop.repro.failing_step import FailingStep
from kvprop.search.execute import run
from kvprop.search.harness import Harness
from kvprop.search.trace import Failure, Trace
from kvprop.sim.request import Request as SimRequest
from kvprop.targets.vllm.recipe import Recipe
from kvprop.targets.vllm.scheduler import SchedulerEngine


@attrs.frozen
class Act:
    """One thing kvprop did to the scheduler: ``add`` (request id, prompt, max_tokens, extra_args),
    ``step``, ``finish_load`` (request id, ok), ``finish`` (request id, vLLM status name),
    ``reset``, ``drain``."""

    op: int  # the kvprop operation's index; len(trace.steps) is the drain
    name: str
    args: tuple = ()


@attrs.frozen
class Model:
    """A request as kvprop's model runs it: its prompt and every token decoded after it up to
    ``max_tokens``, and the drafts proposed when the request holds ``n`` tokens."""

    tokens: tuple
    drafts: tuple  # (n, drafts) pairs


@attrs.frozen
class SchedulerRecording:
    acts: tuple
    models: tuple  # (request id, Model) pairs, in arrival order
    failure: Failure | None
    recipe: Recipe
    engine: SchedulerEngine
    around: FailingStep  # the pool before the failing operation and at the find


def model_of(request: SimRequest, speculative_tokens: int) -> Model:
    """What kvprop's model decodes for ``request`` from its prompt, and the drafts it proposes
    after each output (``SchedulerEngine._take_outputs``: ``min(K, room)`` drafts, room being the
    outputs left after the next one)."""
    prompt = request.tokens[: request.num_prompt_tokens]
    r = SimRequest(request.request_id, prompt, request.max_new_tokens, request.block_size, request.vocab)
    drafts = []
    for _ in range(request.max_new_tokens):
        r.append_token(r.next_token())
        k = min(speculative_tokens, r.max_new_tokens - r.num_output_tokens - 1)
        if k > 0:
            r.propose_drafts(k)
            drafts.append((r.num_tokens, tuple(r.spec_token_ids)))
            r.drop_drafts()
    return Model(tuple(r.tokens), tuple(drafts))


class SchedulerRecorder:
    """Wraps one ``SchedulerEngine``'s operations; calls made inside a step (a synchronous load's
    completion) or by the drain are the script's own to make."""

    def __init__(self, engine: SchedulerEngine, operations: int):
        self.engine = engine
        self.acts: list[Act] = []
        self.models: list[tuple[str, Model]] = []
        self.op = 0
        self.operations = operations
        self.inside = False
        for name in ("add_request", "step", "finish_load", "abort", "finish", "reset_prefix_cache"):
            setattr(engine, name, self._wrapped(name, getattr(engine, name)))

    def _wrapped(self, name: str, method):
        def call(*args, **kwargs):
            args = (*args, *kwargs.values())  # finish_load(request_id, ok=...) as the drain calls it
            if self.inside or self.op >= self.operations:
                return method(*args)
            self.inside = True
            try:
                result = method(*args)
                self._note(name, args, result)
                return result
            except Exception:
                self._note(name, args, None)
                raise
            finally:
                self.inside = False

        return call

    def _note(self, name: str, args: tuple, result) -> None:
        engine = self.engine
        if name == "add_request":
            if result is None:
                return
            rid = result.request_id
            extra = engine.allocator.sampling_params(result.max_new_tokens).extra_args
            prompt = tuple(result.tokens[: result.num_prompt_tokens])
            self.acts.append(Act(self.op, "add", (rid, prompt, result.max_new_tokens, extra)))
            self.models.append((rid, model_of(result, engine.config.speculative_tokens)))
        elif name == "step":
            self.acts.append(Act(self.op, "step"))
        elif name == "finish_load":
            rid, ok = args
            if ok or engine.fails_loads:  # a failure the release's worker cannot report is not made
                self.acts.append(Act(self.op, "finish_load", (rid, bool(ok))))
        elif name in ("abort", "finish"):
            status = "FINISHED_ABORTED" if name == "abort" else "FINISHED_STOPPED"
            self.acts.append(Act(self.op, "finish", (args[0], status)))
        else:
            self.acts.append(Act(self.op, "reset"))


def record_scheduler(trace: Trace, journal=None) -> SchedulerRecording:
    """Replay ``trace`` on the ``vllm-scheduler`` target, recording what kvprop asked of vLLM;
    run in a supervised worker, whose ``journal`` names each operation before it runs."""
    if journal is not None:
        journal.begin(trace)
    harness = Harness(trace.config, target="vllm-scheduler", journal=journal)
    engine = harness.engine
    if not isinstance(engine, SchedulerEngine):
        raise ConfigError(f"kvprop report: the vllm-scheduler target built a {type(engine).__name__}")
    recorder = SchedulerRecorder(engine, len(trace.steps))

    around = FailingStep(harness)

    def on_step(index, op, outcome) -> None:
        recorder.op = index + 1
        around.passed(index, op)

    failure = run(harness, trace.steps, trace.drain, on_step)
    acts = list(recorder.acts)
    if trace.drain and (failure is None or recorder.op >= len(trace.steps)):
        acts.append(Act(len(trace.steps), "drain"))
    return SchedulerRecording(tuple(acts), tuple(recorder.models), failure, engine.recipe, engine, around)
