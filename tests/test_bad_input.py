"""Bad input fails where it is written, with kvprop's own error naming the field or call
and the allowed range."""

from __future__ import annotations

import pytest
from helpers import allocator, engine, prefill, req

from kvprop.allocator.specs import (
    AllocatorConfig,
    ChunkedLocal,
    EngineConfig,
    FullAttention,
    Mamba,
    SlidingWindow,
)
from kvprop.errors import ConfigError, RequestError
from kvprop.sim.memory import pick_device
from kvprop.targets.kvprop import build_kvprop_engine as make_engine
from kvprop.targets.kvprop import make_allocator
from kvprop.targets.variants import VARIANTS

OK_GROUPS = (FullAttention(4),)

# ---- configuration ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: FullAttention(0), r"FullAttention\.block_size must be >= 1, got 0"),
        (lambda: SlidingWindow(0, 4), r"SlidingWindow\.block_size must be >= 1, got 0"),
        (lambda: ChunkedLocal(-1, 4), r"ChunkedLocal\.block_size must be >= 1, got -1"),
        (lambda: SlidingWindow(4, 0), r"SlidingWindow\.window must be >= 1, got 0"),
        (lambda: ChunkedLocal(4, 0), r"ChunkedLocal\.chunk must be >= 1, got 0"),
        (lambda: AllocatorConfig(OK_GROUPS, 1), r"AllocatorConfig\.num_blocks must be >= 2, got 1"),
        (
            lambda: EngineConfig(AllocatorConfig(OK_GROUPS, 8), token_budget=0),
            r"EngineConfig\.token_budget must be >= 1, got 0",
        ),
        (
            lambda: EngineConfig(AllocatorConfig(OK_GROUPS, 8), lookahead=17),
            r"EngineConfig\.lookahead must be in \[0, 16\], got 17",
        ),
        (
            lambda: EngineConfig(AllocatorConfig(OK_GROUPS, 8), lookahead=-1),
            r"EngineConfig\.lookahead must be in \[0, 16\], got -1",
        ),
        (lambda: EngineConfig(AllocatorConfig(OK_GROUPS, 8), vocab=0), r"EngineConfig\.vocab must be >= 1, got 0"),
        (
            lambda: EngineConfig(AllocatorConfig(OK_GROUPS, 8), speculative_tokens=5),
            r"EngineConfig\.speculative_tokens must be in \[0, 4\], got 5",
        ),
        (
            lambda: EngineConfig(AllocatorConfig((Mamba(4, "none"),), 8, False), speculative_tokens=1),
            r"EngineConfig\.speculative_tokens must be 0 with a Mamba group",
        ),
        (
            lambda: EngineConfig(AllocatorConfig((Mamba(4, "align", 1),), 8), speculative_tokens=2),
            r"Mamba\.speculative_blocks must equal EngineConfig\.speculative_tokens .* got 1 and 2",
        ),
        (
            lambda: EngineConfig(AllocatorConfig((Mamba(2, "align", 2),), 8), speculative_tokens=2),
            r"EngineConfig\.speculative_tokens must be below a Mamba group's block_size, got 2 drafts with blocks of 2",
        ),
    ],
)
def test_out_of_range_values(build, message):
    """Every integer field is range-checked at construction; the message names field and range."""
    with pytest.raises(ConfigError, match=message):
        build()


def test_pool_with_only_the_null_block_is_refused():
    """A pool needs the null block plus at least one usable block."""
    with pytest.raises(ConfigError, match=r"AllocatorConfig\.num_blocks must be >= 2, got 1"):
        make_allocator(AllocatorConfig(OK_GROUPS, 1))
    assert AllocatorConfig(OK_GROUPS, 2).usable_blocks == 1


def test_mismatched_block_sizes_across_groups():
    """All groups share one pool, so they must share one block size."""
    with pytest.raises(
        ConfigError,
        match=r"AllocatorConfig\.groups must all have the same block_size \(one shared pool\), got \[2, 4\]",
    ):
        AllocatorConfig((FullAttention(4), SlidingWindow(2, 8)), 8)


def test_chunk_not_a_multiple_of_block_size():
    """A chunk boundary must fall on a block boundary."""
    with pytest.raises(ConfigError, match=r"ChunkedLocal\.chunk must be a multiple of block_size=4, got 6"):
        ChunkedLocal(4, 6)


@pytest.mark.parametrize(
    "groups, message",
    [
        ((), r"AllocatorConfig\.groups must be a tuple of 1 to 8 attention specs, got \(\)"),
        (
            tuple(FullAttention(2) for _ in range(9)),
            r"AllocatorConfig\.groups must be a tuple of 1 to 8 attention specs",
        ),
        (
            (FullAttention(2), "full"),
            r"AllocatorConfig\.groups\[1\] must be one of FullAttention, SlidingWindow, ChunkedLocal, Mamba, got 'full'",
        ),
    ],
)
def test_bad_group_lists(groups, message):
    """Between 1 and 8 groups, each an attention spec."""
    with pytest.raises(ConfigError, match=message):
        AllocatorConfig(groups, 8)


def test_unknown_connector_mode():
    """The connector mode is one of off, sync, async."""
    with pytest.raises(
        ConfigError, match=r"EngineConfig\.connector must be one of \['off', 'sync', 'async'\], got 'remote'"
    ):
        EngineConfig(AllocatorConfig(OK_GROUPS, 8), connector="remote")


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: FullAttention(2.0), r"FullAttention\.block_size must be an integer, got 2\.0"),
        (lambda: FullAttention("4"), r"FullAttention\.block_size must be an integer, got '4'"),
        (lambda: FullAttention(True), r"FullAttention\.block_size must be an integer, got True"),
        (lambda: SlidingWindow(4, None), r"SlidingWindow\.window must be an integer, got None"),
        (lambda: AllocatorConfig(OK_GROUPS, 8.5), r"AllocatorConfig\.num_blocks must be an integer, got 8\.5"),
        (
            lambda: EngineConfig(AllocatorConfig(OK_GROUPS, 8), token_budget="64"),
            r"EngineConfig\.token_budget must be an integer, got '64'",
        ),
        (
            lambda: AllocatorConfig(OK_GROUPS, 8, enable_caching=1),
            r"AllocatorConfig\.enable_caching must be True or False, got 1",
        ),
    ],
)
def test_non_integer_values(build, message):
    """Booleans, floats, strings and None are not integers (and 1 is not a boolean)."""
    with pytest.raises(ConfigError, match=message):
        build()


def test_engine_config_needs_an_allocator_config():
    """EngineConfig.allocator must be an AllocatorConfig, refused with ConfigError like every
    other config field (it once raised attrs' TypeError)."""
    with pytest.raises(ConfigError, match=r"EngineConfig\.allocator must be an AllocatorConfig"):
        EngineConfig({"groups": OK_GROUPS, "num_blocks": 8})


def test_unknown_variant_lists_the_known_ones():
    """An unknown variant name is refused with every known name listed."""
    with pytest.raises(ConfigError, match=r"unknown variant 'interleaved'; known variants: correct, ") as info:
        make_allocator(AllocatorConfig(OK_GROUPS, 8), variant="interleaved")
    for name in VARIANTS:
        assert name in str(info.value)
    with pytest.raises(ConfigError, match="known variants"):
        make_engine(EngineConfig(AllocatorConfig(OK_GROUPS, 8)), variant="nope")


def test_unknown_device():
    """The paged memory device is cpu, cuda or cuda:N."""
    with pytest.raises(ConfigError, match=r"device must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'"):
        pick_device("tpu")


# ---- allocator calls ----------------------------------------------------------------------


def test_free_of_an_unknown_request():
    """free names the call and the request that holds no blocks; nothing changes."""
    mgr = allocator(OK_GROUPS, 8)
    with pytest.raises(RequestError, match=r"free: request 'ghost' holds no blocks \(never admitted, or freed\)"):
        mgr.free(req("ghost", [1, 2], 4))
    assert mgr.num_free_blocks == 7


def test_double_free():
    """A second free of the same request is refused, not a double decrement."""
    mgr = allocator(OK_GROUPS, 8)
    r = req("r", [1, 2, 3, 4, 5], 4)
    prefill(mgr, r)
    mgr.free(r)
    with pytest.raises(RequestError, match=r"free: request 'r' holds no blocks"):
        mgr.free(r)
    assert all(b.ref_cnt == 0 for b in mgr.pool.blocks)


def test_allocating_zero_tokens():
    """allocate_slots needs at least one new token (or external tokens)."""
    mgr = allocator(OK_GROUPS, 8)
    with pytest.raises(RequestError, match=r"allocate_slots: num_new_tokens must be >= 1 .*got num_new_tokens=0"):
        mgr.allocate_slots(req("r", [1, 2, 3], 4), 0)
    assert mgr.num_free_blocks == 7


@pytest.mark.parametrize("name", ["num_new_computed_tokens", "num_lookahead_tokens", "num_external_computed_tokens"])
def test_negative_token_counts(name):
    """Every token count passed to allocate_slots is >= 0."""
    mgr = allocator(OK_GROUPS, 8)
    with pytest.raises(RequestError, match=rf"allocate_slots: {name} must be >= 0, got -1"):
        mgr.allocate_slots(req("r", [1, 2, 3], 4), 1, **{name: -1})


# ---- engine calls -------------------------------------------------------------------------


def test_request_too_large_for_the_pool():
    """A request that could never finish is refused at add_request, naming blocks needed and usable."""
    eng = engine([FullAttention(2), SlidingWindow(2, 4)], 9)
    with pytest.raises(
        RequestError, match=r"add_request: .* may need 10 blocks .* but the pool has only 8 usable blocks"
    ):
        eng.add_request(list(range(8)), 2)
    assert eng.requests == {} and not eng.waiting
    eng.add_request(list(range(6)), 2)  # 2 x ceil(8 / 2) = 8 blocks: fits exactly


@pytest.mark.parametrize(
    "prompt, max_new, message",
    [
        ([], 1, r"add_request: prompt must be a non-empty list of token ids >= 0, got \[\]"),
        ([1, -2], 1, r"add_request: prompt must be a non-empty list of token ids >= 0"),
        ([1, "a"], 1, r"add_request: prompt must be a non-empty list of token ids >= 0"),
        ([1, 2], 0, r"add_request: max_new_tokens must be an integer >= 1, got 0"),
        ([1, 2], 1.5, r"add_request: max_new_tokens must be an integer >= 1, got 1\.5"),
    ],
)
def test_malformed_requests(prompt, max_new, message):
    """Prompts are non-empty lists of non-negative ints; max_new_tokens is an int >= 1."""
    eng = engine(OK_GROUPS, 8)
    with pytest.raises(RequestError, match=message):
        eng.add_request(prompt, max_new)
    assert eng.requests == {}


def test_abort_of_an_unknown_request():
    """abort names the unknown id and the live ones."""
    eng = engine(OK_GROUPS, 8)
    eng.add_request([1, 2, 3], 1)
    with pytest.raises(RequestError, match=r"unknown request 'r9'; live requests: \['r0'\]"):
        eng.abort("r9")
    assert list(eng.requests) == ["r0"]


def test_finish_of_a_waiting_request():
    """Only running requests can finish."""
    eng = engine(OK_GROUPS, 8)
    r = eng.add_request([1, 2, 3], 1)
    with pytest.raises(RequestError, match=r"finish: request 'r0' is waiting, only running ones can finish"):
        eng.finish(r.request_id)


def test_finish_load_with_no_load():
    """finish_load names the request and the loads in flight."""
    eng = engine(OK_GROUPS, 8, connector="async")
    with pytest.raises(RequestError, match=r"finish_load: no load in flight for 'r0'; in flight: \[\]"):
        eng.finish_load("r0", ok=True)


def test_booleans_are_not_token_ids_or_counts():
    """True is an int to Python, never a token id or a token count to kvprop."""
    e = engine((FullAttention(4),), num_blocks=16)
    with pytest.raises(RequestError, match="prompt must be a non-empty list of token ids >= 0"):
        e.add_request([1, True, 2], 2)
    with pytest.raises(RequestError, match="max_new_tokens must be an integer >= 1"):
        e.add_request([1, 2], True)
