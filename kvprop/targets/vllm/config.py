"""vLLM's own configurations and KV cache specs built from kvprop's, and the manager and scheduler built from them.

Only keyword arguments the installed release's signatures accept are passed (``call_kwargs``),
so the same code builds every release that keeps these calls; one it cannot build is a
``ConfigError`` that says why. The scheduler is built offline and on a CPU: vLLM's
``ModelConfig`` reads the architecture from a ``config.json`` only (a tiny Llama; no weights,
no tokenizer); the cache, scheduler, speculative and transfer configurations are the release's
own classes, otherwise left at its defaults, as its engine leaves them.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import inspect
import json
import os
import shutil
import tempfile

from kvprop.allocator.specs import (
    THINNED_BY_RETENTION,
    AllocatorConfig,
    EngineConfig,
    Mamba,
)
from kvprop.errors import ConfigError
from kvprop.targets.vllm.loading import INSTALL_HINT, import_scheduler, import_vllm
from kvprop.targets.vllm.recipe import Recipe
from kvprop.targets.vllm.releases import allocator_refusal
from kvprop.targets.vllm.spec_classes import vllm_specs

_MODEL_DIRS: dict[int, str] = {}


def accepted(fn) -> dict:
    """Parameter name -> default of ``fn`` (``inspect.Parameter.empty`` when required)."""
    return {name: p.default for name, p in inspect.signature(fn).parameters.items() if name != "self"}


def call_kwargs(what: str, params: dict, kwargs: dict, target: str = "vllm") -> dict:
    """The keyword arguments ``params`` accepts; dropping one is fine only at its neutral value."""
    out = {}
    for name, value in kwargs.items():
        if name in params:
            out[name] = value
        elif value not in (None, 0, False):
            raise ConfigError(
                f"target {target!r}: the installed vLLM's {what} has no parameter {name!r}, "
                f"so it cannot be asked for {name}={value!r}"
            )
    return out


RETENTION_ENV = "VLLM_PREFIX_CACHE_RETENTION_INTERVAL"


def _retention_setting(config: AllocatorConfig, v) -> dict:
    """How this release is told ``config.retention_interval`` (docs/design.md §8.3):
    ``{"field": {...}}`` for ``KVCacheConfig`` (0.30.0 on, where the engine's default is 0),
    ``{"env": {...}}`` for the environment variable the coordinator reads when it is built
    (0.23.0 to 0.25.1, unset by default), or nothing where the value changes nothing. A
    release with no retention cannot thin a sliding window: ConfigError."""
    interval = config.retention_interval
    if "prefix_cache_retention_interval" in {f.name for f in dataclasses.fields(v.kvi.KVCacheConfig)}:
        return {"field": {"prefix_cache_retention_interval": interval}}
    thinned = any(isinstance(spec, THINNED_BY_RETENTION) for spec in config.groups)
    if interval is None or not thinned:
        # 0 with no group to thin changes nothing, and these releases refuse it set at all
        # (0.23.0 thins sliding windows only and refuses a state-only model itself)
        return {}
    from vllm import envs

    if RETENTION_ENV in getattr(envs, "environment_variables", {}):
        return {"env": {RETENTION_ENV: str(interval)}}
    raise ConfigError(
        f"target 'vllm': vLLM {v.version} has no prefix-cache retention (it caches every sliding-window "
        f"and state block), so it cannot be asked for retention_interval={interval}; allowed: None"
    )


@contextlib.contextmanager
def _environment(values: dict):
    """``values`` set in os.environ while the manager is built, then the previous values back."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


def _metrics_collector():
    """vLLM's block residency metrics (``--kv-cache-metrics``) with every block sampled, so what
    they observe does not depend on chance."""
    from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector

    return KVCacheMetricsCollector(1.0)


def build_manager(config: AllocatorConfig):
    """vLLM's ``KVCacheManager`` for ``config``, given what its engine would pass it."""
    v = import_vllm()
    kwargs, env = manager_arguments(config)
    try:
        with _environment(env):
            return v.KVCacheManager(**kwargs)
    except (AssertionError, ValueError, TypeError, NotImplementedError) as e:
        raise ConfigError(
            f"target 'vllm': vLLM {v.version} cannot build an allocator for {config}: {type(e).__name__}: {e}"
        ) from e


def manager_arguments(config: AllocatorConfig) -> tuple[dict, dict]:
    """The keyword arguments ``build_manager`` passes vLLM's ``KVCacheManager`` for ``config``, and
    the environment variables set while it is built: one place, so that a reproducer
    (``kvprop report``) states exactly the manager the target drives."""
    v = import_vllm()
    block_size = config.block_size
    wanted = dict(
        # no request can need more slots than the pool has
        max_model_len=config.num_blocks * block_size,
        scheduler_block_size=block_size,
        hash_block_size=config.unit,
        enable_caching=config.enable_caching,
        enable_kv_cache_events=config.enable_kv_cache_events,
        log_stats=config.log_stats,
        use_eagle=config.eagle,
    )
    params = accepted(v.KVCacheManager.__init__)
    if config.kv_cache_metrics:
        wanted["metrics_collector"] = _metrics_collector()
    if len({spec.block_size for spec in config.groups}) == 1:
        # A release whose KVCacheManager lacks one of these derives it from the
        # kv_cache_config itself, and with one block size B in every group that is B,
        # the value passed here. 0.22.1 (no scheduler_block_size): the coordinator's
        # alignment unit is UnitaryKVCacheCoordinator.block_size =
        # kv_cache_groups[0].kv_cache_spec.block_size (times dcp/pcp world sizes, 1
        # here) and HybridKVCacheCoordinator.lcm_block_size = lcm(*block sizes of the
        # groups) (vllm/v1/core/kv_cache_coordinator.py), where later releases use the
        # scheduler_block_size the engine passes: resolve_kv_cache_block_sizes
        # (vllm/v1/core/kv_cache_utils.py) computes it as that same lcm, and
        # hash_block_size as the gcd of the group block sizes (or the lcm): B and B.
        # With unequal block sizes nothing is dropped, so a missing one is a ConfigError.
        for name in ("scheduler_block_size", "hash_block_size"):
            if name not in params:
                del wanted[name]
    why = allocator_refusal(config)
    if why is not None:
        raise ConfigError(f"target 'vllm': vLLM {v.version} takes {why}")
    missing = [
        n for n, d in params.items() if d is inspect.Parameter.empty and n not in wanted and n != "kv_cache_config"
    ]
    if missing:
        raise ConfigError(
            f"target 'vllm': vLLM {v.version}'s KVCacheManager needs {missing}, which kvprop cannot supply"
        )
    retention = _retention_setting(config, v)
    try:
        kv_cache_config = v.kvi.KVCacheConfig(
            num_blocks=config.num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[v.kvi.KVCacheGroupSpec([f"layer{g}"], s) for g, s in enumerate(vllm_specs(config, v))],
            **retention.get("field", {}),
        )
    except (AssertionError, ValueError, TypeError, NotImplementedError) as e:
        raise ConfigError(
            f"target 'vllm': vLLM {v.version} cannot build an allocator for {config}: {type(e).__name__}: {e}"
        ) from e
    wanted["kv_cache_config"] = kv_cache_config
    return call_kwargs("KVCacheManager()", params, wanted), retention.get("env", {})


def tiny_model(vocab: int) -> dict:
    """The ``config.json`` of a tiny Llama: vLLM's ``ModelConfig`` reads the architecture from it."""
    return {
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


def _model_dir(vocab: int) -> str:
    """A directory holding only ``tiny_model``'s ``config.json``; no weights and no tokenizer are
    ever loaded. Removed at exit."""
    path = _MODEL_DIRS.get(vocab)
    if path is None:
        path = _MODEL_DIRS[vocab] = tempfile.mkdtemp(prefix="kvprop-vllm-model-")
        atexit.register(shutil.rmtree, path, True)
        with open(f"{path}/config.json", "w") as f:
            json.dump(tiny_model(vocab), f)
    return path


def _build(recipe: Recipe, name: str, cls, what: str, **wanted):
    """``cls(**wanted)`` with only the keyword arguments this release's ``cls`` accepts; one it
    lacks is dropped only at its neutral value (as the manager target's calls)."""
    return recipe.make(name, cls, **call_kwargs(what, accepted(cls), wanted, target="vllm-scheduler"))


def _tensor(v, layer: str, page: int, num_blocks: int, recipe: Recipe):
    """One layer's KV cache tensor of ``num_blocks`` pages: ``shared_by`` up to 0.25.x; from 0.30.0
    a placement (layer-outermost: the layer's pages in a row). A reproducer states it as
    ``tensor(layer, page, num_blocks)``, which makes the same choice."""
    size = page * num_blocks
    if "shared_by" in inspect.signature(v.kvi.KVCacheTensor).parameters:
        made = v.kvi.KVCacheTensor(size=size, shared_by=[layer])
    else:
        made = v.kvi.KVCacheTensor(size=size, layers=[layer], layer_stride=size, block_stride=page)
    recipe.express(made, f"tensor({layer!r}, {page!r}, {num_blocks!r})")
    return made


def _cpu_block_bytes(page: int) -> int:
    """What one chunk of ``page`` bytes takes in vLLM's CPU tier, rounded up to the CPU spec's
    alignment (from 0.30.0 a memory page, ``SharedOffloadRegion``; 1 before)."""
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    align = int(getattr(CPUOffloadingSpec, "BLOCK_SIZE_ALIGNMENT", 1))
    return -(-page // align) * align


def _core_configs(config: EngineConfig, vc, max_len: int, recipe: Recipe):
    """vLLM's model, cache and scheduler configurations for ``config``, each validating itself as
    it is built (a tiny Llama stands for the model: its size matters to nothing kvprop drives)."""
    alloc = config.allocator
    bs = alloc.block_size
    modes = {spec.mode for spec in alloc.groups if isinstance(spec, Mamba)}
    recipe.model_dir, recipe.model = _model_dir(config.vocab), tiny_model(config.vocab)
    model = _build(
        recipe,
        "model_config",
        vc.ModelConfig,
        "ModelConfig",
        model=_model_dir(config.vocab),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=max_len,
    )
    cache = _build(
        recipe,
        "cache_config",
        vc.CacheConfig,
        "CacheConfig",
        block_size=bs,
        enable_prefix_caching=alloc.enable_caching,
        **({"mamba_cache_mode": modes.pop()} if modes else {}),
    )
    recipe.assign(cache, "num_gpu_blocks", alloc.num_blocks)
    scheduler_config = _build(
        recipe,
        "scheduler_config",
        vc.SchedulerConfig,
        "SchedulerConfig",
        # kvprop's limit where it sets one (vLLM refuses one above the token budget), else the
        # default's 128 within the budget
        max_num_seqs=config.max_num_seqs or min(config.token_budget, 128),
        max_num_batched_tokens=config.token_budget,
        max_model_len=max_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        # the pipelined scheduler with batches in flight (kvprop.sim.pipeline), else the synchronous one
        async_scheduling=config.pipeline_depth > 1,
    )
    return model, cache, scheduler_config


def check_startup(config: EngineConfig) -> None:
    """vLLM's own start-up checks for the manager target, which builds vLLM's manager alone: the
    configurations validate themselves as they are built, and ``VllmConfig.validate_block_size``
    runs as ``EngineCore._initialize_kv_caches`` runs it before any scheduling (0.24.0
    ``v1/engine/core.py:318``). A ConfigError names what vLLM refuses: a refused configuration,
    never a find. kvprop's own scheduler and connector stand in for vLLM's, so neither is built."""
    s = import_scheduler()
    v, vc, alloc = s.v, s.config, config.allocator
    max_len = max(1, alloc.block_size * (alloc.usable_blocks // len(alloc.groups)))
    try:
        model, cache, scheduler_config = _core_configs(config, vc, max_len, Recipe())
        vllm_config = vc.VllmConfig(
            model_config=model,
            cache_config=cache,
            scheduler_config=scheduler_config,
            device_config=vc.DeviceConfig(device="cpu"),
        )
        vllm_config.validate_block_size()
    except ModuleNotFoundError as e:
        raise ConfigError(f"target 'vllm': vLLM {v.version} needs {e.name!r}; {INSTALL_HINT}") from e
    except (AssertionError, ValueError, TypeError) as e:
        raise ConfigError(f"target 'vllm': vLLM {v.version} refuses to start with {config}: {e}") from e


def build_scheduler(config: EngineConfig, recipe: Recipe | None = None):
    """vLLM's ``Scheduler`` for ``config``, configured as vLLM's engine configures it for this
    release (synchronous scheduling: the engine's other mode overlaps steps, not modelled).
    Every vLLM object is made through ``recipe``, which keeps the calls (``kvprop report``)."""
    recipe = recipe if recipe is not None else Recipe()
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
    if alloc.page_layout != "plain":  # (scheduler_shapes)
        raise ConfigError(
            f"target 'vllm-scheduler': page_layout must be 'plain': the scheduler's model is a tiny Llama, whose "
            f"layers declare plain attention specs, got {alloc.page_layout!r}"
        )
    retention = _retention_setting(alloc, v)
    try:
        model, cache, scheduler_config = _core_configs(config, vc, max_len, recipe)
        extra = {}
        if config.speculative_tokens:
            # n-gram drafting: drafts come from the worker after each step, no lookahead slots
            extra["speculative_config"] = _build(
                recipe,
                "speculative_config",
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
            # CPU tier holds tier_blocks blocks of the GPU tensors' bytes, by default twice the
            # GPU pool, in chunks of tier_chunk blocks (its num_chunks: the bytes over one
            # chunk's, v1/kv_offload/cpu/spec.py).
            page = [spec.page_size_bytes for spec in vllm_specs(alloc, v)]
            tensors = [_tensor(v, f"layer{g}", bytes_, alloc.num_blocks, recipe) for g, bytes_ in enumerate(page)]
            chunk = config.tier_chunk
            chunks = (config.tier_blocks or 2 * alloc.num_blocks) // chunk
            extra["kv_transfer_config"] = _build(
                recipe,
                "kv_transfer_config",
                vc.KVTransferConfig,
                "KVTransferConfig",
                kv_connector="OffloadingConnector",
                kv_role="kv_both",
                kv_connector_extra_config={
                    "cpu_bytes_to_use": chunks * _cpu_block_bytes(chunk * sum(page)),
                    "eviction_policy": config.tier_policy,
                    **({"blocks_per_chunk": chunk} if chunk > 1 else {}),
                },
                kv_load_failure_policy=config.load_failure_policy,
            )
        if config.pipeline_depth > 2:  # its pipeline stages are set once it is validated (_pipeline)
            extra["parallel_config"] = recipe.make("parallel_config", vc.ParallelConfig)
        if alloc.enable_kv_cache_events:
            extra["kv_events_config"] = recipe.make(
                "kv_events_config", vc.KVEventsConfig, enable_kv_cache_events=True, publisher="null"
            )
        if alloc.kv_cache_metrics:  # block residency metrics, every block sampled
            extra["observability_config"] = _build(
                recipe,
                "observability_config",
                vc.ObservabilityConfig,
                "ObservabilityConfig",
                kv_cache_metrics=True,
                kv_cache_metrics_sample=1.0,
            )
        vllm_config = recipe.make(
            "vllm_config",
            vc.VllmConfig,
            model_config=model,
            cache_config=cache,
            scheduler_config=scheduler_config,
            device_config=recipe.make("device_config", vc.DeviceConfig, device="cpu"),
            **extra,
        )
        _pipeline(config, vllm_config, recipe)
        kv_cache_config = recipe.make(
            "kv_cache_config",
            v.kvi.KVCacheConfig,
            num_blocks=alloc.num_blocks,
            kv_cache_tensors=tensors,
            kv_cache_groups=[
                v.kvi.KVCacheGroupSpec([f"layer{g}"], spec) for g, spec in enumerate(vllm_specs(alloc, v))
            ],
            **retention.get("field", {}),
        )
        # The engine's own start-up check between sizing the KV cache and building the scheduler
        # (EngineCore._initialize_kv_caches: 0.24.0 v1/engine/core.py:318): before 0.30.0 it
        # refuses a state group in mode "align" whose block is wider than the token budget (PR #34445)
        recipe.assign(cache, "block_size", bs)
        try:
            recipe.check(vllm_config, "validate_block_size")
        except AssertionError as e:
            raise ConfigError(f"target 'vllm-scheduler': vLLM {v.version} refuses to start with {config}: {e}") from e
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
        recipe.env = retention.get("env", {})
        with _environment(recipe.env):
            return recipe.make(
                "scheduler",
                s.AsyncScheduler if config.pipeline_depth > 1 else s.Scheduler,
                vllm_config=vllm_config,
                kv_cache_config=kv_cache_config,
                structured_output_manager=recipe.make(
                    "structured_output_manager", s.StructuredOutputManager, vllm_config
                ),
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


def _pipeline(config: EngineConfig, vllm_config, recipe: Recipe) -> None:
    """The batches a served engine keeps in flight (``batches_in_flight``): with asynchronous
    scheduling, one more than its pipeline stages in 0.34.0 (two stages for depth 3), as many as
    its stages with the V1 model runner before (three). A GPU server's start-up leaves asynchronous scheduling on (its
    executor supports it, ``VllmConfig.__post_init__``); the CPU platform turns it off and a
    second stage needs a second device, so both are set here after validation, as vLLM's own
    CPU tests set them (``tests/v1/core/test_deferred_block_free.py``)."""
    depth = config.pipeline_depth
    if depth == 1:
        return
    recipe.assign(vllm_config.scheduler_config, "async_scheduling", True)
    # the stages that give ``depth`` by the release's own rule: one fewer (its model runner V2,
    # 0.34.0's every runner) or as many (the V1 runner before 0.34.0, 0.22.1's executor)
    batches = batches_in_flight(vllm_config)
    for stages in (depth - 1, depth) if depth > 2 else ():
        recipe.assign(vllm_config.parallel_config, "pipeline_parallel_size", stages)
        batches = batches_in_flight(vllm_config)
        if batches == depth:
            break
    if batches != depth:
        raise ConfigError(
            f"target 'vllm-scheduler': this vLLM keeps {batches} batches in flight with asynchronous "
            f"scheduling and {vllm_config.parallel_config.pipeline_parallel_size} pipeline stages, "
            f"not pipeline_depth={depth}"
        )


def batches_in_flight(vllm_config) -> int:
    """The batches the engine core keeps in flight: ``VllmConfig.max_concurrent_batches`` (0.23.0
    on); before, the executor's (``vllm/v1/executor/multiproc_executor.py``, 0.22.1): two with
    asynchronous scheduling on one stage, else one per pipeline stage."""
    if hasattr(type(vllm_config), "max_concurrent_batches"):
        return vllm_config.max_concurrent_batches
    stages = vllm_config.parallel_config.pipeline_parallel_size
    return 2 if stages <= 1 and vllm_config.scheduler_config.async_scheduling else stages
