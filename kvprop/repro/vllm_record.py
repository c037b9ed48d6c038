"""The direct vLLM calls a find on the ``vllm`` target makes, recorded while it is replayed.

A reproducer for vLLM's maintainers (``kvprop report``) must perform what kvprop's engine did
to vLLM's ``KVCacheManager`` and nothing else. The recorder replays the trace on the target
(in a supervised worker: ``kvprop.front.report``) and notes, as they happen, every call the
target's allocator makes into the manager (with its arguments) and every change it makes to
the vLLM ``Request`` objects it
keeps (built, output tokens appended, ``num_computed_tokens`` and ``shared_prefix_boundary``
set), each under the index of the kvprop operation that made it. Nothing vLLM does is
changed: the recorder wraps the adapter's own entry points and calls through.
"""

from __future__ import annotations

import attrs

from kvprop.errors import ConfigError
from kvprop.repro.failing_step import FailingStep
from kvprop.search.execute import run
from kvprop.search.harness import Harness
from kvprop.search.trace import Failure, Trace
from kvprop.targets.vllm.manager import VllmAllocator

# What the adapter calls on vLLM's manager (kvprop.targets.vllm.manager.VllmAllocator).
MANAGER_CALLS = (
    "get_computed_blocks",
    "allocate_slots",
    "cache_blocks",
    "free",
    "reset_prefix_cache",
    "new_step_starts",
    "take_events",
    "take_kv_cache_block_copies",
)
REQUEST_CHANGES = ("Request", "append_output_token_ids", "num_computed_tokens", "shared_prefix_boundary")


@attrs.frozen
class Req:
    """A vLLM ``Request`` as an argument: the script's ``requests[request_id]``."""

    request_id: str


@attrs.frozen
class Computed:
    """The blocks the ``number``-th ``get_computed_blocks`` call returned, passed on as vLLM
    requires (``allocate_slots`` tells "no hit" apart by identity)."""

    number: int


@attrs.frozen
class Call:
    """One call into vLLM: a manager method (``MANAGER_CALLS``) or a request change
    (``REQUEST_CHANGES``: the request's id first, then the value)."""

    op: int  # the kvprop operation's index; len(trace.steps) is the final drain
    name: str
    args: tuple
    kwargs: tuple = ()  # (name, value) pairs, in the order passed
    number: int | None = None  # get_computed_blocks: which result this is
    outcome: str | None = None  # what vLLM answered, in words (for the report's steps)


@attrs.frozen
class Recording:
    calls: tuple
    failure: Failure | None
    allocator: VllmAllocator  # its manager as the replay left it
    around: FailingStep  # the pool before the failing operation and at the find


class Recorder:
    """Wraps one ``VllmAllocator``'s calls into its manager and its request updates."""

    def __init__(self, allocator: VllmAllocator):
        self.allocator = allocator
        self.calls: list[Call] = []
        self.op = 0
        self.results: dict[int, tuple[int, object]] = {}  # id(KVCacheBlocks) -> (number, the object)
        manager = allocator.manager
        for name in MANAGER_CALLS:
            method = getattr(manager, name, None)
            if method is not None:
                setattr(manager, name, self._wrapped(name, method))
        allocator.vllm_request = self._request(allocator.vllm_request)  # type: ignore[method-assign]

    def value(self, x):
        if isinstance(x, self.allocator.v.Request):
            return Req(x.request_id)
        if id(x) in self.results and self.results[id(x)][1] is x:
            return Computed(self.results[id(x)][0])
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        raise ConfigError(f"kvprop report: a call into vLLM passed {type(x).__name__}, which a script cannot state")

    def _wrapped(self, name: str, method):
        def call(*args, **kwargs):
            number = None
            if name == "get_computed_blocks":
                number = sum(1 for c in self.calls if c.name == name)
            values = tuple(self.value(a) for a in args)
            at = len(self.calls)
            self.calls.append(Call(self.op, name, values, tuple((k, self.value(v)) for k, v in kwargs.items()), number))
            result = method(*args, **kwargs)
            if number is not None:
                self.results[id(result[0])] = (number, result[0])
                self.calls[at] = attrs.evolve(self.calls[at], outcome=f"a hit of {result[1]} tokens")
            elif name == "allocate_slots":
                self.calls[at] = attrs.evolve(self.calls[at], outcome="refused" if result is None else "granted")
            return result

        return call

    def _request(self, update):
        allocator = self.allocator

        def vllm_request(request):
            rid = request.request_id
            old = allocator.requests.get(rid)
            before = None if old is None else (old.num_tokens, old.num_computed_tokens, _boundary(old))
            vreq = update(request)
            if before is None:
                params = vreq.sampling_params
                extra = getattr(params, "extra_args", None)
                prompt = list(vreq.prompt_token_ids)
                self.calls.append(Call(self.op, "Request", (rid, prompt, params.max_tokens, extra)))
                before = (len(prompt), None, None)
            if vreq.num_tokens > before[0]:
                grown = list(vreq.all_token_ids[before[0] :])
                self.calls.append(Call(self.op, "append_output_token_ids", (rid, grown)))
            if vreq.num_computed_tokens != before[1]:
                self.calls.append(Call(self.op, "num_computed_tokens", (rid, vreq.num_computed_tokens)))
            if hasattr(vreq, "shared_prefix_boundary") and _boundary(vreq) != before[2]:
                self.calls.append(Call(self.op, "shared_prefix_boundary", (rid, _boundary(vreq))))
            return vreq

        return vllm_request


def _boundary(vreq):
    return getattr(vreq, "shared_prefix_boundary", None)


def record(trace: Trace, journal=None) -> Recording:
    """Replay ``trace`` on the ``vllm`` target, recording its calls into vLLM; run in a
    supervised worker, whose ``journal`` names each operation before it runs."""
    if journal is not None:
        journal.begin(trace)
    harness = Harness(trace.config, target="vllm", journal=journal)
    allocator = harness.engine.allocator
    if not isinstance(allocator, VllmAllocator):
        raise ConfigError(f"kvprop report: the vllm target built a {type(allocator).__name__}, not vLLM's manager")
    recorder = Recorder(allocator)

    around = FailingStep(harness)

    def on_step(index, op, outcome) -> None:
        recorder.op = index + 1
        around.passed(index, op)

    failure = run(harness, trace.steps, trace.drain, on_step)
    return Recording(tuple(recorder.calls), failure, allocator, around)
