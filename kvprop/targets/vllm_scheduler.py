"""vLLM's own v1 ``Scheduler`` as a kvprop target (``--target vllm-scheduler``).

Here kvprop's engine does not schedule. Each step calls vLLM's ``Scheduler.schedule()``,
plays the model runner — writes every scheduled position through the block ids the
scheduler output hands the worker, samples each request's next token — and hands the
output back through ``update_from_output``. Admission, chunking, preemption under
pressure and the freeing of finished requests are vLLM's own; kvprop's operations only
add requests, abort or stop them, reset the prefix cache and step.

The invariants read the scheduler's ``KVCacheManager`` through the manager target's view,
between operations and inside the step: the manager's ``get_computed_blocks``,
``allocate_slots`` and ``free`` are observed — the instance's attributes wrap the bound
methods and call through with the same arguments, returning what they return — so the
checks run where blocks change hands, as with ``--target vllm``. kvprop's request records
mirror vLLM's (status, computed tokens, tokens) at each of those moments; the data oracle
judges what the worker wrote through the scheduler's block ids.

Speculative decoding runs as vLLM's n-gram drafting does: after each step the worker hands the
scheduler kvprop's drafts (``update_draft_token_ids``), the next step schedules them, and the
output carries the accepted ones and the token after them. Not driven yet (a configuration
asking for one is refused, counted, never run): lookahead slots (an EAGLE drafter's), vLLM's
connectors, and async scheduling. docs/targets.md says
what each would need.
"""

from __future__ import annotations

import atexit
import inspect
import json
import shutil
import tempfile
import warnings
from types import SimpleNamespace

import attrs

from kvprop.allocator.specs import EngineConfig, Mamba
from kvprop.errors import ConfigError, TargetCrash, Violation
from kvprop.sim.engine import (
    EV_ABORT_LOAD,
    EV_EVICT,
    EV_LOAD_FAIL,
    EV_PREEMPT,
    EV_SKIP,
    EV_SPEC_ACCEPT,
    EV_SPEC_REJECT,
    Engine,
    StepReport,
)
from kvprop.sim.request import Status
from kvprop.targets.vllm import (
    INSTALL_HINT,
    Hits,
    VllmAllocator,
    VllmView,
    _environment,
    _import_vllm,
    _retention_setting,
    vllm_specs,
)

_SCHED = None
_MODEL_DIRS: dict[int, str] = {}


def _import_scheduler() -> SimpleNamespace:
    """vLLM's scheduler API, imported once; a missing piece is a ConfigError that says how to get it."""
    global _SCHED
    if _SCHED is not None:
        return _SCHED
    v = _import_vllm()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            from vllm import config as vc
            from vllm.v1.core.sched.scheduler import Scheduler
            from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput
            from vllm.v1.request import RequestStatus
            from vllm.v1.structured_output import StructuredOutputManager
        except ImportError as e:
            raise ConfigError(
                f"target 'vllm-scheduler' needs vLLM's scheduler importable, but importing it failed ({e}); "
                f"{INSTALL_HINT}"
            ) from e
    _SCHED = SimpleNamespace(
        v=v,
        config=vc,
        Scheduler=Scheduler,
        DraftTokenIds=DraftTokenIds,
        KVConnectorOutput=KVConnectorOutput,
        ModelRunnerOutput=ModelRunnerOutput,
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
    params = set(inspect.signature(cls).parameters)
    out = {}
    for name, value in wanted.items():
        if name in params:
            out[name] = value
        elif value not in (None, 0, False):
            raise ConfigError(f"target 'vllm-scheduler': this vLLM's {what} has no parameter {name!r}")
    return cls(**out)


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


def refusal(config: EngineConfig) -> str | None:
    """Why this target cannot run ``config`` yet, or None."""
    if config.lookahead:
        return (
            f"lookahead slots are not driven through vLLM's scheduler (lookahead={config.lookahead}; allowed: 0): "
            "vLLM derives them from an EAGLE drafter's own forward pass, which kvprop does not model"
        )
    if config.speculative_tokens and config.token_budget < 1 + config.speculative_tokens:
        # vLLM 0.33.0 pads a request whose hit leaves one token to 1 + K rows and, when they do
        # not fit the step's budget, schedules nothing rather than one row: with a budget under
        # 1 + K such a request waits forever (README, "What the harness found in vLLM")
        return (
            f"with {config.speculative_tokens} drafts vLLM's scheduler needs a token budget of at least "
            f"{1 + config.speculative_tokens} (token_budget={config.token_budget})"
        )
    return None


def build_scheduler(config: EngineConfig):
    """vLLM's ``Scheduler`` for ``config``, configured as vLLM's engine configures it for this
    release (synchronous scheduling: the engine's other mode overlaps steps, not modelled)."""
    s = _import_scheduler()
    v, vc, alloc = s.v, s.config, config.allocator
    bs = alloc.block_size
    # vLLM's engine refuses to start unless the KV cache holds one request of max_model_len
    # (check_enough_kv_cache_memory): the longest request all groups' blocks fit, as kvprop's
    # add_request bounds it. A longer one would let the scheduler pad a decode past what the
    # pool can ever give it.
    scratch = sum(getattr(spec, "speculative_blocks", 0) for spec in alloc.groups)
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
                # a failed load is recomputed (the default fails the request instead)
                kv_load_failure_policy="recompute",
            )
        if alloc.enable_kv_cache_events:
            extra["kv_events_config"] = vc.KVEventsConfig(enable_kv_cache_events=True, publisher="null")
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
            kv_cache_groups=[v.kvi.KVCacheGroupSpec([f"layer{g}"], s) for g, s in enumerate(vllm_specs(alloc, v))],
            **retention.get("field", {}),
        )
        with _environment(retention.get("env", {})):
            return s.Scheduler(
                vllm_config=vllm_config,
                kv_cache_config=kv_cache_config,
                structured_output_manager=s.StructuredOutputManager(vllm_config),
                block_size=bs,
                log_stats=False,
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


def build_engine(config: EngineConfig, device=None, hooks=None, canary: bool = False):
    """The target's entry point (``kvprop.targets.ENGINE_TARGETS``): it builds the whole engine."""
    _import_scheduler()  # without vLLM every configuration is refused for that reason, with the way out
    why = refusal(config)
    if why:
        raise ConfigError(f"target 'vllm-scheduler': {why}")
    from kvprop.targets.canary import with_canary

    cls = with_canary(SchedulerEngine) if canary else SchedulerEngine
    return cls(config, device=device, hooks=hooks)


build_engine.engine_target = True


@attrs.define
class Transfer:
    """A job of vLLM's offloading connector the worker runs: a load (CPU blocks into the
    request's GPU blocks) or a store (GPU blocks out to CPU blocks), pair by pair."""

    job_id: int
    request_id: str
    load: bool
    gpu: list  # (group, block id) per pair
    cpu: list  # CPU block id per pair


def _transfer(job_id: int, job, load: bool) -> Transfer:
    """A job from the connector's metadata: ``transfer_spec`` (src, dst) up to 0.25.x,
    ``src_spec``/``dst_spec`` from 0.30.0; the GPU side lists each group's blocks in turn."""
    src, dst = job.transfer_spec if hasattr(job, "transfer_spec") else (job.src_spec, job.dst_spec)
    gpu_spec, cpu_spec = (dst, src) if load else (src, dst)
    gpu_ids, cpu_ids = [int(b) for b in gpu_spec.block_ids], [int(b) for b in cpu_spec.block_ids]
    if len(gpu_ids) != len(cpu_ids):
        raise NotImplementedError(f"offloaded blocks larger than GPU blocks: {len(gpu_ids)} vs {len(cpu_ids)}")
    sizes = list(getattr(gpu_spec, "group_sizes", None) or [len(gpu_ids)])
    groups = [g for g, n in enumerate(sizes) for _ in range(n)]
    return Transfer(job_id, job.req_id, load, list(zip(groups, gpu_ids, strict=True)), cpu_ids)


class _HookFailed(Exception):
    """Carries an error of kvprop's own hooks out through vLLM's code, so the step re-raises the
    original instead of reporting it as the target's crash."""


class SchedulerEngine(Engine):
    """kvprop's engine with vLLM's scheduler in charge of every step."""

    preempts_on_request = False  # vLLM's scheduler preempts by its own policy, under pressure

    def __init__(self, config: EngineConfig, device=None, hooks=None):
        self.scheduler = build_scheduler(config)
        self.s = _import_scheduler()
        manager = self.scheduler.kv_cache_manager
        allocator = VllmAllocator.around(config.allocator, manager)
        allocator.caller_contract = {}  # malformed calls go to the manager, never through this scheduler
        super().__init__(config, allocator, VllmView(allocator), device=device, hooks=hooks)
        self.tells_steps = False  # schedule() tells the manager itself
        self.connector = None  # vLLM's own connector is in charge; kvprop plays its worker side
        self.offloaded: dict[int, list[int]] = {}  # CPU block id -> the GPU block's slots stored there
        self.transfers: dict[int, Transfer] = {}  # job id -> a transfer in flight
        self.stores_due: list[int] = []  # store jobs that complete after the next forward pass
        self.done: dict = {"jobs": set(), "recving": set(), "invalid": set()}  # for the next output
        self.worker: dict[str, list[list[int]]] = {}  # request id -> the block ids the worker holds, per group
        self.report: StepReport | None = None
        self._hook_error: BaseException | None = None
        self._events: list = []
        self._observe(manager)

    # ---- observing the manager ---------------------------------------------------------

    def _observe(self, manager) -> None:
        real_hit, real_allocate, real_free = manager.get_computed_blocks, manager.allocate_slots, manager.free

        def get_computed_blocks(vreq, *args, **kwargs):
            result = real_hit(vreq, *args, **kwargs)
            self._hook(self._after_hit, vreq, result)
            return result

        def allocate_slots(vreq, num_new_tokens, *args, **kwargs):
            if args:  # the scheduler passes keywords; bind positional ones to their names all the same
                bound = inspect.signature(real_allocate).bind(vreq, num_new_tokens, *args, **kwargs)
                kwargs = {k: val for k, val in bound.arguments.items() if k not in ("request", "num_new_tokens")}
            request, seen, token = self._hook(self._before_allocation, vreq, num_new_tokens, kwargs)
            blocks = self.allocator.pool.blocks
            cached_free = {b.block_id: b.block_hash for b in blocks if b.ref_cnt == 0 and b.block_hash is not None}
            try:
                result = real_allocate(vreq, num_new_tokens, **kwargs)
            except Exception:
                self._hook(self.hooks.allocation_crashed, self, request, token)
                raise
            self.allocator.num_evictions += sum(1 for b, h in cached_free.items() if blocks[b].block_hash != h)
            self._hook(self._after_allocation, request, seen, token, result)
            return result

        def free(vreq):
            self._free(vreq)

        self._real_free = real_free
        real_events = self._real_take_events = manager.take_events

        def take_events():
            events = real_events()
            self._events.extend(events)  # what the scheduler publishes, in order
            return events

        manager.get_computed_blocks = get_computed_blocks
        manager.take_events = take_events
        manager.allocate_slots = allocate_slots
        manager.free = free

    def _hook(self, fn, *args):
        """Run a check from inside vLLM's call: a Violation passes through; any other error of
        kvprop's own is carried out as itself (never the target's crash)."""
        try:
            return fn(*args)
        except Violation:
            raise
        except Exception as e:
            self._hook_error = e
            raise _HookFailed() from e

    def _mirror(self, vreq):
        """kvprop's record of ``vreq``, its computed count brought up to vLLM's."""
        request = self.requests[vreq.request_id]
        request.num_computed_tokens = vreq.num_computed_tokens
        return request

    def _after_hit(self, vreq, result) -> None:
        request = self._mirror(vreq)
        request.shared_prefix_boundary = result[2] if len(result) > 2 else 0
        hits = Hits(result[0])
        if result[1]:
            self.last_hits = (request.request_id, hits, result[1])
        self.hooks.after_hit(self, request, hits, result[1])

    def _before_allocation(self, vreq, num_new_tokens, kwargs):
        request = self._mirror(vreq)
        if request.status is Status.LOADING:
            request.pending_external = 0  # vLLM schedules a load's request once the load is in its count
        seen = dict(kwargs)
        hits = seen.get("new_computed_blocks")
        if hits is not None:
            seen["new_computed_blocks"] = hits = Hits(hits)
            num_hit, external = seen.get("num_new_computed_tokens", 0), seen.get("num_external_computed_tokens", 0)
            self._note_admission_events(request, hits, num_hit, external, num_new_tokens)
        return request, seen, self.hooks.before_allocation(self, request, num_new_tokens, seen)

    def _after_allocation(self, request, seen, token, result) -> None:
        computed = (
            request.num_computed_tokens
            + seen.get("num_new_computed_tokens", 0)
            + seen.get("num_external_computed_tokens", 0)
        )
        external = seen.get("num_external_computed_tokens", 0)
        if result is not None and any(spec.skipped_tokens(computed) >= self.block_size for spec in self.specs):
            self.events[EV_SKIP] += 1
        if result is not None and request.status in (Status.WAITING, Status.LOADING):
            # vLLM admits what it allocated for: running from here on, with its hit computed,
            # or loading while an asynchronous load (delay_cache_blocks) brings the rest
            (self.waiting.remove(request) if request.status is Status.WAITING else self.loading.pop(request.request_id))
            request.num_computed_tokens = computed
            if external and seen.get("delay_cache_blocks"):
                # as kvprop's engine counts a load: computed locally, the rest pending
                request.status, request.pending_external = Status.LOADING, external
                request.num_computed_tokens = computed - external
                self.loading[request.request_id] = request
            else:
                request.status, request.pending_external = Status.RUNNING, 0
                self.running.append(request)
            if self.report is not None:
                self.report.admitted.append(request.request_id)
        self.hooks.after_allocation(self, request, token, result, computed)
        if result is not None and external:
            tables = self.boundary.get_block_ids(request.request_id)
            local = computed - external
            self.hooks.at_handoff(self, request, tables, local, external)

    def _free(self, vreq) -> None:
        """vLLM's scheduler frees ``vreq``: the manager frees it, then kvprop mirrors it (the
        canary's mixin overrides this, as the engine's own ``_free``)."""
        self._real_free(vreq)
        self._hook(self._after_free, vreq)

    def _after_free(self, vreq) -> None:
        """vLLM freed ``vreq``'s blocks: it finished or was aborted, or it is being preempted (the
        scheduler frees first, then marks it; a finished request is marked first)."""
        request = self.requests.get(vreq.request_id)
        if request is None:
            return
        self._forget_worker(request)
        loading = self.loading.pop(request.request_id, None) is not None
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if loading and not vreq.is_finished():
            # a failed load with nothing valid to keep: vLLM frees it and it waits to recompute
            request.num_computed_tokens, request.pending_external = 0, 0
            request.load_failed = True
            request.status = Status.WAITING
            self.waiting.appendleft(request)
            self.events[EV_LOAD_FAIL] += 1
        elif vreq.is_finished():
            # the tokens of its last output, which vLLM may have cached a block of before freeing
            self._catch_up(request, vreq)
            status = Status.ABORTED if vreq.status == self.s.RequestStatus.FINISHED_ABORTED else Status.FINISHED
            self._retire(request, status)
            if self.report is not None and status is Status.FINISHED:
                self.report.finished.append(request.request_id)
        else:
            request.num_computed_tokens = 0
            request.num_preemptions += 1
            request.status = Status.WAITING
            self.waiting.appendleft(request)
            self.events[EV_PREEMPT] += 1
            if self.report is not None:
                self.report.preempted.append(request.request_id)
        self.hooks.after_free(self, request)

    def _forget_worker(self, request) -> None:
        rid = request.request_id
        self.worker.pop(rid, None)
        for g in self.state_groups:
            self.worker_tables.pop((rid, g), None)
            self.state_columns.pop((rid, g), None)

    def _call(self, what: str, fn, *args):
        """A call into vLLM's scheduler: its exception is the target's crash, a hook's error is kvprop's."""
        self._hook_error = None
        try:
            return fn(*args)
        except (Violation, TargetCrash):
            raise
        except Exception as e:
            if self._hook_error is not None:
                raise self._hook_error from None
            raise TargetCrash(what, e) from e

    # ---- operations ----------------------------------------------------------------------

    def add_request(self, prompt, max_new_tokens: int):
        request = super().add_request(prompt, max_new_tokens)
        v = self.allocator.v
        vreq = v.Request(
            request_id=request.request_id,
            prompt_token_ids=list(request.tokens),
            sampling_params=v.SamplingParams(max_tokens=max_new_tokens),
            pooling_params=None,
            block_hasher=self.allocator.hasher,
        )
        self.allocator.requests[request.request_id] = vreq
        self.allocator._named[request.request_id] = 0
        self.allocator._name_hashes(request.request_id, vreq.block_hashes, request.block_hashes)
        self._call("Scheduler.add_request", self.scheduler.add_request, vreq)
        return request

    def abort(self, request_id: str) -> None:
        self.get(request_id)
        self._finish_in_vllm(request_id, self.s.RequestStatus.FINISHED_ABORTED)

    def finish(self, request_id: str) -> None:
        from kvprop.errors import RequestError

        request = self.get(request_id)
        if request.status is not Status.RUNNING:
            raise RequestError(
                f"finish: request {request_id!r} is {request.status.value}, only running ones can finish"
            )
        self._finish_in_vllm(request_id, self.s.RequestStatus.FINISHED_STOPPED)

    def why_not_finish(self, request_id: str) -> str | None:
        """vLLM stops a request only once it samples (a stop token, a length): a stop before its
        prompt is computed is outside its caller contract, so it is not made. (Its offloading
        connector then stores the whole prompt, computed or not: 0.30.0 and 0.33.0 take a
        finished request's tokens as computed, ``_build_store_jobs``.)"""
        request = self.requests[request_id]
        if request.num_computed_tokens < request.num_prompt_tokens:
            return f"{request_id} is still in prefill, and only sampling stops a request in vLLM"
        return None

    def _finish_in_vllm(self, request_id: str, status) -> None:
        self.report = None
        self._call("Scheduler.finish_requests", self.scheduler.finish_requests, request_id, status)
        request = self.requests.get(request_id)
        if request is None:
            return
        if request_id in self.scheduler.requests:
            # vLLM keeps the blocks of an aborted load until the worker reports it done
            request.status = Status.ABORTING
            self.events[EV_ABORT_LOAD] += 1
            return
        # vLLM held no blocks for it (a waiting request): it ends all the same
        (self.running if request in self.running else self.waiting).remove(request)
        self._forget_worker(request)
        aborted = status == self.s.RequestStatus.FINISHED_ABORTED
        self._retire(request, Status.ABORTED if aborted else Status.FINISHED)

    def preempt(self, request_id: str) -> None:
        from kvprop.errors import RequestError

        raise RequestError("preempt: vLLM's scheduler preempts by its own policy, under pressure; not made")

    def reset_prefix_cache(self) -> bool:
        return bool(self._call("Scheduler.reset_prefix_cache", self.scheduler.reset_prefix_cache))

    def take_kv_events(self) -> list | None:
        """The events the scheduler published since the last call, then those the manager holds
        for its next publication (an operation between steps, a reset, makes some): kvprop takes
        them where a subscriber would have them, so the cache map is judged against all of it."""
        if not self.config.allocator.enable_kv_cache_events:
            return None
        published, self._events = self._events, []
        pending = self._call("KVCacheManager.take_events", self._real_take_events)
        return self.allocator.translate_events([*published, *pending])

    # ---- a step ---------------------------------------------------------------------------

    def worker_block_ids(self, request_id: str):
        return self.worker[request_id]

    def step(self) -> StepReport:
        report = self.report = StepReport()
        evictions = self.view.num_evictions
        self.hooks.step_starts(self)
        try:
            output = self._call("Scheduler.schedule", self.scheduler.schedule)
            starts = self._hand_to_worker(output)
            meta = getattr(output, "kv_connector_metadata", None)
            due, self.stores_due = self.stores_due, []
            if meta is not None:
                for job_id in getattr(meta, "jobs_to_flush", None) or ():
                    self._complete(job_id)  # before this pass overwrites the blocks it reads
                for job_id, job in meta.load_jobs.items():
                    self.transfers[job_id] = _transfer(job_id, job, load=True)
                    if self.config.connector == "sync":
                        self.finish_load(job.req_id, ok=True)
            for rid, n in output.num_scheduled_tokens.items():
                report.scheduled[rid] = n
                request = self.requests[rid]
                request.num_computed_tokens = starts[rid]
                drafts = list(output.scheduled_spec_decode_tokens.get(rid, ()))
                if drafts != request.spec_token_ids[: len(drafts)]:
                    # vLLM 0.33.0 pads a new decode to 1 + K rows with -1 placeholders (one
                    # CUDA graph for the batch): they are computed and then rejected like drafts
                    request.set_drafts(drafts)
            self._write_scheduled(report)
            for job_id in due:  # stores issued a step ago read their blocks now
                self._complete(job_id)
            if meta is not None:
                for job_id, job in meta.store_jobs.items():
                    self.transfers[job_id] = _transfer(job_id, job, load=False)
                    self.stores_due.append(job_id)
            model_output = self._model_output(output, starts)
            self._call("Scheduler.update_from_output", self.scheduler.update_from_output, output, model_output)
            self._take_outputs(report, output)
        finally:
            self.report = None
        if self.view.num_evictions > evictions:
            self.events[EV_EVICT] += 1
        return report

    def _hand_to_worker(self, output) -> dict[str, int]:
        """The worker's block tables after this step's output (new requests' block ids; running
        ones' new ids appended, a resumed one's replaced), and where each request's tokens start."""
        starts = {}
        for new in output.scheduled_new_reqs:
            self.worker[new.req_id] = [list(ids) for ids in new.block_ids]
            starts[new.req_id] = new.num_computed_tokens
        cached = output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", None)
        for i, rid in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            again = rid in resumed if resumed is not None else cached.resumed_from_preemption[i]
            if again or rid not in self.worker:
                self.worker[rid] = [list(ids) for ids in new_ids] if new_ids else [[] for _ in self.specs]
            elif new_ids:
                for table, ids in zip(self.worker[rid], new_ids, strict=True):
                    table.extend(ids)
            starts[rid] = cached.num_computed_tokens[i]
        return starts

    def _catch_up(self, request, vreq) -> list[int]:
        """The tokens vLLM appended to ``vreq`` since kvprop's record last grew, appended to it
        too, and the new block hashes named (so an event or a key for them reads as kvprop's)."""
        grown = vreq.all_token_ids[request.num_tokens :]
        request.extend_tokens(grown)
        self.allocator._name_hashes(request.request_id, vreq.block_hashes, request.block_hashes)
        return grown

    def _model_output(self, output, starts):
        """What the model runner returns: for every request whose scheduled tokens reach its end,
        the drafts verification accepts and the token after them (decoding depends on the prefix
        alone), nothing for a prefill chunk."""
        ids = list(output.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            request = self.requests[rid]
            request.num_computed_tokens = starts[rid] + output.num_scheduled_tokens[rid]
            drafts = len(output.scheduled_spec_decode_tokens.get(rid, ()))
            reached = request.num_computed_tokens - drafts >= request.num_tokens
            sampled.append(request.verified_tokens(drafts) if reached else [])
            if drafts and reached and self.state_groups:
                # the worker copies a crossed boundary's state in the same pass (vLLM's
                # postprocess_mamba), before the scheduler sees the output or frees the request
                accepted = len(sampled[-1]) - 1
                request.num_computed_tokens = request.num_tokens + accepted
                self._settle_states(request, accepted)
        extra = {}
        if self.scheduler.connector is not None:
            extra["kv_connector_output"] = self._connector_output()
        return self.s.ModelRunnerOutput(
            req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)}, sampled_token_ids=sampled, **extra
        )

    # ---- the worker side of vLLM's offloading connector -------------------------------------

    def _complete(self, job_id: int, ok: bool = True) -> None:
        """Run transfer ``job_id`` now (a store reads its GPU blocks, a load writes them) and report
        it with the next output. A failed load writes nothing and reports its blocks invalid."""
        transfer = self.transfers.pop(job_id, None)
        if transfer is None:
            return
        bs = self.block_size
        if transfer.load and ok:
            request = self.requests.get(transfer.request_id)
            if request is not None:
                self.hooks.before_load_write(self, request, transfer.gpu)
            slots, values = [], []
            for (_, block), cpu in zip(transfer.gpu, transfer.cpu, strict=True):
                slots.extend(range(block * bs, (block + 1) * bs))
                values.extend(self.offloaded.get(cpu, [-1] * bs))
            self.memory.write(slots, values)
        elif transfer.load:
            self.done["invalid"].update(block for _, block in transfer.gpu)
        else:
            for (_, block), cpu in zip(transfer.gpu, transfer.cpu, strict=True):
                self.offloaded[cpu] = self.memory.row(block)
        self.done["jobs"].add(job_id)
        if transfer.load:
            self.done["recving"].add(transfer.request_id)

    def _connector_output(self):
        """What the worker reports: the jobs completed since the last output, the requests whose
        loads finished, the blocks a failed load left invalid."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata

        done, self.done = self.done, {"jobs": set(), "recving": set(), "invalid": set()}
        return self.s.KVConnectorOutput(
            finished_recving=done["recving"] or None,
            kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs=dict.fromkeys(done["jobs"], 1)),
            invalid_block_ids=done["invalid"],
        )

    @property
    def fails_loads(self) -> bool:
        """Whether a failed load can be reported: vLLM's recovery for invalid blocks reads one
        block table per request (``(req_block_ids,) = kv_cache_manager.get_block_ids(req_id)``
        in ``Scheduler._update_requests_with_invalid_blocks``, marked TODO for hybrid models),
        so with several groups any failed load crashes its scheduler (README). The release's
        source is read as text to tell; nothing of it is run."""
        if len(self.specs) == 1:
            return True
        source = inspect.getsource(type(self.scheduler)._update_requests_with_invalid_blocks)
        return "(req_block_ids,) =" not in source

    def finish_load(self, request_id: str, ok: bool) -> None:
        """The worker's load for ``request_id`` completes (``ok``) or fails; vLLM hears of it with
        the next step's output. Nothing happens for a load already completed and not yet seen."""
        from kvprop.errors import RequestError

        if request_id not in self.loading:
            raise RequestError(f"finish_load: no load in flight for {request_id!r}; in flight: {sorted(self.loading)}")
        if not ok and not self.fails_loads:
            return
        for job_id, transfer in list(self.transfers.items()):
            if transfer.load and transfer.request_id == request_id:
                self._complete(job_id, ok)

    def _take_outputs(self, report: StepReport, output) -> None:
        """kvprop's records brought up to vLLM's after the output (the tokens it appended, its
        computed counts, the verification's outcome), then the drafts for the next step."""
        proposals = {}
        for rid in report.scheduled:
            request = self.requests.get(rid)
            vreq = self.scheduler.requests.get(rid)
            if request is None or vreq is None:
                continue
            grown = self._catch_up(request, vreq)
            drafts = len(output.scheduled_spec_decode_tokens.get(rid, ()))
            request.drop_drafts()
            request.num_computed_tokens = vreq.num_computed_tokens
            if drafts and grown:
                self.events[EV_SPEC_REJECT if len(grown) <= drafts else EV_SPEC_ACCEPT] += 1
            room = request.max_new_tokens - request.num_output_tokens - 1
            k = min(self.config.speculative_tokens, room)
            if grown and k > 0:
                request.propose_drafts(k)
                proposals[rid] = list(request.spec_token_ids)
        if proposals:
            drafts = self.s.DraftTokenIds(req_ids=list(proposals), draft_token_ids=list(proposals.values()))
            self._call("Scheduler.update_draft_token_ids", self.scheduler.update_draft_token_ids, drafts)
            for rid in proposals:  # vLLM keeps no drafts for a request still in prefill: neither does kvprop
                vreq = self.scheduler.requests[rid]
                if list(vreq.spec_token_ids) != proposals[rid]:
                    self.requests[rid].drop_drafts()
