"""vLLM's API, imported once per process and quietly: a missing vLLM is a ConfigError that says how to get one.

Both targets import vLLM only here, when they are first built (in a supervised worker), so that
kvprop itself imports without vLLM and every module of this package can be read without it.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import warnings
from types import SimpleNamespace

from kvprop.errors import ConfigError

INSTALL_HINT = (
    "build a CPU-only vLLM environment with `make vllm-env VLLM_VERSION=0.24.0` "
    "(scripts/vllm-env.sh VERSION DIR) and run kvprop with that environment's python"
)

_VLLM = None


@contextlib.contextmanager
def importing_vllm(target: str, what: str):
    """vLLM's modules imported with their import-time warnings silenced; a missing piece is a
    ConfigError that names ``target`` and says how to get it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            yield
        except ImportError as e:
            raise ConfigError(
                f"target {target!r} needs {what} importable, but importing it failed ({e}); {INSTALL_HINT}"
            ) from e


def import_vllm() -> SimpleNamespace:
    """vLLM's allocator API, imported once; a missing vLLM is a ConfigError that says how to install it."""
    global _VLLM
    if _VLLM is not None:
        return _VLLM
    # vLLM logs a warning for every refused reset_prefix_cache; requests warns about an
    # optional dependency at import. Neither is a finding. A user's own settings win: their
    # VLLM_LOGGING_LEVEL is the level applied after import, and a user who configures
    # vLLM's logging themselves (a config file, or VLLM_CONFIGURE_LOGGING=0) is left alone.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    own_logging = os.environ.get("VLLM_LOGGING_CONFIG_PATH") or os.environ.get("VLLM_CONFIGURE_LOGGING") == "0"
    with importing_vllm("vllm", "vLLM"):
        import torch
        import vllm
        from vllm.distributed import kv_events
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1 import kv_cache_interface
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
        from vllm.v1.request import Request
    if not own_logging:
        _quiet_vllm_loggers(os.environ["VLLM_LOGGING_LEVEL"].upper())
    # vLLM's block hasher chains from NONE_HASH, which must be set once per process
    # before the first Request is built (else NameError); keep one set by someone else.
    if not hasattr(kv_cache_utils, "NONE_HASH"):
        kv_cache_utils.init_none_hash(sha256)
    _VLLM = SimpleNamespace(
        version=vllm.__version__,
        torch=torch,
        SamplingParams=SamplingParams,
        sha256=sha256,
        kvi=kv_cache_interface,
        kvu=kv_cache_utils,
        kv_events=kv_events,
        KVCacheBlocks=KVCacheBlocks,
        KVCacheManager=KVCacheManager,
        Request=Request,
    )
    return _VLLM


def _quiet_vllm_loggers(level: str) -> None:
    """Set vLLM's loggers to ``level`` after import, as VLLM_LOGGING_LEVEL alone no longer does.

    In 0.22.1 to 0.30.0 ``vllm/logger.py`` ends with ``_configure_vllm_root_logger()``: the
    "vllm" logger is configured when it is imported (dictConfig, level VLLM_LOGGING_LEVEL).
    0.33.0 dropped that call: ``_configure_vllm_root_logger`` runs only from
    ``configure_logging``, which engine, executor and worker start-up call
    (``vllm/v1/engine/core.py``, ``vllm/v1/utils.py``, ...). Importing just the KV cache
    manager leaves "vllm" unconfigured (level NOTSET, no handler), so its warnings reach
    Python's last-resort handler at WARNING whatever VLLM_LOGGING_LEVEL says (one "Failed
    to reset prefix cache" per refused reset). Setting the level here is a no-op where vLLM
    already did. Child loggers with a level or handlers of their own get it too."""
    try:
        logging.getLogger("vllm").setLevel(level)
    except (ValueError, TypeError):  # not a level name logging knows: leave vLLM's own handling
        return
    for name, child in list(logging.root.manager.loggerDict.items()):
        if name.startswith("vllm.") and isinstance(child, logging.Logger) and (child.level or child.handlers):
            child.setLevel(level)


_SCHED = None


def import_scheduler() -> SimpleNamespace:
    """vLLM's scheduler API, imported once; a missing piece is a ConfigError that says how to get it."""
    global _SCHED
    if _SCHED is not None:
        return _SCHED
    v = import_vllm()
    with importing_vllm("vllm-scheduler", "vLLM's scheduler"):
        from vllm import config as vc
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput
        from vllm.v1.request import RequestStatus
        from vllm.v1.structured_output import StructuredOutputManager
    try:  # the pipelined scheduler's class (async_scheduler.py); None where the release lacks it
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    except ImportError:
        AsyncScheduler = None
    _SCHED = SimpleNamespace(
        v=v,
        config=vc,
        Scheduler=Scheduler,
        AsyncScheduler=AsyncScheduler,
        DraftTokenIds=DraftTokenIds,
        KVConnectorOutput=KVConnectorOutput,
        ModelRunnerOutput=ModelRunnerOutput,
        # up to 0.33.0 an output maps each request id to its row; 0.34.0 reads the rows' order
        indexed_outputs="req_id_to_index" in inspect.signature(ModelRunnerOutput).parameters,
        # the deferred-free fence (defer_block_free, deferred_frees), 0.24.0 on
        fences_frees="_drain_deferred_frees" in vars(Scheduler),
        RequestStatus=RequestStatus,
        StructuredOutputManager=StructuredOutputManager,
    )
    return _SCHED
