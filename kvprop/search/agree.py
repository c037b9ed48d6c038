"""Step-for-step agreement: kvprop's own allocator and another target, driven alike.

kvprop's allocator is the reference model of vLLM's. The invariants judge each target on its
own; agreement checks the model itself: after every operation both sides must hold the same
block ids in every table, the same cache key on every block, the same number of free
blocks, the same count of evictions and the same KV cache events, in the same order. A disagreement is a modelling
difference (a vLLM rule kvprop has not taken up, or one it models wrong), not by itself a
bug of either side, so it is reported with both states.

Malformed calls (``Misuse``) are left out: each target has its own caller contract. kvprop
models the current vLLM (0.30.0 on). A release before it has no shared-prefix junction, so
retention thins it differently and a state group's chunks stop elsewhere: compare such a
release with ``no_junction``, where walks run with retention off and no state group.

A target may declare another reference (``Target.agrees_with``): SGLang's Rust tree core is
walked beside its Python core, on operations drawn with SGLang's shapes, and compared in SGLang's
terms (``SglangEngine.differential_state``); there a disagreement is one core deciding otherwise
than the other, which SGLang means never to happen.
"""

from __future__ import annotations

from typing import Any

import attrs

from kvprop.allocator.specs import FullAttention, Mamba, without_checkpoints
from kvprop.check.invariants import extra_keys
from kvprop.errors import ConfigError, TargetCrash
from kvprop.search.harness import Harness
from kvprop.search.walk import plan
from kvprop.targets import shapes_of


@attrs.frozen
class Disagreement:
    seed: int
    step: int  # index into the walk's operations, Misuse left out
    operation: str
    what: str  # which part differs: "outcome", "tables", "cache keys", "free blocks", "evictions" or "events"
    reference: str
    target: str


@attrs.frozen
class Agreement:
    walks: int = 0
    steps: int = 0
    refused: int = 0  # walks whose configuration the target cannot build
    first_refusal: str | None = None  # the target's reason, the first time it refused
    disagreement: Disagreement | None = None


def snapshot(harness: Harness, capabilities) -> dict:
    """What is compared after each operation: the parts ``capabilities`` (the target's
    declaration) lets both sides report; for two SGLang engines, SGLang's own state
    (``SglangEngine.differential_state``)."""
    engine = harness.engine
    if engine.terms == "sglang":
        judged_in_its_terms: Any = engine  # an SglangEngine (kvprop.targets.sglang.engine)
        return judged_in_its_terms.differential_state()
    parts = {
        "tables": {rid: engine.target_calls.get_block_ids(rid) for rid in engine.requests},
        "cache keys": engine.view.cache_keys(),
        "free blocks": engine.view.num_free_blocks,
        "events": engine.take_kv_events(),
    }
    if capabilities.keys_inside_blocks:
        parts["further keys"] = extra_keys(engine.view)
    if capabilities.evictions:
        parts["evictions"] = engine.view.num_evictions  # vLLM reports none: its target counts them
    return parts


def _first_difference(a: dict, b: dict) -> tuple[str, str, str] | None:
    for part in a:
        if a[part] != b[part]:
            if part == "cache keys":
                blocks = [i for i, (x, y) in enumerate(zip(a[part], b[part])) if x != y]
                return part, *(f"block {i}: {side[part][i]}" for side in (a, b) for i in blocks[:1])
            if part == "tables":
                rid = next(r for r in a[part] if a[part][r] != b[part].get(r))
                return part, f"{rid}: {a[part][rid]}", f"{rid}: {b[part].get(rid)}"
            return part, str(a[part]), str(b[part])
    return None


def agree_walk(
    seed: int,
    target: str,
    max_ops: int = 200,
    no_junction: bool = False,
    block_hits: bool = False,
    reference_variant: str | None = None,
    no_checkpoints: bool = False,
    incremental_report: bool = False,
    journal=None,
):
    """(steps run, the first disagreement) of walk ``seed`` between kvprop and ``target``
    (checks off on both sides: the invariants are not what is compared here). ``block_hits``:
    hits end on block boundaries (the hash unit dropped), for a release whose hits inside a
    block follow other rules than 0.33.0's, which kvprop models (0.30.0 keys the prompt's tail
    at the last unit boundary at or below its length, 0.33.0 below its last token).
    ``reference_variant``: kvprop's allocator runs as that bug variant, the rule of a release
    whose bug kvprop fixes, so that the rest is still compared. ``no_checkpoints``: state
    groups save no prefill checkpoints, for a release whose checkpoints follow other rules
    than 0.33.0's (0.30.0) or that has none. ``incremental_report``: no request asks for the
    full KV cache report, which releases before 0.30.0 do not have."""
    reference_target = reference_of(target)
    trace = plan(seed, max_ops, reference_target)
    if trace.config.pipeline_depth > 1 and not shapes_of(target).builds("pipeline_depth"):
        # kvprop's scheduler with batches in flight needs the in-flight counts the target's own
        # scheduler keeps (vLLM's settled basis): a target that declares no such shape is not compared
        raise ConfigError(
            f"target {target!r} builds no batches in flight (its shapes leave out pipeline_depth); "
            f"walk {seed} runs {trace.config.pipeline_depth}"
        )
    if no_junction:
        trace = attrs.evolve(trace, config=_without_junction(trace.config))
    config = without_checkpoints(trace.config) if no_checkpoints else trace.config
    hash_unit = None if block_hits else config.allocator.hash_unit
    report = "incremental" if incremental_report else config.allocator.kv_cache_report_mode
    config = attrs.evolve(
        config, allocator=attrs.evolve(config.allocator, hash_unit=hash_unit, kv_cache_report_mode=report)
    )
    trace = attrs.evolve(trace, config=config)
    reference = Harness(trace.config, variant=reference_variant, target=reference_target, checks=False)
    if journal is not None:  # in a supervised worker: the target's side of the walk, as it runs
        journal.begin(attrs.evolve(trace, steps=(), variant=None, target=target), seed)
    other = Harness(trace.config, target=target, checks=False, journal=journal)
    steps = [op for op in trace.steps if type(op).__name__ != "Misuse"]
    for i, op in enumerate(steps):
        said = _outcome(reference, op), _outcome(other, op)
        if said[0] != said[1]:
            return i + 1, Disagreement(seed, i, repr(op), "outcome", *said)
        if said[0].startswith(CRASHED):
            return i + 1, None  # both crashed alike (a release's known crash, run as its variant)
        declared = other.engine.capabilities
        diff = _first_difference(snapshot(reference, declared), snapshot(other, declared))
        if diff is not None:
            return i + 1, Disagreement(seed, i, repr(op), *diff)
    return len(steps), None


CRASHED = "crashed: "


def reference_of(target: str) -> str | None:
    """The target ``target`` is compared with: kvprop's allocator (None), or the one its
    declaration names; a ConfigError for a target no reference states the terms of."""
    from kvprop.targets.protocol import resolve

    declared = resolve(target).agrees_with
    if declared == "":
        raise ConfigError(
            f"target {target!r} has no reference to agree with: its state is not kvprop's blocks "
            f"(for SGLang, compare its tree cores: --target sglang-rust)"
        )
    return declared


def _outcome(harness: Harness, op) -> str:
    """What ``op`` did, or how the allocator crashed (the exception's type and the call)."""
    try:
        return harness.apply(op)
    except TargetCrash as e:
        return f"{CRASHED}{e.exception_type} in {e.call}"


def _without_junction(config):
    """``config`` where the junction changes nothing: dense retention, and a state group
    replaced by full attention (so hits end on block boundaries)."""
    groups = tuple(FullAttention(s.block_size) if isinstance(s, Mamba) else s for s in config.allocator.groups)
    allocator = attrs.evolve(config.allocator, groups=groups, retention_interval=None, hash_unit=None)
    return attrs.evolve(config, allocator=allocator)


def agree(
    target: str,
    seeds,
    max_ops: int = 200,
    no_junction: bool = False,
    progress=None,
    block_hits: bool = False,
    reference_variant: str | None = None,
    no_checkpoints: bool = False,
    incremental_report: bool = False,
    journal=None,
) -> Agreement:
    """Walk ``seeds`` on both sides until the first disagreement. A configuration the target
    refuses (ConfigError from its factory) is counted, not compared."""
    result = Agreement()
    for seed in seeds:
        try:
            steps, disagreement = agree_walk(
                seed,
                target,
                max_ops,
                no_junction=no_junction,
                block_hits=block_hits,
                reference_variant=reference_variant,
                no_checkpoints=no_checkpoints,
                incremental_report=incremental_report,
                journal=journal,
            )
        except ConfigError as e:
            result = attrs.evolve(result, refused=result.refused + 1, first_refusal=result.first_refusal or str(e))
            continue
        result = attrs.evolve(result, walks=result.walks + 1, steps=result.steps + steps, disagreement=disagreement)
        if progress is not None:
            progress(result)
        if disagreement is not None:
            break
    return result
