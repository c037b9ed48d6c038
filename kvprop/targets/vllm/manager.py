"""vLLM's own v1 ``KVCacheManager`` as a kvprop target.

kvprop's engine drives vLLM's allocator exactly as it drives its own: the allocator
wrapper turns each kvprop request into a vLLM ``Request`` (hashed by vLLM's own block
hasher) and forwards the manager-facade calls; the view reads vLLM's block pool,
coordinator and per-group managers and reports them in kvprop's terms. vLLM stays
untouched: nothing is patched, only read.

Two translations make the shared invariants apply unchanged:

- cache keys: vLLM keys a cached block by its own 32-byte chained hash plus the group id;
  the view reports (kvprop's hash of the same block, group id), from the pairs recorded
  whenever a request's block hashes grow (same tokens, same block size, same index);
- calls: only keyword arguments the installed vLLM's signatures accept are passed
  (checked with ``inspect.signature``), so the same code drives every release that keeps
  these calls; one it cannot drive is a ``ConfigError`` that says why.

Needs vLLM importable (CPU is enough: the allocator is pure Python). Build an
environment with ``make vllm-env VLLM_VERSION=0.24.0`` (``scripts/vllm-env.sh``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import os
import warnings
from types import SimpleNamespace
from typing import Any

from kvprop.allocator.events import Cleared, Reannounced, Removed, Stored
from kvprop.allocator.specs import (
    THINNED_BY_RETENTION,
    AllocatorConfig,
    ChunkedLocal,
    FullAttention,
    Mamba,
    SlidingWindow,
)
from kvprop.capabilities import Shapes
from kvprop.errors import ConfigError
from kvprop.targets.protocol import VLLM_CAPABILITIES, Built

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


def _import_vllm() -> SimpleNamespace:
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


CAPABILITIES = VLLM_CAPABILITIES  # as registered (kvprop.targets.protocol)


def release_shapes() -> Shapes:
    """The shapes this vLLM release builds as kvprop models them (``allocator_refusal`` says
    why each other one is refused): the sampler draws only these."""
    _import_vllm()  # without vLLM, the ConfigError that says how to get it
    return Shapes(
        hits_inside_blocks=partial_hits_refusal() is None,
        checkpoints=checkpoint_refusal() is None,
        full_report=_has_full_report(),
    )


def make_target(config: AllocatorConfig) -> Built:
    """The target factory: vLLM's allocator for ``config`` and the view the invariants read."""
    allocator = VllmAllocator(config)
    return Built(allocator, VllmView(allocator), CAPABILITIES)


# ---- configuration --------------------------------------------------------------------


@functools.cache
def partial_hits_refusal() -> str | None:
    """Why this release cannot run hits inside a block as kvprop models them, or None. They
    exist from 0.30.0 (``HybridKVCacheCoordinator.enable_partial_hash_hits``;
    ``BlockPool.cache_partial_block`` exists from 0.24.0 with no caller), and kvprop's checks
    follow 0.33.0's rules: the state group keys the prompt's last unit boundary below its
    last token (``get_mamba_prefill_checkpoint_position``), where 0.30.0 keys the last one at
    or below its length. The release's source is read as text, once."""
    from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    if "enable_partial_hash_hits" not in inspect.getsource(HybridKVCacheCoordinator):
        return "it has no hits inside a block (prefix_match_unit, 0.30.0 on)"
    tail = inspect.getsource(MambaManager._cache_partial_tail_block)
    if "latest_prompt_hash_boundary = get_mamba_prefill_checkpoint_position" not in tail:
        return (
            "its hits inside a block follow other rules than the 0.33.0 ones kvprop models (its state "
            "group keys the prompt's last unit boundary at or below the prompt's length)"
        )
    return None


@functools.cache
def checkpoint_refusal() -> str | None:
    """Why this release cannot save prefill checkpoints as kvprop models them, or None. They
    exist from 0.30.0 (``MambaSpec.num_prefill_checkpoint_blocks``); kvprop follows 0.33.0,
    whose manager reserves a checkpoint column only in the chunk reaching the prefill's end
    under retention interval 0 (``_needs_internal_checkpoint``'s ``prefill_end``), where
    0.30.0 reserves one in every chunk that saves one."""
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    check = getattr(MambaManager, "_needs_internal_checkpoint", None)
    if check is None:
        return "it has no prefill checkpoints (MambaSpec.num_prefill_checkpoint_blocks, 0.30.0 on)"
    if "prefill_end" not in inspect.signature(check).parameters:
        return "its prefill checkpoints follow other rules than the 0.33.0 ones kvprop models"
    return None


@functools.cache
def _has_eagle_margin() -> bool:
    from vllm.v1.core import kv_cache_utils

    return hasattr(kv_cache_utils, "eagle_proof_margin")


def eagle_refusal(config: AllocatorConfig) -> str | None:
    """Why this release cannot run the EAGLE drop as kvprop models it, or None. One group drops
    its last block alike in every release measured (0.24.0 agrees step for step); with two
    groups kvprop follows 0.33.0, whose groups look one block past the candidate before they
    drop (``eagle_proof_margin``), which earlier releases lack."""
    if not config.eagle or len(config.groups) < 2 or _has_eagle_margin():
        return None
    return (
        "its EAGLE drop in a hybrid model follows other rules than the 0.33.0 ones kvprop models "
        "(no eagle_proof_margin)"
    )


@functools.cache
def _has_full_report() -> bool:
    from vllm.v1.core.block_pool import BlockPool

    return hasattr(BlockPool, "emit_cached_block_events")


def allocator_refusal(config: AllocatorConfig) -> str | None:
    """What this release's allocator cannot take as kvprop models it, or None: the one list both
    vLLM targets refuse from, each naming itself and the release ("takes no ...")."""
    if config.partial_hits and (why := partial_hits_refusal()) is not None:
        return (
            f"no hash_unit below the block size here: {why}; hash_unit must be None or the block size, "
            f"got {config.hash_unit}"
        )
    checkpoint = next((g.checkpoint for g in config.groups if getattr(g, "checkpoint", None) is not None), None)
    if checkpoint is not None and (why := checkpoint_refusal()) is not None:
        return f"no prefill checkpoints here: {why}; Mamba.checkpoint must be None, got {checkpoint}"
    if config.kv_cache_report_mode == "full" and not _has_full_report():
        return (
            "no full KV cache report here (kv_cache_report_mode, 0.30.0 on); kv_cache_report_mode must be "
            "'incremental', got 'full'"
        )
    if (why := eagle_refusal(config)) is not None:
        return f"no EAGLE drop with two groups here: {why}"
    return None


def _accepted(fn) -> dict:
    """Parameter name -> default of ``fn`` (``inspect.Parameter.empty`` when required)."""
    return {name: p.default for name, p in inspect.signature(fn).parameters.items() if name != "self"}


def _call_kwargs(what: str, params: dict, kwargs: dict, target: str = "vllm") -> dict:
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


def vllm_specs(config: AllocatorConfig, v) -> list:
    """kvprop's groups as vLLM KV cache specs, one group per kvprop group, same order.

    vLLM's hybrid coordinator looks groups with equal specs up together (as real models
    with several identical sliding-window groups are) and needs at least two distinct
    specs; when every kvprop group is the same spec, each gets its own head size, which
    only tells the groups apart (the allocator never reads it)."""
    distinct = len(config.groups) > 1 and len(set(config.groups)) == 1
    specs = []
    for g, spec in enumerate(config.groups):
        common = dict(
            block_size=spec.block_size, num_kv_heads=1, head_size=1 + g if distinct else 1, dtype=v.torch.float32
        )
        if isinstance(spec, FullAttention):
            specs.append(v.kvi.FullAttentionSpec(**common))
        elif isinstance(spec, SlidingWindow):
            specs.append(v.kvi.SlidingWindowSpec(**common, sliding_window=spec.window))
        elif isinstance(spec, ChunkedLocal):
            specs.append(v.kvi.ChunkedLocalAttentionSpec(**common, attention_chunk_size=spec.chunk))
        elif isinstance(spec, Mamba):
            # one state tensor of 1 + g floats (its size only tells groups apart; the allocator
            # never reads it); mamba_cache_mode is the spec's mode, as vLLM's model config sets it
            checkpoints = {}
            if spec.checkpoint is not None:  # (allocator_refusal has refused releases with other rules)
                # what mamba_mixer2, GDN and KDA layers declare (0.33.0)
                checkpoints = dict(num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=spec.checkpoint)
            specs.append(
                v.kvi.MambaSpec(
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


# ---- the allocator ----------------------------------------------------------------------


class Hits(tuple):
    """One hit list per group, as the engine reads them, carrying vLLM's own ``KVCacheBlocks``.

    vLLM tells "no hit" apart by identity (``is self.empty_kv_cache_blocks``), so
    ``allocate_slots`` must get back the very object ``get_computed_blocks`` returned."""

    vllm_blocks: object

    def __new__(cls, vllm_blocks):
        hits = super().__new__(cls, vllm_blocks.blocks)
        hits.vllm_blocks = vllm_blocks
        return hits


def _metrics_collector():
    """vLLM's block residency metrics (``--kv-cache-metrics``) with every block sampled, so what
    they observe does not depend on chance."""
    from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector

    return KVCacheMetricsCollector(1.0)


class VllmAllocator:
    """kvprop's manager-facade calls, forwarded to vLLM's ``KVCacheManager``.

    Keeps one vLLM ``Request`` per kvprop request (created on first sight, with vLLM's
    own block hasher), appends the tokens the kvprop request has grown by and copies its
    ``num_computed_tokens`` before every call, since vLLM reads both from its request."""

    # What vLLM does with a malformed call (kvprop.sim.engine.MISUSES). Its managers free a
    # request by popping its table with a default, so freeing one that holds nothing is a
    # no-op it tolerates. Its allocate_slots and cache_blocks do not validate their
    # arguments (the scheduler is trusted), so those calls are not made against it.
    caller_contract = {"free-twice": "tolerates", "free-unadmitted": "tolerates"}

    def __init__(self, config: AllocatorConfig):
        v = self.v = _import_vllm()
        self.config = config
        self.block_size = config.block_size
        self.num_groups = len(config.groups)
        wanted = dict(
            # no request can need more slots than the pool has
            max_model_len=config.num_blocks * self.block_size,
            scheduler_block_size=self.block_size,
            hash_block_size=config.unit,
            enable_caching=config.enable_caching,
            enable_kv_cache_events=config.enable_kv_cache_events,
            log_stats=config.log_stats,
            use_eagle=config.eagle,
        )
        params = _accepted(v.KVCacheManager.__init__)
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
            wanted["kv_cache_config"] = kv_cache_config
            with _environment(retention.get("env", {})):
                self.manager = v.KVCacheManager(**_call_kwargs("KVCacheManager()", params, wanted))
        except ConfigError:
            raise
        except (AssertionError, ValueError, TypeError, NotImplementedError) as e:
            raise ConfigError(
                f"target 'vllm': vLLM {v.version} cannot build an allocator for {config}: {type(e).__name__}: {e}"
            ) from e
        self._attach()

    @classmethod
    def around(cls, config: AllocatorConfig, manager) -> VllmAllocator:
        """The facade and its bookkeeping over a manager vLLM built itself (its scheduler's)."""
        allocator = cls.__new__(cls)
        allocator.v = _import_vllm()
        allocator.config = config
        allocator.block_size = config.block_size
        allocator.num_groups = len(config.groups)
        allocator.manager = manager
        allocator._attach()
        return allocator

    def _attach(self) -> None:
        v = self.v
        self.pool = self.manager.block_pool
        self.hasher = v.kvu.get_request_block_hasher(self.config.unit, v.sha256)
        self._allocate_params = _accepted(v.KVCacheManager.allocate_slots)
        self.requests: dict = {}  # kvprop request id -> vLLM Request
        self.hash_names: dict = {}  # vLLM block hash (bytes) -> kvprop block hash
        self.event_names: dict = {}  # the hash as KV cache events publish it -> kvprop block hash
        self._named: dict = {}  # request id -> how many of its block hashes are in hash_names
        self.num_evictions = 0
        self._counting = False  # inside counting_evictions
        self._evictions_counted = self._count_evictions()
        # the stored events a lookup queued (the full report), by id; holding them keeps each id theirs
        self._reannounced: dict = {}

    def sampling_params(self, max_tokens: int):
        """The request's sampling parameters: its token limit and, for the full report, the
        mode vLLM's ``Request`` reads from ``extra_args``."""
        if self.config.kv_cache_report_mode == "full":
            return self.v.SamplingParams(max_tokens=max_tokens, extra_args={"kv_cache_report_mode": "full"})
        return self.v.SamplingParams(max_tokens=max_tokens)

    def reannouncing(self, lookup, *args, **kwargs):
        """``lookup(*args, **kwargs)``, marking the stored events it queues: vLLM's event does not
        tell a hit announced again (``emit_cached_block_events``) from a store."""
        queue = getattr(self.pool, "kv_event_queue", None)
        before = len(queue) if queue is not None else 0
        result = lookup(*args, **kwargs)
        if queue is not None:
            self._reannounced.update((id(event), event) for event in queue[before:])
        return result

    # ---- requests ---------------------------------------------------------------------

    def vllm_request(self, request):
        """vLLM's request for ``request``, brought up to date with it."""
        rid = request.request_id
        vreq = self.requests.get(rid)
        if vreq is None:
            vreq = self.requests[rid] = self.v.Request(
                request_id=rid,
                prompt_token_ids=list(request.tokens[: request.num_prompt_tokens]),
                sampling_params=self.sampling_params(request.max_new_tokens),
                pooling_params=None,
                block_hasher=self.hasher,
            )
            self._named[rid] = 0
        grown = request.tokens[vreq.num_tokens :]
        if grown:
            vreq.append_output_token_ids(list(grown))
        vreq.num_computed_tokens = request.num_computed_tokens
        if hasattr(vreq, "shared_prefix_boundary"):  # 0.30.0 on: the scheduler's copy of the junction
            vreq.shared_prefix_boundary = request.shared_prefix_boundary
        self.name_hashes(request, vreq)
        return vreq

    def adopt(self, request, vreq) -> None:
        """Take ``vreq``, built elsewhere (for vLLM's scheduler), as ``request``'s vLLM request."""
        self.requests[request.request_id] = vreq
        self._named[request.request_id] = 0
        self.name_hashes(request, vreq)

    def name_hashes(self, request, vreq) -> None:
        """Record which kvprop hash each new vLLM block hash stands for (same hash unit, same index)."""
        rid, vllm_hashes, kvprop_hashes = request.request_id, vreq.block_hashes, request.unit_hashes
        done = self._named[rid]
        end = min(len(vllm_hashes), len(kvprop_hashes))
        for i in range(done, end):
            if self.config.enable_kv_cache_events:
                self.event_names[self.v.kvu.maybe_convert_block_hash(vllm_hashes[i])] = kvprop_hashes[i]
            known = self.hash_names.setdefault(vllm_hashes[i], kvprop_hashes[i])
            if known != kvprop_hashes[i]:
                raise AssertionError(
                    f"target 'vllm': vLLM hash {vllm_hashes[i].hex()[:16]} of {rid!r} block {i} names kvprop hash "
                    f"{kvprop_hashes[i]} but was recorded for {known}: the two hash chains disagree"
                )
        self._named[rid] = max(done, end)

    # ---- manager-facade calls -----------------------------------------------------------

    def get_computed_blocks(self, request):
        result = self.reannouncing(self.manager.get_computed_blocks, self.vllm_request(request))
        # 0.30.0 on adds the shared-prefix junction; releases before have none (0)
        return Hits(result[0]), result[1], result[2] if len(result) > 2 else 0

    def allocate_slots(self, request, num_new_tokens: int, **kwargs):
        vreq = self.vllm_request(request)
        hits = kwargs.get("new_computed_blocks")
        if isinstance(hits, Hits):
            kwargs["new_computed_blocks"] = hits.vllm_blocks
        elif hits is not None and not isinstance(hits, self.v.KVCacheBlocks):
            raise TypeError(
                f"allocate_slots: new_computed_blocks must be what get_computed_blocks returned, got {hits!r}"
            )
        kwargs = _call_kwargs("KVCacheManager.allocate_slots()", self._allocate_params, kwargs)
        return self.counting_evictions(self.manager.allocate_slots, vreq, num_new_tokens, **kwargs)

    def _count_evictions(self) -> bool:
        """Counts the evictions vLLM's pool makes inside ``counting_evictions`` as it makes them:
        the pool's own ``_maybe_evict_cached_block`` (0.23.0, 0.24.0 and 0.33.0 read), wrapped on this
        pool, adds one each time it returns True (it evicted a cached block). False where a
        release has no such method: the caller then compares the pool before and after."""
        evict = getattr(self.pool, "_maybe_evict_cached_block", None)
        if evict is None:
            return False

        def counted(block):
            evicted = evict(block)
            if evicted and self._counting:
                self.num_evictions += 1
            return evicted

        self.pool._maybe_evict_cached_block = counted
        return True

    def counting_evictions(self, allocate, *args, **kwargs):
        """``allocate(*args, **kwargs)``, counting the cached free blocks it took: vLLM reports no
        evictions. As they happen where the pool can be watched (``_count_evictions``); else the
        cached free blocks whose hash the call changed."""
        if self._evictions_counted:
            self._counting = True
            try:
                return allocate(*args, **kwargs)
            finally:
                self._counting = False
        blocks = self.pool.blocks
        before = {b.block_id: b.block_hash for b in blocks if b.ref_cnt == 0 and b.block_hash is not None}
        result = allocate(*args, **kwargs)
        self.num_evictions += sum(1 for b, h in before.items() if blocks[b].block_hash != h)
        return result

    def cache_blocks(self, request, num_computed_tokens: int) -> None:
        self.manager.cache_blocks(self.vllm_request(request), num_computed_tokens)

    def free(self, request) -> None:
        self.manager.free(self.vllm_request(request))

    def reset_prefix_cache(self) -> bool:
        return bool(self.manager.reset_prefix_cache())

    def new_step_starts(self) -> None:
        """Every release from 0.22.1 has it: its Mamba managers forget which states were cached
        in the last step (``Scheduler.schedule`` calls it first)."""
        self.manager.new_step_starts()

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple(list(ids) for ids in self.manager.get_block_ids(request_id))

    def take_kv_cache_block_copies(self) -> list[tuple[int, int]]:
        """vLLM's queued block copies (0.30.0 on; none before), each (source id, copy id), with
        the references that held both ends released as its scheduler releases them when it
        does not defer frees (``Scheduler._free_cow_retained_blocks``)."""
        take = getattr(self.manager, "take_kv_cache_block_copies", None)
        if take is None:
            return []
        copies, retained = take()
        if retained:
            self.pool.free_blocks(retained)
        return [(c.src_block_id, c.dst_block_id) for c in copies]

    def take_events(self) -> list:
        """vLLM's KV cache events since the last call, in kvprop's terms: one event per key
        (vLLM's stored event lists several hashes of one group). A hash never named stays
        visibly foreign, as in the view."""
        return self.translate_events(self.manager.take_events())

    def translate_events(self, events) -> list:
        """vLLM's KV cache events in kvprop's terms (``take_events``)."""
        ev = self.v.kv_events
        kinds = ((ev.BlockStored, Stored), (ev.BlockRemoved, Removed))
        out: list = []
        for event in events:
            if isinstance(event, ev.AllBlocksCleared):
                out.append(Cleared())
                continue
            kind: Any = next((ours for theirs, ours in kinds if isinstance(event, theirs)), None)
            if kind is None:
                raise TypeError(f"an unknown KV cache event from vLLM {self.v.version}: {event!r}")
            if self._reannounced.pop(id(event), None) is event:
                kind = Reannounced
            for published in event.block_hashes:
                name = self.event_names.get(published, f"vllm:{published}")
                out.append(kind((name, event.group_idx)))
        return out


# ---- the view ---------------------------------------------------------------------------


# From this pool size on, blocks are watched rather than compared with a snapshot at every
# check: a watched write costs a Python call in vLLM's every block update. The watch is set
# up at the first look for changes, so a run without checks never pays for it; with checks
# it costs less than the snapshot from the smallest pools on (README, benchmarks: the vLLM
# target rows), so every pool is watched unless a benchmark sets this higher.
WATCH_FROM_BLOCKS = 0


def _block_state(b) -> tuple:
    """What the checker tracks of a vLLM block: its count, its hash, whether it is queued."""
    return b.ref_cnt, b.block_hash, b.prev_free_block is not None or b.next_free_block is not None


def map_block_ids(cache_map, vllm_key) -> tuple:
    """The ids of the blocks vLLM's cache map holds under ``vllm_key``, in either layout.

    Up to 0.33.0 an entry is one block, or a dict of block id -> block when several blocks
    share a key. From 0.34.0 it is one block id (``_cache``, the block hits take), with every
    id of a key held by several in ``_dup_ids`` (kept apart so that the map holds no
    containers for the garbage collector to track). An id in ``_cache`` that is missing from
    ``_dup_ids`` is still listed: hits take it, so the checker must see it."""
    entry = cache_map._cache.get(vllm_key)
    if entry is None:
        return ()
    if isinstance(entry, int):
        several = getattr(cache_map, "_dup_ids", {}).get(vllm_key)
        if several is None:
            return (entry,)
        return tuple(several) if entry in several else (entry, *several)
    return tuple(entry) if isinstance(entry, dict) else (entry.block_id,)


def _watch_blocks(blocks: list) -> dict | None:
    """Makes vLLM's pool blocks note their state (``_block_state``) before vLLM's first write to
    one of their attributes since the last look, in a dict it returns; None if the release's
    block class cannot be watched.

    The blocks become instances of a subclass that adds no field and only notes the state
    before the write, so vLLM's code runs unchanged; the checker then compares the blocks
    that were written with their state before (exactly what a snapshot of the whole pool
    would find changed) instead of the whole pool at every check."""
    if not blocks:
        return None
    base = type(blocks[0])
    before: dict = {}

    def __setattr__(self, name, value):  # noqa: N807 - the hook Python calls
        if self.block_id not in before:
            before[self.block_id] = _block_state(self)
        base.__setattr__(self, name, value)

    watched = type(base.__name__, (base,), {"__slots__": (), "__setattr__": __setattr__})
    try:
        for block in blocks:
            block.__class__ = watched
    except TypeError:
        for block in blocks:
            block.__class__ = base
        return None
    return before


class VllmView:
    """vLLM's allocator state in kvprop's terms (``kvprop.allocator.view.AllocatorView``'s calls).

    Reads only; every dict is read with ``.get`` so that no defaultdict grows an entry.
    vLLM's per-group ``req_to_blocks`` is a defaultdict that gains an empty list when a
    waiting request's refused allocation drops window-skipped blocks (vLLM's scheduler
    later frees it; kvprop's engine frees only admitted requests): an empty list holds no
    block, so it is no table."""

    def __init__(self, allocator: VllmAllocator):
        self.allocator = allocator
        self.pool = allocator.pool
        self.managers = allocator.manager.coordinator.single_type_managers
        self.queue = self.pool.free_block_queue
        self.kvu = allocator.v.kvu
        self.num_blocks = allocator.config.num_blocks
        self.block_size = allocator.block_size
        self.num_groups = len(self.managers)
        self.null_block_id = self.pool.null_block.block_id
        self._names: dict = {}  # vLLM key -> kvprop key, for keys whose hash is recorded
        self._vllm_keys: dict = {}  # kvprop key -> the vLLM key it was read from
        self._written: dict | None = None  # the watch's record, once take_changes set it up
        self._states: list | None = None  # the snapshot, where blocks are not watched

    def ref_cnt(self, block_id: int) -> int:
        return self.pool.blocks[block_id].ref_cnt

    def ref_cnts(self) -> list[int]:
        return [b.ref_cnt for b in self.pool.blocks]

    def _key(self, vllm_key):
        """(kvprop hash, group) for vLLM's (hash, group) key; an unrecorded hash stays visibly foreign."""
        if vllm_key is None:
            return None
        key = self._names.get(vllm_key)
        if key is None:
            block_hash = self.kvu.get_block_hash(vllm_key)
            name = self.allocator.hash_names.get(block_hash)
            if name is None:
                key = (f"vllm:{block_hash.hex()[:16]}", self.kvu.get_group_id(vllm_key))
            else:
                key = self._names[vllm_key] = (name, self.kvu.get_group_id(vllm_key))
            self._vllm_keys[key] = vllm_key
        return key

    def cache_key(self, block_id: int):
        return self._key(self.pool.blocks[block_id].block_hash)

    def cache_keys(self) -> list:
        return [self._key(b.block_hash) for b in self.pool.blocks]

    def extra_keys(self) -> dict:
        """Block id -> its further keys (vLLM's ``cached_block_hashes_by_block``, 0.24.0 on)."""
        extra = getattr(self.pool, "cached_block_hashes_by_block", {})
        return {b: sorted((self._key(k) for k in keys), key=repr) for b, keys in extra.items() if keys}

    def further_keys(self, block_id: int) -> list:
        extra = getattr(self.pool, "cached_block_hashes_by_block", {}).get(block_id, ())
        return sorted((self._key(k) for k in extra), key=repr)

    def map_holds(self, key, block_id: int) -> bool:
        vllm_key = self._vllm_keys.get(key)
        if vllm_key is None:
            return any(k == key and b == block_id for k, b in self.cache_map_items())
        return self._map_has(vllm_key, block_id)

    def pending_copies(self) -> list[tuple[int, int]]:
        """(source id, copy id) of vLLM's queued block copies (0.30.0 on)."""
        pairs = (pair for manager in self.managers for pair in getattr(manager, "_pending_cow_copies", ()))
        return [(s.block_id, c.block_id) for s, c in pairs]

    @property
    def num_free_blocks(self) -> int:
        return self.queue.num_free_blocks

    def _walk(self, start, step: str, stop, limit: int) -> list[int]:
        """Block ids along the free list's links; stops after ``limit`` so a cycle shows as repeats."""
        out: list[int] = []
        block = start
        while block is not None and block is not stop and len(out) < limit:
            out.append(block.block_id)
            block = getattr(block, step)
        return out

    def free_queue_ids(self) -> list[int]:
        q = self.queue
        return self._walk(
            q.fake_free_list_head.next_free_block, "next_free_block", q.fake_free_list_tail, self.num_blocks + 1
        )

    def free_queue_ids_backward(self) -> list[int]:
        q = self.queue
        return self._walk(
            q.fake_free_list_tail.prev_free_block, "prev_free_block", q.fake_free_list_head, self.num_blocks + 1
        )

    def free_queue_prefix(self, n: int) -> list[int]:
        q = self.queue
        return self._walk(q.fake_free_list_head.next_free_block, "next_free_block", q.fake_free_list_tail, n)

    def cache_map_items(self):
        # The pool replaced its map on reset_prefix_cache before 0.34.0: look it up every time.
        cache_map = self.pool.cached_block_hash_to_block
        for vllm_key in list(cache_map._cache):
            key = self._key(vllm_key)
            for block_id in map_block_ids(cache_map, vllm_key):
                yield key, block_id

    def request_ids(self, group: int):
        return [rid for rid, blocks in list(self.managers[group].req_to_blocks.items()) if blocks]

    def request_block_ids(self, group: int, request_id: str):
        blocks = self.managers[group].req_to_blocks.get(request_id)
        return [b.block_id for b in blocks] if blocks else None

    def num_cached_blocks(self, group: int, request_id: str):
        """vLLM records a count only once a request had hits or external tokens, or cached a
        full block; before that a request with a table has cached nothing: 0."""
        manager = self.managers[group]
        count = manager.num_cached_block.get(request_id)
        if count is None and manager.req_to_blocks.get(request_id):
            return 0
        return count

    @property
    def num_evictions(self) -> int:
        return self.allocator.num_evictions

    # ---- what lets the checker verify only what changed ----------------------------------

    def _block_states(self) -> list:
        return [_block_state(b) for b in self.pool.blocks]

    def take_changes(self) -> set[int]:
        """Ids of blocks whose count, hash or free-queue membership changed since the last call.

        vLLM reports no changes, so in a large pool its blocks are watched (``_watch_blocks``);
        in a small one, or where a release's block class cannot be watched, every block is
        compared with the previous call's snapshot (one small tuple per block). As with
        kvprop's own pool, the periodic full sweep walks the whole queue. The first call sets
        the watch or the snapshot up and reports every block: there is nothing to compare with."""
        if self._written is None and self._states is None:
            if self.num_blocks >= WATCH_FROM_BLOCKS:
                self._written = _watch_blocks(self.pool.blocks)
            if self._written is None:
                self._states = self._block_states()
            return set(range(self.num_blocks))
        if self._written is not None:
            blocks = self.pool.blocks
            changed = {i for i, state in self._written.items() if _block_state(blocks[i]) != state}
            self._written.clear()
            return changed
        states = self._block_states()
        changed = {i for i, (old, new) in enumerate(zip(self._states or (), states, strict=True)) if old != new}
        self._states = states
        return changed

    def cache_count(self, key) -> int:
        """How many blocks vLLM's cache map holds under ``key``, a key this view named (the
        event check compares only keys that moved; a key never named counts by a scan)."""
        vllm_key = self._vllm_keys.get(key)
        if vllm_key is None:
            return sum(1 for k, _ in self.cache_map_items() if k == key)
        return len(map_block_ids(self.pool.cached_block_hash_to_block, vllm_key))

    def raw_table(self, group: int, request_id: str):
        """The live table (vLLM's block objects, compared by identity); never mutated."""
        blocks = self.managers[group].req_to_blocks.get(request_id)
        return blocks if blocks else None

    def _map_has(self, vllm_key, block_id: int) -> bool:
        return vllm_key is not None and block_id in map_block_ids(self.pool.cached_block_hash_to_block, vllm_key)

    def block_state(self, block_id: int, old_key):
        """(ref_cnt, key, in free queue, queue links consistent, in the map under key, still in
        the map under ``old_key`` though the key changed), as ``AllocatorView.block_state``."""
        block = self.pool.blocks[block_id]
        prev, nxt, vllm_key = block.prev_free_block, block.next_free_block, block.block_hash
        key = self._key(vllm_key)
        in_queue = prev is not None or nxt is not None
        links_ok = not in_queue or (
            prev is not None and nxt is not None and prev.next_free_block is block and nxt.prev_free_block is block
        )
        in_map = key is not None and self._map_has(vllm_key, block_id)
        stale = old_key is not None and old_key != key and self._map_has(self._vllm_keys.get(old_key), block_id)
        return block.ref_cnt, key, in_queue, links_ok, in_map, stale
