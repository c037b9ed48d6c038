"""The KV cache specs a vLLM release registers, and which of them kvprop drives.

Read from the installed release, never listed by hand: up to 0.22.x the module dict
``spec_manager_map`` (``vllm/v1/core/single_type_kv_cache_manager.py``, exact-type lookup);
from 0.23.0 ``KVCacheSpecRegistry`` (``vllm/v1/kv_cache_spec_registry.py``), which
``register_all_kvcache_specs`` fills (it is idempotent, and called here rather than left to the
registry's lazy path, which skips the built-in specs once anything else registered first); from
0.30.0 also managers chosen by a group's role (``register_role_manager``). The registry offers
no listing call, so its module dicts are read.

kvprop's side is two declarations: the specs its group kinds map to (``DRIVEN``,
``kvprop.targets.vllm.config.vllm_specs``) and, for every other spec a release registers, why
it is not driven (``NOT_DRIVEN``). A registered spec in neither is a spec kvprop has not
looked at: ``census`` gives it no reason, and the tests fail on it.
"""

from __future__ import annotations

import attrs

from kvprop.targets.vllm.loading import import_vllm

# vLLM spec class -> the kvprop group kind that maps to it
DRIVEN = {
    "FullAttentionSpec": "full",
    "SlidingWindowSpec": "sliding_window",
    "ChunkedLocalAttentionSpec": "chunked_local",
    "MambaSpec": "mamba",
}
SAME_AS_FULL = "managed by FullAttentionManager as FullAttentionSpec is; kvprop draws full attention as that spec"
NOT_DRIVEN = {
    "MLAAttentionSpec": SAME_AS_FULL + " (MLA changes the page layout, not the allocator)",
    "HiddenStateCacheSpec": SAME_AS_FULL + " (a cache of hidden states, allocated as attention is)",
    "TQFullAttentionSpec": SAME_AS_FULL + " (a quantised page layout)",
    "SlidingWindowMLASpec": "managed by SlidingWindowManager as SlidingWindowSpec is, which kvprop draws",
    "CrossAttentionSpec": "encoder-decoder cross attention: needs encoder inputs kvprop's requests do not have",
    "SinkFullAttentionSpec": "attention sinks: kvprop does not model sink tokens",
    "HiSparseHotSpec": "host-pool sparse attention (HiSparse): a host-memory tier kvprop does not model",
    "HiSparseResidentSpec": "host-pool sparse attention (HiSparse): a host-memory tier kvprop does not model",
    "CircularBufferSpec": "a ring buffer of one block per request, never prefix-cached",
    "KpoolTailSpec": "a ring of index-key tail blocks, never prefix-cached",
    "RSWASpec": "retained-prefix windows (the prompt kept plus a decode window): not modelled in kvprop's allocator",
}


@attrs.frozen
class SpecRow:
    spec: str  # the spec class, or "role <name>" for a manager chosen by group role
    manager: str
    driven: bool
    reason: str | None  # for a spec not driven, why (None: kvprop records no reason); "" for a driven one


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


def census() -> list[SpecRow]:
    """Every spec and role manager the installed release registers, driven or not and why."""
    specs, roles = registered()
    rows = []
    for spec, manager in sorted(specs.items(), key=lambda item: item[0].__name__):
        name = spec.__name__
        reason = "" if name in DRIVEN else NOT_DRIVEN.get(name)
        rows.append(SpecRow(name, manager.__name__, name in DRIVEN, reason))
    for role, manager in sorted(roles.items(), key=lambda item: str(item[0])):
        role_name = getattr(role, "value", role)
        reason = f"a manager the group role {role_name!r} selects (host-pool sparse attention): not modelled"
        rows.append(SpecRow(f"role {role_name}", manager.__name__, False, reason))
    return rows
