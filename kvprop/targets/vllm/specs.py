"""The KV cache specs a vLLM release registers, which of them kvprop drives, and why not the others.

Read from the installed release, never listed by hand: up to 0.22.x the module dict
``spec_manager_map`` (``vllm/v1/core/single_type_kv_cache_manager.py``, exact-type lookup);
from 0.23.0 ``KVCacheSpecRegistry`` (``vllm/v1/kv_cache_spec_registry.py``), which
``register_all_kvcache_specs`` fills (it is idempotent, and called here rather than left to the
registry's lazy path, which skips the built-in specs once anything else registered first); from
0.30.0 also managers chosen by a group's role (``register_role_manager``). The registry offers
no listing call, so its module dicts are read.

A spec is driven when the manager target's sampler draws it on this release: a group kind and
page layout it draws that ``spec_classes.LAYOUT_SPECS`` maps to the spec. Every other registered
spec is built once through vLLM's own ``KVCacheManager`` (one group of it, its fields as vLLM's
layers fill them): one that fails to construct is a find, refused with vLLM's exception and the
finding filed for it (``FILED``); one that constructs is refused for the reason ``NOT_DRIVEN``
gives. A registered spec with neither is one kvprop has not looked at: ``census`` gives it no
reason, and the tests fail on it.
"""

from __future__ import annotations

import dataclasses

import attrs

from kvprop.targets.vllm.config import accepted
from kvprop.targets.vllm.loading import import_vllm
from kvprop.targets.vllm.shapes import release_shapes
from kvprop.targets.vllm.spec_classes import LAYOUT_SPECS

NOT_DRIVEN = {  # why, and the served models that build each (vLLM 0.34.0's model code)
    "CrossAttentionSpec": "encoder-decoder cross attention (GPT-2 with cross attention, BLIP-2, Granite 4 Vision, "
    "Nemotron Parse): its blocks hold the encoder's output, which kvprop's requests have no stand-in for",
    "SinkFullAttentionSpec": "static attention sinks (openPangu): sink tokens kvprop does not model",
    "HiSparseHotSpec": "host-pool sparse attention, HiSparse (DeepSeek V3.2, Kimi K3 DSA): a host-memory tier and "
    "an indexer's page choice kvprop does not model",
    "HiSparseResidentSpec": "host-pool sparse attention, HiSparse (DeepSeek V3.2, Kimi K3 DSA): a host-memory tier "
    "and an indexer's page choice kvprop does not model",
    "CircularBufferSpec": "a ring buffer of one block per request, never prefix-cached (the compressor and indexer "
    "caches of DeepSeek V4.1, Qwen4-exp, GLM-5-Next, Step-5): written by the model's own kernels",
    "KpoolTailSpec": "a ring of index-key tail blocks, never prefix-cached (sparse-attention indexers, 0.30.0)",
    "RSWASpec": "retained-prefix windows, the prompt kept plus a decode window (Unlimited-OCR on FlashAttention 4): "
    "not modelled in kvprop's allocator",
}
# The finding filed for a spec vLLM's coordinator fails to construct (findings/<id>/)
FILED = {"SinkFullAttentionSpec": "sink-manager-construction"}

BLOCK = 4  # the block size of a spec built to see whether it constructs


def field_values(v) -> dict:
    """Field name -> the value a spec built here gets, as vLLM's layers fill it (a field no
    entry names keeps its default): one tiny head, float32, windows, chunks and sinks of whole
    blocks (a sink manager takes only a multiple of the block size), a Mamba state in mode
    "align" (what prefix caching needs), a host page of one block."""
    f32 = v.torch.float32
    return dict(
        block_size=BLOCK,
        num_kv_heads=1,
        head_size=1,
        dtype=f32,
        sliding_window=4 * BLOCK,
        attention_chunk_size=4 * BLOCK,
        rswa_window=4 * BLOCK,
        sink_len=BLOCK,
        shapes=((1,),),
        dtypes=(f32,),
        mamba_cache_mode="align",
        page_size=4 * BLOCK,
        blocks_per_request=4,
    )


@attrs.frozen
class SpecRow:
    spec: str  # the spec class, or "role <name>" for a manager chosen by group role
    manager: str
    driven: bool
    reason: str | None  # for a spec not driven, why (None: kvprop records no reason); "" for a driven one
    crash: str | None = None  # vLLM's exception where one group of the spec fails to construct
    finding: str | None = None  # the finding filed for that crash (findings/<id>), if any


def registered() -> tuple[dict, dict]:
    """({spec class: manager class}, {group role: manager class}) of the installed release."""
    import_vllm()
    from vllm.v1.core import single_type_kv_cache_manager as stm

    if hasattr(stm, "spec_manager_map"):  # up to 0.22.x
        return dict(stm.spec_manager_map), {}
    from vllm.v1 import kv_cache_spec_registry as registry

    stm.register_all_kvcache_specs(None)
    specs = {spec: meta.manager_class for spec, meta in registry._REGISTRY_KVCACHESPEC_LIST.items()}
    roles = dict(getattr(registry, "_REGISTRY_ROLE_MANAGERS", {}))  # 0.30.0 on
    return specs, roles


def drawn() -> dict:
    """Spec class name -> (group kind, page layout) for every spec the manager target's sampler
    draws on this release."""
    shapes = release_shapes()
    return {
        name: (kind, layout)
        for (kind, layout), name in LAYOUT_SPECS.items()
        if kind in shapes.group_kinds and layout in shapes.page_layouts
    }


def construct(spec_class):
    """vLLM's ``KVCacheManager`` with one group of ``spec_class``, as its engine builds it (the
    keywords this release's constructor takes; one block size, so a release without
    ``scheduler_block_size`` or ``hash_block_size`` derives the value passed here)."""
    v = import_vllm()
    values = field_values(v)
    fields = {f.name: values[f.name] for f in dataclasses.fields(spec_class) if f.init and f.name in values}
    group = v.kvi.KVCacheGroupSpec(["layer0"], spec_class(**fields))
    config = v.kvi.KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[group])
    wanted = dict(
        kv_cache_config=config,
        max_model_len=16 * BLOCK,
        scheduler_block_size=BLOCK,
        hash_block_size=BLOCK,
        enable_caching=True,
    )
    params = accepted(v.KVCacheManager.__init__)
    return v.KVCacheManager(**{name: value for name, value in wanted.items() if name in params})


def construction_crash(spec_class) -> str | None:
    """vLLM's exception, as ``Type: message``, where one group of ``spec_class`` fails to
    construct through its coordinator; None where it constructs."""
    try:
        construct(spec_class)
    except Exception as e:  # noqa: BLE001 - whatever vLLM raises is the find
        return f"{type(e).__name__}: {e}"
    return None


def census() -> list[SpecRow]:
    """Every spec and role manager the installed release registers, driven or not and why."""
    v = import_vllm()
    specs, roles = registered()
    driven = drawn()
    rows = []
    for spec, manager in sorted(specs.items(), key=lambda item: item[0].__name__):
        name = spec.__name__
        if name in driven:
            rows.append(SpecRow(name, manager.__name__, True, ""))
            continue
        crash = construction_crash(spec)
        if crash is None:
            rows.append(SpecRow(name, manager.__name__, False, NOT_DRIVEN.get(name)))
            continue
        finding = FILED.get(name)
        filed = f"finding {finding}" if finding else "no finding filed"
        reason = f"fails to construct in vLLM {v.version} ({filed}): {crash}"
        rows.append(SpecRow(name, manager.__name__, False, reason, crash, finding))
    for role, manager in sorted(roles.items(), key=lambda item: str(item[0])):
        role_name = getattr(role, "value", role)
        reason = f"a manager the group role {role_name!r} selects (host-pool sparse attention): not modelled"
        rows.append(SpecRow(f"role {role_name}", manager.__name__, False, reason))
    return rows
