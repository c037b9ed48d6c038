"""Small builders and assertions shared by the deterministic tests.

They drive the allocator exactly as an engine does (hit search, allocate_slots, advance
``num_computed_tokens``) so each test reads as a short list of engine calls.
"""

from __future__ import annotations
import __future__

import ast
import inspect
import sys
import textwrap
from collections import Counter
from pathlib import Path

from kvprop.allocator.hashing import fingerprint
from kvprop.allocator.specs import AllocatorConfig, EngineConfig, FullAttention, SlidingWindow
from kvprop.search.alphabet import AddLargeRequest, AddRequest
from kvprop.search.trace import Trace
from kvprop.sim.memory import PagedMemory
from kvprop.sim.request import Request
from kvprop.targets.kvprop import build_kvprop_engine, make_allocator

NULL = 0  # the null block's id; "-" in docs/reference-scenarios.md
BUGGY = "interleaved-external-alloc"
VOCAB = 1000


def motivating_trace():
    """The motivating bug as a 4-operation trace (minimised by kvprop on vLLM 0.23.0, docs/findings.md):
    a fixed find for tests that need one, independent of what the sampler draws."""
    config = EngineConfig(
        AllocatorConfig((FullAttention(3), SlidingWindow(3, 4)), 18), token_budget=9, lookahead=0, connector="sync"
    )
    steps = (
        AddLargeRequest(parent=0, seed=0),
        AddLargeRequest(parent=0, seed=0),
        AddRequest(parent=0, cut=0, extra=1, seed=0, max_new_tokens=1),
        AddRequest(parent=0, cut=1, extra=6, seed=0, max_new_tokens=1),
    )
    return Trace(config=config, steps=steps, seed=0, driver="walk", variant=BUGGY)


def allocator(groups, num_blocks, variant=None, enable_caching=True, retention_interval=None):
    config = AllocatorConfig(tuple(groups), num_blocks, enable_caching, retention_interval=retention_interval)
    return make_allocator(config, variant=variant)


def engine(groups, num_blocks, variant=None, hooks=None, **engine_kwargs):
    config = EngineConfig(AllocatorConfig(tuple(groups), num_blocks), **engine_kwargs)
    return build_kvprop_engine(config, variant=variant, device="cpu", hooks=hooks)


def req(request_id, tokens, block_size, max_new_tokens=4):
    return Request(request_id, list(tokens), max_new_tokens, block_size, VOCAB)


def queue(mgr) -> list[int]:
    """The free queue, head (next evicted) first."""
    return [b.block_id for b in mgr.pool.free_queue.forward()]


def refs(mgr, block_ids) -> list[int]:
    return [mgr.pool.blocks[b].ref_cnt for b in block_ids]


def hit_ids(hits) -> tuple[list[int], ...]:
    return tuple([b.block_id for b in group] for group in hits)


def prefill(mgr, request, num_external=0, num_new=None, **kwargs):
    """Admit ``request`` the way the scheduler does: local hit, optional external tokens,
    then the rest of the prompt (or ``num_new`` tokens). Returns (hits, num_hit, result)."""
    hits, num_hit, request.shared_prefix_boundary = mgr.get_computed_blocks(request)
    if num_new is None:
        num_new = request.num_tokens - num_hit - num_external
    result = mgr.allocate_slots(
        request,
        num_new,
        num_new_computed_tokens=num_hit,
        new_computed_blocks=hits,
        num_external_computed_tokens=num_external,
        **kwargs,
    )
    if result is not None:
        request.num_computed_tokens = num_hit + num_external + num_new
    return hits, num_hit, result


def duplicate_blocks(mgr, request_id) -> list[int]:
    """Non-null block ids appearing more than once across all groups of one request."""
    counts = Counter(b for table in mgr.get_block_ids(request_id) for b in table if b != NULL)
    return sorted(b for b, n in counts.items() if n > 1)


def assert_request_sound(mgr, request_id) -> None:
    """The regression assertions: no block id twice across the request's groups, and every
    non-null block it holds has ref_cnt >= 1 and is out of the free queue."""
    dup = duplicate_blocks(mgr, request_id)
    assert not dup, f"{request_id}: blocks {dup} appear twice across groups {mgr.get_block_ids(request_id)}"
    in_queue = set(queue(mgr))
    for g, table in enumerate(mgr.get_block_ids(request_id)):
        for b in table:
            if b == NULL:
                continue
            assert mgr.pool.blocks[b].ref_cnt >= 1, f"group {g} holds block {b} with ref_cnt 0"
            assert b not in in_queue, f"group {g} holds block {b}, which is still in the free queue"


def readback_mismatches(mgr, requests) -> list[tuple]:
    """Write every computed position's fingerprint through the block tables into paged
    memory (request by request, group by group), then read it all back.

    Returns (request id, group, position, block id) for each position that reads back
    something else: a block shared by two groups makes the later group's write clobber
    the earlier one's.
    """
    bs = mgr.block_size
    memory = PagedMemory(mgr.config.num_blocks, bs, "cpu")
    slots, values, origin = [], [], []
    for request in requests:
        for g, table in enumerate(mgr.get_block_ids(request.request_id)):
            for p in range(min(request.num_computed_tokens, len(table) * bs)):
                block_id = table[p // bs]
                if block_id == NULL:
                    continue
                slots.append(block_id * bs + p % bs)
                values.append(fingerprint(g, p, request.prefix[p]))
                origin.append((request.request_id, g, p, block_id))
    for slot, value in zip(slots, values):
        # One write per slot, in order, so a later group's write to a shared block wins
        # deterministically (one scatter with repeated slots has no defined winner).
        memory.write([slot], [value])
    return [origin[i] for i in memory.mismatches(slots, values)]


def checkpoint_find(name: str, target=None) -> Trace:
    """The minimised traces of vLLM 0.33.0's two prefill-checkpoint finds (docs/findings.md)."""
    from kvprop.search import trace as tr

    mamba = {"kind": "mamba", "mode": "align", "checkpoint": 1}
    config = {"enable_caching": True, "lookahead": 0, "connector": "off", "vocab": 4}
    if name == "over-running-state":
        # with retention 0 the chunk [16, 32) of a 39-token prompt reserves no checkpoint
        # column, the allocation moves the draft's scratch block from column 2 to the new
        # running state, column 3, and the worker, whose table still holds it at column 2,
        # writes the checkpoint there too
        config |= {
            "groups": [{**mamba, "block_size": 8, "speculative_blocks": 1}],
            "num_blocks": 7,
            "retention_interval": 0,
            "token_budget": 16,
            "speculative_tokens": 1,
        }
        steps = [{"op": "AddLargeRequest", "parent": 0, "seed": 0}, add_op(0, 9, 1, 1)]
    else:  # "past-block"
        # r1 hits r0's state at 1 token, inside block 0, and gets a copy of that block; its
        # final chunk [1, 8) saves the prompt's checkpoint, so vLLM's scheduler lets it run past
        # the block boundary at 3, and the copy, still holding the state after 1 token, is
        # cached under the key of 3 tokens
        config |= {
            "groups": [{"kind": "full", "block_size": 3}, {**mamba, "block_size": 3, "speculative_blocks": 0}],
            "num_blocks": 9,
            "hash_unit": 1,
            "token_budget": 7,
        }
        steps = [add_op(0, 0, 2, 1), {"op": "AddLargeRequest", "parent": 0, "seed": 0}]
    return tr.from_dict({"format": "kvprop-trace/1", "target": target, "config": config, "steps": steps, "drain": True})


def report_find(name: str, target=None) -> Trace:
    """The minimised traces of vLLM's two full-report finds (docs/findings.md)."""
    from kvprop.search import trace as tr

    config = {
        "enable_caching": True,
        "enable_kv_cache_events": True,
        "kv_cache_report_mode": "full",
        "lookahead": 0,
        "connector": "off",
        "vocab": 4,
    }
    if name == "skipped-positions":
        # r2 hits r1's 4 tokens: a window of 2 holds only block 1; vLLM announces blocks 0 and 1
        config |= {"groups": [{"kind": "sliding_window", "block_size": 2, "window": 2}], "num_blocks": 5}
        config |= {"retention_interval": 0, "token_budget": 2}
        steps = [add_op(0, 0, 1, 1), {"op": "AddLargeRequest", "parent": 0, "seed": 0}, {"op": "Step", "times": 1}]
        steps.append({"op": "AddLargeRequest", "parent": 0, "seed": 0})
    else:  # "inside-a-block"
        # r1 = [0, 0, 1, 1] hits r0's 2 tokens inside block 0; vLLM looks up the hash of a full
        # block r1 does not have
        mamba = {"kind": "mamba", "block_size": 16, "mode": "align", "speculative_blocks": 0}
        config |= {"groups": [{"kind": "full", "block_size": 16}, mamba], "num_blocks": 5, "hash_unit": 2}
        config |= {"token_budget": 1}
        steps = [add_op(0, 0, 3, 1), add_op(0, 0, 1, 1)]
    return tr.from_dict({"format": "kvprop-trace/1", "target": target, "config": config, "steps": steps, "drain": True})


def add_op(parent, cut, extra, max_new_tokens) -> dict:
    return {
        "op": "AddRequest",
        "parent": parent,
        "cut": cut,
        "extra": extra,
        "seed": 0,
        "max_new_tokens": max_new_tokens,
    }


# ---- kvprop report's reproducers ------------------------------------------------------------


def reported(tmp_path, trace) -> tuple[int, Path]:
    """``kvprop report`` of ``trace`` into ``tmp_path / "report"``: (exit code, the folder)."""
    from kvprop.front.cli import main
    from kvprop.search import trace as tr

    path, out = tmp_path / "find.json", tmp_path / "report"
    tr.save(trace, path)
    return main(["report", str(path), "--out", str(out)]), out


def imported_modules(source: str) -> set[str]:
    nodes = ast.walk(ast.parse(source))
    names = [a.name for n in nodes if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom) and n.module]
    return {name.split(".")[0] for name in names}


def mutate(monkeypatch, owner, name: str, line: str, mutant: str) -> None:
    """A one-line mutant of an engine's own code: ``owner.name`` (a function of a module, or a
    method of a class) recompiled from its source with ``line`` replaced by ``mutant``, in its
    module's globals, for the test's duration. The line must occur exactly once."""
    function = getattr(owner, name)
    module = sys.modules[function.__module__]
    source = textwrap.dedent(inspect.getsource(function))
    assert source.count(line) == 1, f"{function.__qualname__}: {line!r} occurs {source.count(line)} times"
    flags = __future__.annotations.compiler_flag
    code = compile(source.replace(line, mutant), module.__file__, "exec", flags=flags, dont_inherit=True)
    defined: dict = {}
    exec(code, module.__dict__, defined)
    monkeypatch.setattr(owner, name, defined[name])
