"""Building vLLM's own ``Scheduler`` for a kvprop configuration, offline and on a CPU.

vLLM's ``ModelConfig`` reads the architecture from a ``config.json`` only (a tiny Llama; no
weights, no tokenizer); the cache, scheduler, speculative and transfer configurations are
the release's own classes, given only the keyword arguments the installed release accepts,
and otherwise left at its defaults, as its engine leaves them. ``refusal`` says which shapes
the scheduler target cannot drive, before anything is built.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import json
import shutil
import tempfile
from types import SimpleNamespace

import attrs

from kvprop.allocator.specs import AllocatorConfig, ChunkedLocal, EngineConfig, FullAttention, Mamba
from kvprop.capabilities import Shapes
from kvprop.errors import ConfigError
from kvprop.targets.vllm.manager import (
    INSTALL_HINT,
    _accepted,
    _call_kwargs,
    _environment,
    _import_vllm,
    _retention_setting,
    allocator_refusal,
    importing_vllm,
    vllm_specs,
)

_SCHED = None
_MODEL_DIRS: dict[int, str] = {}


def import_scheduler() -> SimpleNamespace:
    """vLLM's scheduler API, imported once; a missing piece is a ConfigError that says how to get it."""
    global _SCHED
    if _SCHED is not None:
        return _SCHED
    v = _import_vllm()
    with importing_vllm("vllm-scheduler", "vLLM's scheduler"):
        from vllm import config as vc
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput
        from vllm.v1.request import RequestStatus
        from vllm.v1.structured_output import StructuredOutputManager
    _SCHED = SimpleNamespace(
        v=v,
        config=vc,
        Scheduler=Scheduler,
        DraftTokenIds=DraftTokenIds,
        KVConnectorOutput=KVConnectorOutput,
        ModelRunnerOutput=ModelRunnerOutput,
        # up to 0.33.0 an output maps each request id to its row; 0.34.0 reads the rows' order
        indexed_outputs="req_id_to_index" in _accepted(ModelRunnerOutput),
        RequestStatus=RequestStatus,
        StructuredOutputManager=StructuredOutputManager,
    )
    return _SCHED


def _model_dir(vocab: int) -> str:
    """A directory holding only the ``config.json`` of a tiny Llama: vLLM's ``ModelConfig`` reads
    the architecture from it; no weights and no tokenizer are ever loaded. Removed at exit."""
    path = _MODEL_DIRS.get(vocab)
    if path is None:
        path = _MODEL_DIRS[vocab] = tempfile.mkdtemp(prefix="kvprop-vllm-model-")
        atexit.register(shutil.rmtree, path, True)
        tiny = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "num_hidden_layers": 2,
            "vocab_size": max(vocab, 32),
            "max_position_embeddings": 1 << 20,
            "rms_norm_eps": 1e-5,
            "torch_dtype": "float32",
        }
        with open(f"{path}/config.json", "w") as f:
            json.dump(tiny, f)
    return path


def _build(cls, what: str, **wanted):
    """``cls(**wanted)`` with only the keyword arguments this release's ``cls`` accepts; one it
    lacks is dropped only at its neutral value (as the manager target's calls)."""
    return cls(**_call_kwargs(what, _accepted(cls), wanted, target="vllm-scheduler"))


def _tensor(v, layer: str, page: int, num_blocks: int):
    """One layer's KV cache tensor of ``num_blocks`` pages: ``shared_by`` up to 0.25.x; from 0.30.0
    a placement (layer-outermost: the layer's pages in a row)."""
    if "shared_by" in inspect.signature(v.kvi.KVCacheTensor).parameters:
        return v.kvi.KVCacheTensor(size=page * num_blocks, shared_by=[layer])
    size = page * num_blocks
    return v.kvi.KVCacheTensor(size=size, layers=[layer], layer_stride=size, block_stride=page)


def _cpu_block_bytes(page: int) -> int:
    """What one block takes in vLLM's CPU tier: its pages, rounded up to the CPU spec's alignment
    (from 0.30.0 a memory page, ``SharedOffloadRegion``; 1 before)."""
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    align = int(getattr(CPUOffloadingSpec, "BLOCK_SIZE_ALIGNMENT", 1))
    return -(-page // align) * align


def scheduler_shapes() -> Shapes:
    """The shapes kvprop drives through this release's scheduler (``refusal`` says why each
    other one is refused): the manager's, less lookahead slots and the EAGLE drop, with a token
    budget for the drafts, and a state group beside a connector where the release takes one."""
    from kvprop.targets.vllm.manager import release_shapes

    import_scheduler()  # without vLLM, the ConfigError that says how to get it
    return attrs.evolve(
        release_shapes(),
        lookahead=False,
        eagle=False,
        drafts_within_budget=True,
        state_with_connector=_takes_connector_with_state_groups(),
        local_with_connector=_builds(_LOCAL_WITH_CONNECTOR),
    )


# A chunked-local group beside the offloading connector: 0.24.0's connector asserts every
# group is full attention or a window (``get_sliding_window_size_in_blocks``); 0.34.0 takes it.
_LOCAL_WITH_CONNECTOR = EngineConfig(
    AllocatorConfig((ChunkedLocal(4, 8), FullAttention(4)), 16), token_budget=8, connector="async"
)


def _builds(config: EngineConfig) -> bool:
    """Whether this release's own start-up builds a scheduler for ``config``: its validation
    called, not re-implemented."""
    try:
        build_scheduler(config)
    except ConfigError:
        return False
    return True


def refusal(config: EngineConfig) -> str | None:
    """Why this target cannot run ``config`` yet, or None."""
    if config.lookahead:
        return (
            f"lookahead slots are not driven through vLLM's scheduler (lookahead={config.lookahead}; allowed: 0): "
            "vLLM derives them from an EAGLE drafter's own forward pass, which kvprop does not model"
        )
    if config.speculative_tokens and config.token_budget < 1 + config.speculative_tokens:
        # vLLM pads (0.30.0 on) a request whose hit leaves one token to 1 + K rows and, when they
        # do not fit the step's budget, schedules nothing rather than one row: with a budget under
        # 1 + K such a request waits forever (README, the scheduler target's finds)
        return (
            f"with {config.speculative_tokens} drafts vLLM's scheduler needs a token budget of at least "
            f"{1 + config.speculative_tokens} (token_budget={config.token_budget})"
        )
    if config.allocator.eagle:
        return (
            "the EAGLE drop is not driven through vLLM's scheduler (eagle must be False): it drafts by "
            "n-grams here, and an EAGLE or MTP drafter needs a draft model's configuration"
        )
    if config.connector != "off" and any(isinstance(spec, Mamba) for spec in config.allocator.groups):
        if not _takes_connector_with_state_groups():
            return "this vLLM's scheduler does not take a KV connector with a Mamba group (it asserts so)"
    why = allocator_refusal(config.allocator)
    return None if why is None else f"this vLLM takes {why}"


@functools.cache
def _takes_connector_with_state_groups() -> bool:
    """0.22.1 asserts in ``_mamba_block_aligned_split`` that no external tokens reach a state group
    ("External KV connector is not verified yet"). The release's source is read as text, once."""
    split = inspect.getsource(import_scheduler().Scheduler._mamba_block_aligned_split)
    return "External KV connector is not verified yet" not in split


def build_scheduler(config: EngineConfig):
    """vLLM's ``Scheduler`` for ``config``, configured as vLLM's engine configures it for this
    release (synchronous scheduling: the engine's other mode overlaps steps, not modelled)."""
    s = import_scheduler()
    v, vc, alloc = s.v, s.config, config.allocator
    bs = alloc.block_size
    # vLLM's engine refuses to start unless the KV cache holds one request of max_model_len
    # (check_enough_kv_cache_memory): the longest request all groups' blocks fit, as kvprop's
    # add_request bounds it. A longer one would let the scheduler pad a decode past what the
    # pool can ever give it.
    scratch = sum(spec.speculative_blocks for spec in alloc.groups if isinstance(spec, Mamba))
    max_len = bs * ((alloc.usable_blocks - scratch) // len(alloc.groups))
    if max_len < 1:
        raise ConfigError(f"target 'vllm-scheduler': {alloc.usable_blocks} usable blocks hold no request of {alloc}")
    modes = {spec.mode for spec in alloc.groups if isinstance(spec, Mamba)}
    retention = _retention_setting(alloc, v)
    try:
        model = _build(
            vc.ModelConfig,
            "ModelConfig",
            model=_model_dir(config.vocab),
            skip_tokenizer_init=True,
            dtype="float32",
            max_model_len=max_len,
        )
        cache = _build(
            vc.CacheConfig,
            "CacheConfig",
            block_size=bs,
            enable_prefix_caching=alloc.enable_caching,
            **({"mamba_cache_mode": modes.pop()} if modes else {}),
        )
        cache.num_gpu_blocks = alloc.num_blocks
        scheduler_config = _build(
            vc.SchedulerConfig,
            "SchedulerConfig",
            max_num_seqs=min(config.token_budget, 128),
            max_num_batched_tokens=config.token_budget,
            max_model_len=max_len,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
            async_scheduling=False,
        )
        extra = {}
        if config.speculative_tokens:
            # n-gram drafting: drafts come from the worker after each step, no lookahead slots
            extra["speculative_config"] = _build(
                vc.SpeculativeConfig,
                "SpeculativeConfig",
                method="ngram",
                num_speculative_tokens=config.speculative_tokens,
                prompt_lookup_max=config.speculative_tokens,
                prompt_lookup_min=1,
            )
        tensors = []
        if config.connector != "off":
            # vLLM's native CPU offloading, scheduler side; the worker side is kvprop's. The
            # CPU tier is sized from the GPU tensors' bytes per block: twice the GPU pool.
            page = [spec.page_size_bytes for spec in vllm_specs(alloc, v)]
            tensors = [_tensor(v, f"layer{g}", bytes_, alloc.num_blocks) for g, bytes_ in enumerate(page)]
            extra["kv_transfer_config"] = _build(
                vc.KVTransferConfig,
                "KVTransferConfig",
                kv_connector="OffloadingConnector",
                kv_role="kv_both",
                kv_connector_extra_config={"cpu_bytes_to_use": 2 * alloc.num_blocks * _cpu_block_bytes(sum(page))},
                kv_load_failure_policy=config.load_failure_policy,
            )
        if alloc.enable_kv_cache_events:
            extra["kv_events_config"] = vc.KVEventsConfig(enable_kv_cache_events=True, publisher="null")
        if alloc.kv_cache_metrics:  # block residency metrics, every block sampled
            extra["observability_config"] = _build(
                vc.ObservabilityConfig, "ObservabilityConfig", kv_cache_metrics=True, kv_cache_metrics_sample=1.0
            )
        vllm_config = vc.VllmConfig(
            model_config=model,
            cache_config=cache,
            scheduler_config=scheduler_config,
            device_config=vc.DeviceConfig(device="cpu"),
            **extra,
        )
        kv_cache_config = v.kvi.KVCacheConfig(
            num_blocks=alloc.num_blocks,
            kv_cache_tensors=tensors,
            kv_cache_groups=[
                v.kvi.KVCacheGroupSpec([f"layer{g}"], spec) for g, spec in enumerate(vllm_specs(alloc, v))
            ],
            **retention.get("field", {}),
        )
        units = {}
        if alloc.partial_hits:
            # what the engine passes from prefix_match_unit (resolve_kv_cache_block_sizes, 0.30.0 on);
            # a release whose hits inside a block follow other rules is refused before (refusal)
            if "hash_block_size" not in inspect.signature(s.Scheduler).parameters:
                raise ConfigError(
                    f"target 'vllm-scheduler': vLLM {v.version} takes no hash_unit below the block size here: "
                    f"its scheduler has no hash_block_size; hash_unit must be None or the block size, "
                    f"got {alloc.hash_unit}"
                )
            units["hash_block_size"] = alloc.unit
        with _environment(retention.get("env", {})):
            return s.Scheduler(
                vllm_config=vllm_config,
                kv_cache_config=kv_cache_config,
                structured_output_manager=s.StructuredOutputManager(vllm_config),
                block_size=bs,
                log_stats=alloc.log_stats,
                **units,
            )
    except ConfigError:
        raise
    except ModuleNotFoundError as e:
        raise ConfigError(f"target 'vllm-scheduler': vLLM {v.version} needs {e.name!r}; {INSTALL_HINT}") from e
    except (AssertionError, ValueError, TypeError, NotImplementedError) as e:
        raise ConfigError(
            f"target 'vllm-scheduler': vLLM {v.version} cannot build a scheduler for {config}: "
            f"{type(e).__name__}: {str(e)[:400]}"
        ) from e
