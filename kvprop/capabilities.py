"""What a target declares beyond the required calls (``kvprop.targets.protocol``).

Here, below every layer, because the engine, the checks and the sampler all read it: the
engine makes an optional call only when its capability is declared, the checks read an
optional report only then, and the sampler draws only the shapes declared. Nothing in kvprop
discovers a capability by probing the target's objects.
"""

from __future__ import annotations

import attrs


def _capability(calls: tuple[str, ...], side: str, meaning: str):
    return attrs.field(default=False, metadata={"calls": calls, "side": side, "meaning": meaning})


@attrs.frozen
class Capabilities:
    """What a target offers beyond the required calls; each field names the calls it promises.

    The allocator side changes what kvprop's engine may drive; the view side lets the checks
    judge more (keys inside a block, queued block copies) or judge faster (a change log, an
    O(1) key lookup)."""

    kv_events: bool = _capability(("take_events",), "allocator", "KV cache events, replayed against its cache map")
    step_notice: bool = _capability(("new_step_starts",), "allocator", "told when a scheduler step starts")
    block_copies: bool = _capability(
        ("take_kv_cache_block_copies",), "allocator", "queues copies of shared blocks (hits inside a block)"
    )
    deferred_frees: bool = _capability(
        ("pop_blocks_for_free", "free_popped_blocks"),
        "allocator",
        "takes a request's blocks without freeing them, and frees them later (a scheduler's deferred frees)",
    )
    caller_contract: bool = _capability(
        ("caller_contract",), "allocator", "names the malformed calls it refuses (Misuse operations)"
    )
    evictions: bool = _capability(("num_evictions",), "view", "counts evictions of cached blocks")
    keys_inside_blocks: bool = _capability(
        ("extra_keys", "further_keys"), "view", "reports keys of hits inside a block"
    )
    pending_copies: bool = _capability(("pending_copies",), "view", "reports the block copies it has queued")
    change_log: bool = _capability(
        ("take_changes", "cache_count"), "view", "reports the blocks changed since it was last asked"
    )
    raw_tables: bool = _capability(("raw_tables",), "view", "hands a group's live tables at once")
    key_lookup: bool = _capability(("has_cache_key",), "view", "answers whether a key is cached in O(1)")
    request_records: bool = _capability(
        ("records_of",), "view", "names the per-request records its group managers still keep for a request"
    )
    null_count_fixed: bool = _capability(
        (), "view", "never touches or frees its null block, so the null block's reference count stays 0"
    )

    def declared(self) -> tuple[str, ...]:
        return tuple(f.name for f in attrs.fields(Capabilities) if getattr(self, f.name))


EVERY = Capabilities(**{f.name: True for f in attrs.fields(Capabilities)})
NONE = Capabilities()


GROUP_KINDS = frozenset({"full", "sliding_window", "chunked_local", "mamba"})


@attrs.frozen
class Shapes:
    """The configurations a target builds: the sampler draws only these, so that a search's
    budget goes to shapes the target runs, not to refusals. What it cannot declare here it
    still refuses by ``ConfigError`` from its factory, each refusal counted."""

    group_kinds: frozenset = GROUP_KINDS  # of "full", "sliding_window", "chunked_local", "mamba"
    max_groups: int = 3
    kv_events: bool = True  # enable_kv_cache_events
    full_report: bool = True  # kv_cache_report_mode "full"
    eagle: bool = True  # the EAGLE drop
    hits_inside_blocks: bool = True  # a hash unit below the block size
    retention: bool = True  # a retention interval (vLLM's prefix-cache retention)
    lookahead: bool = True  # lookahead slots
    checkpoints: bool = True  # a state group's prefill checkpoints
    state_with_connector: bool = True  # a state group beside a KV connector
    local_with_connector: bool = True  # a chunked-local group beside a KV connector
    drafts_within_budget: bool = False  # with drafts, a token budget of at least 1 + drafts
    connector: bool = True  # a KV connector ("sync" or "async")
    drafts: bool = True  # speculative drafts
    without_caching: bool = True  # prefix caching off
    # the page layouts (kvprop.allocator.specs.PAGE_LAYOUTS) it builds: only the spec class a vLLM
    # target declares changes with one, so the others build the plain layout alone
    page_layouts: frozenset = frozenset({"plain"})
    # the options drawn by their own declaration (kvprop.allocator.options.Option.draw) it builds,
    # by name; None: every one. An adapter names those it maps to its engine.
    options: frozenset | None = None

    def builds(self, option: str) -> bool:
        """Whether the sampler may draw ``option`` (one with a ``draw`` of its own) for this target."""
        return self.options is None or option in self.options

    def limits(self) -> list[str]:
        """What is drawn differently from every shape, in words."""
        said = []
        for field in attrs.fields(Shapes):
            value, default = getattr(self, field.name), field.default
            if value == default:
                continue
            if isinstance(value, bool):
                said.append(f"{'only ' if value else 'no '}{field.name.replace('_', ' ')}")
            elif isinstance(value, frozenset) and field.name == "options":
                said.append(f"drawn options {', '.join(sorted(value)) or 'none'}")
            elif isinstance(value, frozenset):
                said.append(f"{field.name.replace('_', ' ')} {', '.join(sorted(value))}")
            else:
                said.append(f"{field.name.replace('_', ' ')} {value}")
        return said


ANY_SHAPE = Shapes()
