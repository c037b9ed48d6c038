"""kvprop's groups as the KV cache specs a model's layers declare to vLLM, of the class each
group's kind and the configuration's page layout name.

One place for both vLLM targets (``config`` builds the manager and the scheduler from these
specs) and for the census of specs kvprop drives (``specs``): a layout's spec class is driven
exactly when the sampler draws the layout for the installed release (``release_layouts``).
"""

from __future__ import annotations

from kvprop.allocator.specs import AllocatorConfig, ChunkedLocal, FullAttention, Mamba, SlidingWindow
from kvprop.errors import ConfigError

# (group kind, page layout) -> the vLLM KV cache spec class a model's layer declares for it
# (kvprop.allocator.specs.PAGE_LAYOUTS: a layout leaves the groups of other kinds plain). vLLM's
# registry maps each to the manager of the plain spec of its kind.
LAYOUT_SPECS = {
    ("full", "plain"): "FullAttentionSpec",
    ("full", "mla"): "MLAAttentionSpec",
    ("full", "hidden_state"): "HiddenStateCacheSpec",
    ("full", "quantised"): "TQFullAttentionSpec",
    ("sliding_window", "plain"): "SlidingWindowSpec",
    ("sliding_window", "mla"): "SlidingWindowMLASpec",
    ("chunked_local", "plain"): "ChunkedLocalAttentionSpec",
    ("mamba", "plain"): "MambaSpec",
}
TURBOQUANT = "turboquant_k8v4"  # the TurboQuant cache dtype a quantised layout stands for


def spec_class_name(kind: str, layout: str) -> str:
    """The vLLM spec class a group of ``kind`` declares under ``layout``."""
    return LAYOUT_SPECS.get((kind, layout), LAYOUT_SPECS[(kind, "plain")])


def release_layouts(v) -> frozenset:
    """The page layouts whose spec classes this release has (TurboQuant's up to 0.24.x)."""
    return frozenset(layout for (_, layout), name in LAYOUT_SPECS.items() if name in vars(v.kvi))


def _layout_fields(name: str, v, head_size: int) -> dict:
    """The fields beyond the common ones that vLLM's layers set for spec class ``name``, with a
    served engine's defaults: MLA layers (``MLAAttention.get_kv_cache_spec``) pass the cache
    dtype string ("auto", CacheConfig's default); TurboQuant layers (``Attention.get_kv_cache_spec``
    up to 0.24.x) pass byte pages, the value head size and the slot size of their preset."""
    if name in ("MLAAttentionSpec", "SlidingWindowMLASpec"):
        return {"cache_dtype_str": "auto"}
    if name == "TQFullAttentionSpec":
        from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig

        slot = TurboQuantConfig.from_cache_dtype(TURBOQUANT, head_size).slot_size_aligned
        return {"dtype": v.torch.uint8, "head_size_v": head_size, "tq_slot_size": slot}
    return {}


def vllm_specs(config: AllocatorConfig, v) -> list:
    """kvprop's groups as vLLM KV cache specs, one group per kvprop group, same order, each of
    the class its kind and ``config.page_layout`` name (``LAYOUT_SPECS``).

    vLLM's hybrid coordinator looks groups with equal specs up together (as real models
    with several identical sliding-window groups are) and needs at least two distinct
    specs; when every kvprop group is the same spec, each gets its own head size, which
    only tells the groups apart (the allocator never reads it)."""
    distinct = len(config.groups) > 1 and len(set(config.groups)) == 1
    specs = []
    for g, spec in enumerate(config.groups):
        head_size = 1 + g if distinct else 1
        name = spec_class_name(spec.kind, config.page_layout)
        cls = vars(v.kvi).get(name)
        if cls is None:
            raise ConfigError(
                f"target 'vllm': vLLM {v.version} has no {name} for page_layout {config.page_layout!r}; "
                f"allowed: {sorted(release_layouts(v))}"
            )
        common = dict(block_size=spec.block_size, num_kv_heads=1, head_size=head_size, dtype=v.torch.float32)
        common.update(_layout_fields(name, v, head_size))
        if isinstance(spec, FullAttention):
            specs.append(cls(**common))
        elif isinstance(spec, SlidingWindow):
            specs.append(cls(**common, sliding_window=spec.window))
        elif isinstance(spec, ChunkedLocal):
            specs.append(cls(**common, attention_chunk_size=spec.chunk))
        elif isinstance(spec, Mamba):
            # one state tensor of 1 + g floats (its size only tells groups apart; the allocator
            # never reads it); mamba_cache_mode is the spec's mode, as vLLM's model config sets it
            checkpoints = {}
            if spec.checkpoint is not None:  # (allocator_refusal has refused releases with other rules)
                # what mamba_mixer2, GDN and KDA layers declare (0.33.0)
                checkpoints = dict(num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=spec.checkpoint)
            specs.append(
                cls(
                    block_size=spec.block_size,
                    shapes=((1 + g,),),
                    dtypes=(v.torch.float32,),
                    mamba_cache_mode=spec.mode,
                    num_speculative_blocks=spec.speculative_blocks,
                    **checkpoints,
                )
            )
        else:
            raise ConfigError(f"target 'vllm': no vLLM KV cache spec for group {g}: {spec!r}")
    return specs
