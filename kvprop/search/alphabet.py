"""The operation alphabet and the configuration sampler, shared by every driver.

The state machine (CI, generation heuristics) and the seeded walker (long fuzzing) both draw a
configuration with ``sample_config`` and apply these operations to a ``Harness``; a trace
is a configuration plus a list of operations. This module imports neither torch nor the
engine, so reading a trace file needs only it and the specs. Arguments are small integers — indices and
seeds, never big data — so that Hypothesis and kvprop's minimiser can reduce them toward zero.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeAlias

import attrs

from kvprop.allocator.specs import (
    OPTIONS,
    PAGE_LAYOUTS,
    THINNED_BY_RETENTION,
    AllocatorConfig,
    ChunkedLocal,
    EngineConfig,
    FullAttention,
    GroupSpec,
    Mamba,
    SlidingWindow,
    eagle_problem,
    page_layout_problem,
)
from kvprop.capabilities import ANY_SHAPE, Shapes
from kvprop.search.late_draws import late_draws
from kvprop.search.tokens import fresh_tokens

if TYPE_CHECKING:
    from kvprop.search.harness import Harness

# ---- configuration sampler --------------------------------------------------------------


class RandomChooser:
    """Choices from a ``random.Random`` (the walker)."""

    def __init__(self, rng):
        self.rng = rng

    def integer(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def pick(self, options):
        return options[self.rng.randrange(len(options))]

    def side(self) -> RandomChooser:
        """Choices that leave this stream where it is: knobs added to the sampler draw from it,
        so a walk seed keeps the configuration and operations it had (seeds quoted in notes,
        tests and bug reports stay valid)."""
        words = self.rng.getstate()[1]  # the state's integers: they hash alike in every process
        return RandomChooser(random.Random(hash(words)))


BLOCK_SIZES = (1, 2, 4, 3, 8, 16)
CONNECTORS = ("off", "sync", "async")


def sample_config(choose, shapes: Shapes = ANY_SHAPE) -> EngineConfig:
    """A small allocator shape: small pools and few tokens so prefixes collide and the pool
    cycles; only ``shapes``, what the target declares it builds. With every shape allowed, the
    draws are those of a target that declares none."""
    bs = choose.pick(BLOCK_SIZES)
    groups: list[GroupSpec] = []
    kinds = tuple(k for k in ("full", "sliding_window", "chunked_local") if k in shapes.group_kinds) or ("full",)
    for _ in range(choose.integer(1, shapes.max_groups)):
        kind = choose.pick(kinds)
        if kind == "full":
            groups.append(FullAttention(bs))
        elif kind == "sliding_window":
            groups.append(SlidingWindow(bs, choose.integer(1, 4 * bs)))
        else:
            groups.append(ChunkedLocal(bs, bs * choose.integer(1, 4)))
    num_blocks = choose.integer(max(4, 1 + 3 * len(groups)), choose.pick((16, 32, 64)))
    enable_caching = choose.integer(0, 7) > 0 or not shapes.without_caching
    token_budget, lookahead, connector = choose.integer(1, 64), choose.integer(0, 2), choose.pick(CONNECTORS)
    lookahead = lookahead if shapes.lookahead else 0
    connector = connector if shapes.connector else "off"
    if connector != "off" and not shapes.local_with_connector:  # the same draws, full attention instead
        groups = [FullAttention(bs) if isinstance(g, ChunkedLocal) else g for g in groups]
    # A state-space group in half the shapes without a connector, and in a quarter of those with
    # an asynchronous one and prefix caching (the only way vLLM's offloading connector takes a
    # state group), so the connector's attention-only shapes keep most of their draws.
    with_connector = connector == "async" and enable_caching
    state_group = (connector == "off" or with_connector) and choose.integer(0, 3 if with_connector else 1) == 0
    state_group = state_group and "mamba" in shapes.group_kinds and (connector == "off" or shapes.state_with_connector)
    # Drafts in half the shapes, 1 to 4 of them as MTP and EAGLE propose; none with a state
    # group in mode "none", whose speculative columns are not modelled, and fewer than a block.
    speculative = choose.pick((0, 0, 0, 1, 2, 4))
    speculative = speculative if shapes.drafts else 0
    if shapes.drafts_within_budget:
        token_budget = max(token_budget, 1 + speculative)
    if state_group:  # vLLM sizes a state group's scratch columns by the drafts
        speculative = min(speculative, bs - 1) if enable_caching else 0
        state = Mamba(bs, "align" if enable_caching else "none", speculative)
        groups[-1] = state
    hash_unit, inside = None, shapes.hits_inside_blocks
    if state_group and enable_caching and connector == "off" and bs > 1 and choose.integer(0, 1) and inside:
        # Hits inside a block in half of the shapes that can have them: a hash unit below the
        # block, the other groups full attention (vLLM's partial_hash_hits_enabled).
        groups = [FullAttention(bs)] * max(1, len(groups) - 1) + [groups[-1]]
        hash_unit = choose.pick(tuple(u for u in range(1, bs) if bs % u == 0))
        num_blocks = max(num_blocks, 1 + 3 * len(groups))
    retention, events = _retention(choose, groups, bs), choose.integer(0, 1) == 1
    retention = retention if shapes.retention else None
    events = events and shapes.kv_events
    if state_group and enable_caching:
        # Prefill checkpoints in three of four state groups that can save them, as production
        # models have them: alignment 1 as mamba_mixer2 always declares, or a coarser kernel
        # grid as GDN and KDA layers do.
        checkpoint = choose.pick((None, 1, 1, 4))
        groups[-1] = attrs.evolve(state, checkpoint=checkpoint if shapes.checkpoints else None)
    # the full report (hits announced again) in half the shapes with events
    report = "full" if events and choose.integer(0, 1) and shapes.full_report else "incremental"
    # vLLM's default for a failed load ends its request, in half the shapes whose loads can fail;
    # the observers of vLLM's manager off or on one time in four (defaults: statistics on, metrics off)
    side = choose.side()
    policy = "fail" if connector == "async" and side.integer(0, 1) else "recompute"
    log_stats, metrics = side.integer(0, 3) > 0, side.integer(0, 3) == 0
    # the EAGLE drop in half the shapes with drafts that can have it (vLLM's use_eagle: EAGLE and
    # MTP drafters; its n-gram drafting has none)
    eagle = bool(speculative) and _eagle_shape(groups, retention) and side.integer(0, 1) == 1 and shapes.eagle
    config = EngineConfig(
        allocator=AllocatorConfig(
            tuple(groups),
            num_blocks,
            enable_caching,
            retention_interval=retention,
            enable_kv_cache_events=events,
            hash_unit=hash_unit,
            kv_cache_report_mode=report,
            eagle=eagle,
            log_stats=log_stats,
            kv_cache_metrics=metrics,
        ),
        token_budget=token_budget,
        lookahead=lookahead,
        connector=connector,
        vocab=4,
        speculative_tokens=speculative,
        load_failure_policy=policy,
    )
    for declared in OPTIONS:  # the options that declare their own draw, from the side stream
        if declared.option.draw is not None and shapes.builds(declared.name):
            config = declared.set(config, declared.option.draw(side, config))
    # a page layout other than plain in half the shapes that can have one the target builds
    # (drawn last, so that every value drawn before keeps its seed)
    layouts = tuple(
        layout
        for layout in PAGE_LAYOUTS
        if layout != "plain" and layout in shapes.page_layouts and page_layout_problem(layout, groups) is None
    )
    if layouts and side.integer(0, 1):
        config = attrs.evolve(config, allocator=attrs.evolve(config.allocator, page_layout=side.pick(layouts)))
    # A budget of at most four blocks in half the shapes: drawn in tokens alone (1 to 64), most
    # budgets of small blocks take a whole prompt in one chunk, and prefills in chunks of a few
    # blocks (a chunk ending blocks past the last one's end) come mostly from large blocks.
    if side.integer(0, 1):
        few_blocks = side.integer(1, 4 * bs)
        floor = 1 + speculative if shapes.drafts_within_budget else 1
        # never below max_num_seqs: vLLM's SchedulerConfig refuses such a budget at start-up
        config = attrs.evolve(config, token_budget=max(few_blocks, floor, config.max_num_seqs or 1))
    return late_draws(side, config, shapes)


def _eagle_shape(groups, retention) -> bool:
    """Whether the swarm draws the EAGLE drop for this shape: it is modelled for full attention
    and windows, one or two groups (``AllocatorConfig.eagle``); beside a window the swarm draws it
    with dense retention only, since drawing it with every interval too left the motivating bug's
    searches in CI short of their budgets (a rate that keeps both is still to be measured)."""
    beside_window = any(isinstance(spec, SlidingWindow) for spec in groups)
    return eagle_problem(groups) is None and (retention is None or not beside_window)


def _retention(choose, groups, bs: int) -> int | None:
    """vLLM's production value (0, since 0.30.0) two times in five, dense (None, the default
    before) and two periodic intervals otherwise; it only matters with a sliding window or a
    state-space group."""
    if not any(isinstance(spec, THINNED_BY_RETENTION) for spec in groups):
        return 0
    return choose.pick((0, 0, None, bs, 2 * bs))


# ---- operations -------------------------------------------------------------------------

ArgRanges: TypeAlias = dict[str, tuple[int, int]]  # an operation's argument -> its (lowest, highest) value


class Operation(Protocol):
    """One step of a trace. The drivers draw its class, then its arguments by keyword from the
    ranges in ``ARGS``; it applies itself to a harness and says what it did. ``ready`` and
    ``WEIGHTS``, where a class has them, are looked up by name."""

    ARGS: ClassVar[ArgRanges]

    def __init__(self, *args: Any, **kwargs: Any) -> None: ...

    def apply(self, h: Harness) -> str: ...


@attrs.frozen
class AddRequest:
    """A new request: an earlier prompt less its last ``cut`` tokens, then ``extra`` fresh ones."""

    parent: int
    cut: int
    extra: int
    seed: int
    max_new_tokens: int
    ARGS: ClassVar[ArgRanges] = {
        "parent": (0, 7),
        "cut": (0, 48),
        "extra": (1, 12),
        "seed": (0, 3),
        "max_new_tokens": (1, 6),
    }

    def apply(self, h: Harness) -> str:
        return h.add_request(h.derive_tokens(self.parent, self.cut, self.extra, self.seed), self.max_new_tokens)


@attrs.frozen
class AddLargeRequest:
    """Pool pressure: an earlier prompt extended to the largest request the blocks free now can hold
    (after what waiting requests need), so the pool is driven to exactly full and then cycles."""

    parent: int
    seed: int
    ARGS: ClassVar[ArgRanges] = {"parent": (0, 7), "seed": (0, 3)}

    def apply(self, h: Harness) -> str:
        cfg = h.engine.config
        waiting = sum(h.engine.max_blocks_needed(r.num_tokens) for r in h.engine.waiting)
        per_group = max(0, h.engine.view.num_free_blocks - waiting) // len(cfg.allocator.groups)
        total = per_group * cfg.allocator.block_size - cfg.lookahead
        if total < 2:
            h.prompts.append([])
            return "no request fits this pool"
        base = h.derive_tokens(self.parent, 0, 0, self.seed)[: total - 1]
        prompt = base + fresh_tokens(self.seed, total - 1 - len(base), cfg.vocab)
        return h.add_request(prompt[: total - 1], 1)


@attrs.frozen
class Step:
    """``times`` engine steps (schedule, preempt, admit, execute), every invariant checked after each."""

    times: int
    ARGS: ClassVar[ArgRanges] = {"times": (1, 8)}

    def apply(self, h: Harness) -> str:
        out = []
        for i in range(self.times):
            if i:
                h.checker.check_all(h.engine)
            report = h.engine.step()
            out.append(
                f"scheduled {report.scheduled} admitted {report.admitted} "
                f"preempted {report.preempted} finished {report.finished}"
            )
        return "; ".join(out)


@attrs.frozen
class PublishPrefix:
    """Disaggregated prefill: a remote prefill node computes a prompt (an earlier one, cut and
    extended), the connector can now supply its blocks, and the request arrives here to decode."""

    parent: int
    cut: int
    extra: int
    seed: int
    ARGS: ClassVar[ArgRanges] = {"parent": (0, 7), "cut": (0, 48), "extra": (0, 32), "seed": (0, 3)}

    @staticmethod
    def ready(h: Harness) -> bool:
        return h.engine.connector is not None

    def apply(self, h: Harness) -> str:
        tokens = h.derive_tokens(self.parent, self.cut, self.extra, self.seed)
        if h.engine.connector is None:
            h.prompts.append(tokens)
            return "no connector"
        published = h.engine.connector.publish_prefix(tokens)
        return f"published {published} blocks; " + h.add_request(tokens, 1)


@attrs.frozen
class FinishLoad:
    """An asynchronous external load completes (ok) or fails."""

    index: int
    ok: int
    ARGS: ClassVar[ArgRanges] = {"index": (0, 7), "ok": (0, 1)}

    @staticmethod
    def ready(h: Harness) -> bool:
        return bool(h.engine.loading)

    def apply(self, h: Harness) -> str:
        loading = sorted(h.engine.loading)
        if not loading:
            return "no load in flight"
        rid = loading[self.index % len(loading)]
        if not self.ok and not h.engine.fails_loads:
            return f"not made: this target cannot recover from a failed load of {rid} (docs/targets.md)"
        h.engine.finish_load(rid, bool(self.ok))
        return f"load of {rid} {'completed' if self.ok else 'failed'}"


@attrs.frozen
class FinishSave:
    """An asynchronous save to the external tier completes (ok) or fails. It runs as often as
    ``FinishLoad``: both are the connector's transfers finishing, and one weight for the two
    leaves every other draw of a walk seed where it was."""

    index: int
    ok: int
    ARGS: ClassVar[ArgRanges] = {"index": (0, 7), "ok": (0, 1)}

    @staticmethod
    def ready(h: Harness) -> bool:
        return h.engine.connector is not None and bool(h.engine.connector.saves)

    def apply(self, h: Harness) -> str:
        saves = sorted(h.engine.connector.saves) if h.engine.connector is not None else []
        if not saves:
            return "no save in flight"
        job_id = saves[self.index % len(saves)]
        h.engine.finish_save(job_id, bool(self.ok))
        return f"save {job_id} {'completed' if self.ok else 'failed'}"


@attrs.frozen
class Misuse:
    """A buggy caller: one malformed call (``Engine.misuse``: a negative or too-large external
    count, zero new tokens, a second free, a free of a waiting request, caching past the end,
    stale hits) that the target's caller contract says it refuses or tolerates."""

    call: int
    index: int
    ARGS: ClassVar[ArgRanges] = {"call": (0, 6), "index": (0, 7)}
    WEIGHTS: ClassVar = (0, 0, 1)  # the walker's swarm: in a third of the walks, rarely (it changes no state)

    @staticmethod
    def ready(h: Harness) -> bool:
        return bool(h.engine.requests or h.engine.retired)

    def apply(self, h: Harness) -> str:
        from kvprop.sim.engine import MISUSES

        return h.engine.misuse(MISUSES[self.call], self.index)


def _pick(ids, index):
    return ids[index % len(ids)] if ids else None


def _on_running(h: Harness, index: int, action, verb: str, why_not) -> str:
    """``action`` on the running request ``index`` picks, unless ``why_not`` (the engine's reason
    it would not make the call now) says why not."""
    rid = _pick([r.request_id for r in h.engine.running], index)
    if rid is None:
        return "nothing running"
    why = why_not(rid)
    if why:
        return f"not made: {why}"
    action(rid)
    return f"{verb} {rid}"


@attrs.frozen
class Preempt:
    """The scheduler preempts a running request (as for a higher-priority arrival)."""

    index: int
    ARGS: ClassVar[ArgRanges] = {"index": (0, 7)}

    @staticmethod
    def ready(h: Harness) -> bool:
        return bool(h.engine.running) and h.engine.preempts_on_request

    def apply(self, h: Harness) -> str:
        if not h.engine.preempts_on_request:
            return "not made: this target's scheduler preempts by its own policy"
        return _on_running(h, self.index, h.engine.preempt, "preempted", h.engine.why_not_preempt)


@attrs.frozen
class Abort:
    """A client disconnects: abort any live request, whatever its state."""

    index: int
    ARGS: ClassVar[ArgRanges] = {"index": (0, 7)}

    @staticmethod
    def ready(h: Harness) -> bool:
        return bool(h.engine.requests)

    def apply(self, h: Harness) -> str:
        rid = _pick(sorted(h.engine.requests), self.index)
        if rid is None:
            return "no live request"
        h.engine.abort(rid)
        return f"aborted {rid}"


@attrs.frozen
class Finish:
    """A running request hits a stop condition early."""

    index: int
    ARGS: ClassVar[ArgRanges] = {"index": (0, 7)}

    @staticmethod
    def ready(h: Harness) -> bool:
        return bool(h.engine.running)

    def apply(self, h: Harness) -> str:
        return _on_running(h, self.index, h.engine.finish, "finished", h.engine.why_not_finish)


@attrs.frozen
class ResetPrefixCache:
    """An operator resets the prefix cache (refused while blocks are in use)."""

    ARGS: ClassVar[ArgRanges] = {}

    def apply(self, h: Harness) -> str:
        return f"reset_prefix_cache -> {h.engine.reset_prefix_cache()}"


PROMPT_PRODUCERS = (AddRequest, AddLargeRequest, PublishPrefix)  # each adds exactly one prompt to the history
# ``ready(h)``, where an operation has it, says whether it would do anything now: the state
# machine does not draw it otherwise; the walker applies it anyway (a no-op).
OPERATIONS: tuple[type[Operation], ...] = (
    AddRequest,
    AddLargeRequest,
    Step,
    PublishPrefix,
    FinishLoad,
    Preempt,
    Abort,
    Finish,
    ResetPrefixCache,
    Misuse,
    FinishSave,
)
OPERATION_BY_NAME = {op.__name__: op for op in OPERATIONS}
# operations that run as often as another and take no draw of their own (an operation added
# this way leaves every other draw of a walk seed where it was)
WEIGHT_OF: dict[type[Operation], type[Operation]] = {FinishSave: FinishLoad}

# ---- swarm weights ----------------------------------------------------------------------

WEIGHT_CHOICES = (0, 1, 2, 4)
DRIVING_WEIGHTS = (2, 4, 8)  # Step and AddRequest: never off, so every run makes progress


def ready_operations(weights, harness) -> list[tuple[type[Operation], int]]:
    """(operation, weight) of every operation switched on in ``weights`` that would do
    something now (an operation without ``ready`` always would): both drivers draw the next
    operation from these."""
    return [
        (op_class, weight)
        for op_class, weight in zip(OPERATIONS, weights)
        if weight and (not hasattr(op_class, "ready") or op_class.ready(harness))
    ]


def sample_weights(choose) -> tuple[int, ...]:
    """Swarm testing: how often each operation runs in one walk or one example, one weight per
    entry of ``OPERATIONS``; a 0 switches the operation off there, so what needs many of one
    kind (pool pressure, loads in flight) gets runs that do little else. Both drivers draw
    their weights here."""
    weights = {op: choose.pick(getattr(op, "WEIGHTS", WEIGHT_CHOICES)) for op in OPERATIONS if op not in WEIGHT_OF}
    for driving in (Step, AddRequest):
        weights[driving] = choose.pick(DRIVING_WEIGHTS)
    return tuple(weights[WEIGHT_OF.get(op, op)] for op in OPERATIONS)
