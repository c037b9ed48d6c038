"""kvprop's configuration in SGLang's terms: the shapes ``--target sglang`` builds, how a kvprop
``EngineConfig`` maps to the server arguments SGLang's KV cache reads, and SGLang's own start-up
refusals of the result.

The mapping (``docs/targets.md`` states it too): a block is a page (``page_size`` = block size);
the pool holds ``num_blocks`` pages; a sliding-window group makes the model a full + SWA hybrid
whose window is that group's (SGLang keeps one full pool however many full layers there are),
passed as SGLang's ``sliding_window_size`` unchanged, so SGLang attends one position more than
kvprop's own window (``window_positions`` says which);
the token budget is the chunk size, rounded up to a whole page (SGLang refuses a
``chunked_prefill_size`` that is not a multiple of ``page_size``, so a budget maps to the smallest
chunk it can run with); the SWA pool is the full pool times SGLang's default
``swa_full_tokens_ratio`` (0.8), aligned down to a page, as ``HybridSWAPoolConfigurator`` sizes it
(``model_executor/pool_configurator.py``, 0.5.18 and 0.5.23).
"""

from __future__ import annotations

from kvprop.allocator.specs import EngineConfig, FullAttention, SlidingWindow
from kvprop.capabilities import Shapes
from kvprop.errors import ConfigError
from kvprop.targets.sglang.config import SglangConfig

SWA_FULL_TOKENS_RATIO = 0.8  # SGLang's fallback for --swa-full-tokens-ratio (arg_groups/fields/schedule.py)
MAX_RUNNING_REQUESTS = 8
MAX_CONTEXT_LEN = 256

SHAPES = Shapes(
    group_kinds=frozenset({"full", "sliding_window"}),
    max_groups=2,
    kv_events=False,
    full_report=False,
    eagle=False,
    hits_inside_blocks=False,
    retention=False,
    lookahead=False,
    checkpoints=False,
    state_with_connector=False,
    local_with_connector=False,
    connector=False,
    drafts=False,
    without_caching=False,
    options=frozenset(),
)


def release_shapes() -> Shapes:
    """What ``--target sglang`` builds on any supported release: full attention, or full
    attention with a sliding window, prefix caching on, no connector, no drafts. Importing SGLang
    here refuses a missing or unsupported release before anything runs."""
    from kvprop.targets.sglang.loading import import_sglang

    import_sglang()
    return SHAPES


def rust_core_shapes() -> Shapes:
    """What ``--target sglang-rust`` builds: ``--target sglang``'s shapes, on a release that ships
    the Rust tree core (0.5.19 on); an older release is refused before anything runs."""
    from kvprop.targets.sglang.loading import import_sglang
    from kvprop.targets.sglang.release import Release

    sg = import_sglang()
    if Release.of(sg).tree_core_selector == "none":
        raise ConfigError(
            f"target 'sglang-rust': SGLang {sg.version} has only the Python tree core (the Rust core ships from "
            f"0.5.19); use --target sglang"
        )
    return SHAPES


def refusal(config: EngineConfig) -> str | None:
    """Why kvprop's configuration has no SGLang counterpart, or None."""
    alloc = config.allocator
    kinds = {type(spec) for spec in alloc.groups}
    if not kinds <= {FullAttention, SlidingWindow}:
        return "SGLang's target drives full attention and sliding windows only (no Mamba or chunked-local groups)"
    if not alloc.enable_caching:
        return "SGLang's target drives the radix cache: enable_caching must be on (ChunkCache is not driven)"
    why = [
        ("connector", config.connector != "off", "no KV connector (SGLang's hierarchical cache is not driven)"),
        ("speculative_tokens", config.speculative_tokens, "no drafts"),
        ("lookahead", config.lookahead, "no lookahead slots"),
        ("enable_kv_cache_events", alloc.enable_kv_cache_events, "no KV cache events"),
        ("hash_unit", alloc.hash_unit is not None, "no hits inside a page"),
        ("retention_interval", alloc.retention_interval not in (0, None), "no retention interval"),
        ("eagle", alloc.eagle, "no EAGLE drop"),
    ]
    for name, drawn, allowed in why:
        if drawn:
            return f"SGLang's target takes {allowed}; the configuration sets {name}"
    windows = {spec.window for spec in alloc.groups if isinstance(spec, SlidingWindow)}
    if len(windows) > 1:
        return f"SGLang's hybrid model has one sliding window; the configuration has windows {sorted(windows)}"
    return None


def sglang_config(config: EngineConfig) -> SglangConfig:
    """The SGLang configuration ``config`` maps to; a ConfigError where SGLang has none or refuses it."""
    why = refusal(config)
    if why:
        raise ConfigError(f"target 'sglang': {why}")
    alloc = config.allocator
    page = alloc.block_size
    pool = alloc.num_blocks * page
    window = next((spec.window for spec in alloc.groups if isinstance(spec, SlidingWindow)), None)
    swa_pool = int(pool * SWA_FULL_TOKENS_RATIO) // page * page
    if window is not None and window + page >= swa_pool:
        # HybridSWAPoolConfigurator (0.5.18) / validate_swa_pool_size (0.5.23): "SWA pool cannot
        # hold even one request", refused at start-up
        raise ConfigError(
            f"target 'sglang': SGLang refuses an SWA pool of {swa_pool} tokens for a window of {window} at page "
            f"size {page} (the window + a page must be below it; {SWA_FULL_TOKENS_RATIO} of the full pool "
            f"of {pool} tokens): more blocks or a smaller window"
        )
    return SglangConfig(
        page_size=page,
        pool_tokens=pool,
        chunked_prefill_size=-(-config.token_budget // page) * page,
        sliding_window=window,
        swa_pool_tokens=max(page, swa_pool),
        max_running_requests=MAX_RUNNING_REQUESTS,
        max_context_len=MAX_CONTEXT_LEN,
    )


def window_positions(position: int, window: int) -> range:
    """The positions before ``position`` that the token there attends through SGLang's sliding
    window of ``window`` (its ``sliding_window_size``): the ``window`` positions before it.

    SGLang's window excludes the token itself, where kvprop's (vLLM's) includes it: FlashAttention
    runs with ``window_size=(W, 0)``, both sides inclusive (0.5.23
    ``layers/attention/flashattention_backend.py``; its models pass their configuration's window
    less one, ``get_attention_sliding_window_size``), and the cache frees a running request's
    window slots only below ``pre_len - W`` (``mem_cache/common.py``,
    ``free_swa_out_of_window_slots``). A backend that reads fewer (Triton's decode reads
    ``min(seq_len, W)`` positions with the token's own) reads a subset of these."""
    return range(max(0, position - window), position)


def check_startup(config: EngineConfig) -> None:
    """SGLang's start-up validation of ``config``'s counterpart (a ConfigError refuses it)."""
    sglang_config(config)
