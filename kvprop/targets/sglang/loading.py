"""SGLang's API, imported once per process: a missing SGLang, or a release kvprop does not
drive, is a ConfigError that says what to do.

What SGLang needs before its scheduler objects work outside a server is set here, once:

* ``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE=1`` (unless the user set it), so that SGLang's own
  idle leak check raises instead of logging a warning;
* the server arguments its code reads through the runtime context (``get_spec()``,
  ``get_serving()``, ...), published with ``RuntimeContext.override_server_args``, the entry point
  ``sglang/srt/runtime_context.py`` names for tests (``publish``);
* a real ``ModelConfig`` (``ScheduleBatch.init_new`` reads ``vocab_size``, ``prepare_for_extend``
  ``is_encoder_decoder``), read from a tiny Llama ``config.json`` written to a temporary directory
  that is removed at exit: no weights, no tokenizer, no network.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
import warnings
from types import SimpleNamespace

from kvprop.errors import ConfigError

INSTALL_HINT = (
    "build a CPU-only SGLang environment with `make sglang-env SGLANG_VERSION=0.5.23` "
    "(scripts/sglang-env.sh VERSION DIR) and run kvprop with that environment's python"
)
OLDEST = (0, 5, 18)
NEWEST = (0, 5, 23)
SUPPORTED = "0.5.18 to 0.5.23"
VOCAB = 1000

_SGLANG: SimpleNamespace | None = None
_PUBLISHED: tuple | None = None
_OVERRIDE = None
_ARGS = None
_MODEL_DIR: str | None = None


def release_tuple(version: str) -> tuple[int, int, int]:
    """``"0.5.23"`` or ``"0.5.23.post1"`` -> ``(0, 5, 23)``; anything else is a ConfigError."""
    parts = version.split(".")
    try:
        return (int(parts[0]), int(parts[1]), int(parts[2]))
    except (IndexError, ValueError):
        raise ConfigError(
            f"target 'sglang': cannot read SGLang's version {version!r}; supported: {SUPPORTED}"
        ) from None


def check_release(version: str) -> tuple[int, int, int]:
    """The release as a tuple, or a ConfigError naming the range kvprop drives."""
    release = release_tuple(version)
    if not OLDEST <= release <= NEWEST:
        raise ConfigError(
            f"target 'sglang': SGLang {version} is outside the releases kvprop drives ({SUPPORTED}); {INSTALL_HINT}"
        )
    return release


def tiny_model() -> dict:
    """The ``config.json`` of a one-layer Llama: SGLang's ``ModelConfig`` reads only the architecture."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def _model_dir() -> str:
    """A directory holding only ``tiny_model``'s ``config.json``. Removed at exit."""
    global _MODEL_DIR
    if _MODEL_DIR is None:
        _MODEL_DIR = tempfile.mkdtemp(prefix="kvprop-sglang-model-")
        atexit.register(shutil.rmtree, _MODEL_DIR, True)
        with open(os.path.join(_MODEL_DIR, "config.json"), "w") as f:
            json.dump(tiny_model(), f)
    return _MODEL_DIR


def import_sglang() -> SimpleNamespace:
    """SGLang's scheduler and KV-cache API, imported once; ConfigError when absent or unsupported."""
    global _SGLANG
    if _SGLANG is not None:
        return _SGLANG
    os.environ.setdefault("SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # import-time notices about CUDA-only quantisation methods
        try:
            from importlib.metadata import version

            release = check_release(version("sglang"))
            from sglang.srt.configs.model_config import ModelConfig
            from sglang.srt.disaggregation.utils import DisaggregationMode, prepare_abort
            from sglang.srt.environ import envs
            from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req, ReqKvInfo, ScheduleBatch
            from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder, SchedulePolicy
            from sglang.srt.managers.scheduler_components import pool_stats_observer
            from sglang.srt.managers.scheduler_components.invariant_checker import SchedulerInvariantChecker
            from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import NewTokenRatioTracker
            from sglang.srt.managers.scheduler_components.pool_stats_observer import SchedulerPoolStatsObserver
            from sglang.srt.mem_cache import base_prefix_cache, common
            from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator, paged
            from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
            from sglang.srt.mem_cache.cache_init_params import CacheInitParams
            from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
            from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache
            from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
            from sglang.srt.runtime_context import get_context
            from sglang.srt.sampling.sampling_params import SamplingParams
            from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
        except ImportError as e:
            raise ConfigError(
                f"target 'sglang' needs SGLang importable, but importing it failed ({e}); {INSTALL_HINT}"
            ) from e
    import torch

    _SGLANG = SimpleNamespace(
        version=version("sglang"),
        release=release,
        torch=torch,
        ModelConfig=ModelConfig,
        DisaggregationMode=DisaggregationMode,
        envs=envs,
        prepare_abort=prepare_abort,
        FINISH_ABORT=FINISH_ABORT,
        Req=Req,
        ReqKvInfo=ReqKvInfo,
        ScheduleBatch=ScheduleBatch,
        AddReqResult=AddReqResult,
        PrefillAdder=PrefillAdder,
        SchedulePolicy=SchedulePolicy,
        SchedulerInvariantChecker=SchedulerInvariantChecker,
        NewTokenRatioTracker=NewTokenRatioTracker,
        SchedulerPoolStatsObserver=SchedulerPoolStatsObserver,
        pool_stats_observer=pool_stats_observer,
        base_prefix_cache=base_prefix_cache,
        common=common,
        paged=paged,
        PagedTokenToKVPoolAllocator=PagedTokenToKVPoolAllocator,
        TokenToKVPoolAllocator=TokenToKVPoolAllocator,
        SWATokenToKVPoolAllocator=SWATokenToKVPoolAllocator,
        CacheInitParams=CacheInitParams,
        MHATokenToKVPool=MHATokenToKVPool,
        ReqToTokenPool=ReqToTokenPool,
        TreeCacheBuildContext=TreeCacheBuildContext,
        create_tree_cache=create_tree_cache,
        SWAKVPool=SWAKVPool,
        get_context=get_context,
        SamplingParams=SamplingParams,
        SpeculativeAlgorithm=SpeculativeAlgorithm,
        model_config=None,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _SGLANG.model_config = ModelConfig(_model_dir(), dtype="float32")
    return _SGLANG


def publish(**fields):
    """SGLang's server arguments with ``fields`` set, published in its runtime context.

    The context is one per process; a scheduler publishes its own fields before each of its
    operations, and this installs a new override only when they differ from the published one
    (the previous override is restored first, so overrides never pile up)."""
    global _PUBLISHED, _OVERRIDE, _ARGS
    key = tuple(sorted(fields.items()))
    if key == _PUBLISHED:
        return _ARGS
    sg = import_sglang()
    if _OVERRIDE is not None:
        _OVERRIDE.restore()
    _OVERRIDE = sg.get_context().override_server_args(**fields)
    _ARGS = _OVERRIDE.install()
    _PUBLISHED = key
    return _ARGS
