"""vLLM's v1 Scheduler at a production shape: three full-attention groups (layers of three head
sizes) in blocks of 16 (the smallest block FlashAttention, FlashInfer and Triton attention take),
12 usable blocks, token budget 1, vLLM's offloading connector (its loads completing in the step
that starts them). The recorded reproducer (`repro.py`, blocks of 3) with every full block of a
prompt made 16 tokens (its 3 tokens repeated), a partial tail kept: the same requests, hits, loads
and block counts.

Five requests, no failed load: r4 (48 tokens) is admitted with an asynchronous load of its last
block while r3, ahead of it, is skipped; the load completes (r4 is in
`finished_recving_kv_req_ids`), but r4 sits in `skipped_waiting` behind r3 holding 9 blocks, r3 (17
tokens) needs 6 of the 3 left, and the waiting loop stops at r3 every step. The reservation for
loads in flight does not count what the requests ahead of a load need.

Exits 1 while the bug is present (an AssertionError, or vLLM's own exception), 0 once fixed, 2 where
the installed vLLM does not take this configuration (another release's API) or refuses it at
start-up. Needs vLLM alone.
"""

import collections
import inspect
import json
import os
import sys
import tempfile

import torch
import vllm
import vllm.config.cache
import vllm.config.device
import vllm.config.kv_transfer
import vllm.config.model
import vllm.config.scheduler
import vllm.config.vllm
import vllm.v1.core.sched.scheduler
import vllm.v1.kv_cache_interface
import vllm.v1.structured_output
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request
from vllm.v1.kv_cache_interface import KVCacheTensor
from vllm.v1.request import RequestStatus
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata

print(f"vLLM {vllm.__version__}")
init_none_hash(sha256)  # as vLLM's engine does once per process
block_hasher = get_request_block_hasher(16, sha256)
# the model's architecture, all vLLM's ModelConfig reads (no weights, no tokenizer)
model_dir = tempfile.mkdtemp(prefix="repro-model-")
with open(os.path.join(model_dir, "config.json"), "w") as f:
    json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 2, "vocab_size": 32, "max_position_embeddings": 1048576, "rms_norm_eps": 1e-05, "torch_dtype": "float32"}, f)
def made(cls, *args, **kwargs):
    """``cls(...)`` with the keywords this release takes; one it lacks only at a neutral value."""
    takes = inspect.signature(cls).parameters
    lacking = {k: v for k, v in kwargs.items() if k not in takes}
    if any(v not in (None, 0, False) for v in lacking.values()):
        print(f"vLLM {vllm.__version__}'s {cls.__name__} takes none of {sorted(lacking)}: another release's API")
        sys.exit(2)
    return cls(*args, **{k: v for k, v in kwargs.items() if k in takes})


def tensor(layer, page, num_blocks):
    """One layer's KV cache tensor of ``num_blocks`` pages: ``shared_by`` up to vLLM 0.25, a
    placement (the layer's pages in a row) from 0.30."""
    size = page * num_blocks
    if "shared_by" in inspect.signature(KVCacheTensor).parameters:
        return KVCacheTensor(size=size, shared_by=[layer])
    return KVCacheTensor(size=size, layers=[layer], layer_stride=size, block_stride=page)

# ---- the scheduler at the production shape (the recorded one, every token count scaled)
try:
    model_config = made(vllm.config.model.ModelConfig, model=model_dir, skip_tokenizer_init=True, dtype='float32', max_model_len=64)
    cache_config = made(vllm.config.cache.CacheConfig, block_size=16, enable_prefix_caching=True)
    cache_config.num_gpu_blocks = 13
    scheduler_config = made(vllm.config.scheduler.SchedulerConfig, max_num_seqs=1, max_num_batched_tokens=1, max_model_len=64, enable_chunked_prefill=True, is_encoder_decoder=False, async_scheduling=False)
    kv_transfer_config = made(vllm.config.kv_transfer.KVTransferConfig, kv_connector='OffloadingConnector', kv_role='kv_both', kv_connector_extra_config={'cpu_bytes_to_use': 567979}, kv_load_failure_policy='recompute')
    device_config = made(vllm.config.device.DeviceConfig, device='cpu')
    vllm_config = made(vllm.config.vllm.VllmConfig, model_config=model_config, cache_config=cache_config, scheduler_config=scheduler_config, device_config=device_config, kv_transfer_config=kv_transfer_config)
    kv_cache_config = made(vllm.v1.kv_cache_interface.KVCacheConfig, num_blocks=13, kv_cache_tensors=[tensor('layer0', 128, 13), tensor('layer1', 256, 13), tensor('layer2', 384, 13)], kv_cache_groups=[vllm.v1.kv_cache_interface.KVCacheGroupSpec(layer_names=['layer0'], kv_cache_spec=vllm.v1.kv_cache_interface.FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32, head_size_v=1)), vllm.v1.kv_cache_interface.KVCacheGroupSpec(layer_names=['layer1'], kv_cache_spec=vllm.v1.kv_cache_interface.FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=2, dtype=torch.float32, head_size_v=2)), vllm.v1.kv_cache_interface.KVCacheGroupSpec(layer_names=['layer2'], kv_cache_spec=vllm.v1.kv_cache_interface.FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=3, dtype=torch.float32, head_size_v=3))], prefix_cache_retention_interval=None)
    cache_config.block_size = 16
    vllm_config.validate_block_size()  # vLLM's own start-up check
    structured_output_manager = made(vllm.v1.structured_output.StructuredOutputManager, vllm_config)
    scheduler = made(vllm.v1.core.sched.scheduler.Scheduler, vllm_config=vllm_config, kv_cache_config=kv_cache_config, structured_output_manager=structured_output_manager, block_size=16, log_stats=True)
except TypeError as e:  # another release's signature: no answer either way
    print(f"vLLM {vllm.__version__} does not take the scheduler written for vLLM 0.30.0: {e}")
    sys.exit(2)
except (AssertionError, ValueError, NotImplementedError) as e:  # its own start-up checks: not a find
    print(f"vLLM {vllm.__version__} refuses this configuration at start-up: {type(e).__name__}: {e}")
    sys.exit(2)

# ---- the model: the recorded tokens, each full block of a prompt made 16 tokens (its own repeated)
TOKENS = {'r0': [1, 2, 1, 1, 2, 1, 1, 2, 1, 1, 2, 1, 1, 2, 1, 1, 3], 'r1': [0, 0, 1, 0, 0, 1, 0, 0, 1, 0, 0, 1, 0, 0, 1, 0, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 1, 2, 2, 1, 2, 2, 1, 2, 2, 1, 2, 2, 1, 2, 2, 1, 1, 2], 'r2': [1, 2, 1, 1, 2, 1, 1, 2, 1, 1, 2, 1, 1, 2, 1, 1, 3], 'r3': [1, 2, 1, 1, 2, 1, 1, 2, 1, 1, 2, 1, 1, 2, 1, 1, 1, 1], 'r4': [0, 0, 1, 0, 0, 1, 0, 0, 1, 0, 0, 1, 0, 0, 1, 0, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 1, 2, 2, 1, 2, 2, 1, 2, 2, 1, 2, 2, 1, 2, 2, 1, 1]}
DRAFTS = {'r0': {}, 'r1': {}, 'r2': {}, 'r3': {}, 'r4': {}}
SYNC_LOADS = True  # the worker completes a load in the step that starts it
JUDGE_LIVENESS = True  # the drain's bound is this script's property

# ---- the property kvprop found broken (liveness)
def scheduled(output):
    pass


def transferred(job, load, ok):
    pass


def computed(output, at):
    pass


def check():
    pass


transfers = {}  # job id -> (request id, is a load, the job)
stores_due = []  # store jobs issued last step: they read their blocks after this step's pass
done = {"jobs": set(), "recving": set(), "failed": set(), "failed_jobs": set()}
REPORTS_FAILED = "failed_jobs" in inspect.signature(OffloadingWorkerMetadata).parameters
INDEXED = "req_id_to_index" in inspect.signature(ModelRunnerOutput).parameters


def add(request_id, prompt, max_tokens, extra_args=None):
    """A request arrives."""
    params = SamplingParams(max_tokens=max_tokens, **({"extra_args": extra_args} if extra_args else {}))
    request = Request(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        sampling_params=params,
        pooling_params=None,
        block_hasher=block_hasher,
    )
    scheduler.add_request(request)


def complete(job_id, ok=True):
    """The worker finishes a transfer job; the scheduler hears of it with the next output."""
    if job_id not in transfers:
        return
    request_id, load, job = transfers.pop(job_id)
    transferred(job, load, ok)
    if load and not ok:
        done["failed"].add(request_id)
        done["failed_jobs"].add(job_id)
    done["jobs"].add(job_id)
    if load:
        done["recving"].add(request_id)


def finish_load(request_id, ok):
    """The worker's load for ``request_id`` completes (``ok``) or fails; a failure only where the
    release's worker reports one (``failed_jobs``: vLLM 0.34.0 on)."""
    if not ok and not REPORTS_FAILED:
        return
    for job_id, (rid, load, _) in list(transfers.items()):
        if load and rid == request_id:
            complete(job_id, ok)


def connector_output():
    global done
    finished, done = done, {"jobs": set(), "recving": set(), "failed": set(), "failed_jobs": set()}
    failures = {"failed_jobs": finished["failed_jobs"]} if REPORTS_FAILED else {}
    return KVConnectorOutput(
        finished_recving=finished["recving"] or None,
        kv_connector_worker_meta=OffloadingWorkerMetadata(
            completed_jobs=dict.fromkeys(finished["jobs"], 1), **failures
        ),
        invalid_block_ids=set(),
        **({"failed_recving": finished["failed"]} if REPORTS_FAILED else {}),
    )


def verified(request_id, num_tokens, drafts):
    """What the model samples after ``num_tokens`` tokens given ``drafts``: the leading drafts it
    agrees with, then its own next token."""
    tokens, out = TOKENS[request_id], []
    for draft in drafts:
        if draft != tokens[num_tokens + len(out)]:
            break
        out.append(draft)
    return [*out, tokens[num_tokens + len(out)]]


def starts(output):
    """Where each scheduled request's tokens start."""
    at = {new.req_id: new.num_computed_tokens for new in output.scheduled_new_reqs}
    cached = output.scheduled_cached_reqs
    at.update(zip(cached.req_ids, cached.num_computed_tokens))
    return at


def step():
    """One engine step: schedule, run the connector's jobs and the model, hand the output back."""
    output = scheduler.schedule()
    scheduled(output)
    meta = getattr(output, "kv_connector_metadata", None)
    due = list(stores_due)
    stores_due.clear()
    if meta is not None:
        for job_id in getattr(meta, "jobs_to_flush", None) or ():
            complete(job_id)
        for job_id, job in meta.load_jobs.items():
            transfers[job_id] = (job.req_id, True, job)
            if SYNC_LOADS:
                finish_load(job.req_id, True)
    for job_id in due:
        complete(job_id)
    if meta is not None:
        for job_id, job in meta.store_jobs.items():
            transfers[job_id] = (job.req_id, False, job)
            stores_due.append(job_id)
    at = starts(output)
    computed(output, at)
    ids = list(output.num_scheduled_tokens)
    sampled, lengths = [], {}
    for request_id in ids:
        drafts = list(output.scheduled_spec_decode_tokens.get(request_id, ()))
        num_tokens = lengths[request_id] = scheduler.requests[request_id].num_tokens
        reached = at[request_id] + output.num_scheduled_tokens[request_id] - len(drafts) >= num_tokens
        sampled.append(verified(request_id, num_tokens, drafts) if reached else [])
    extra = {"req_id_to_index": {rid: i for i, rid in enumerate(ids)}} if INDEXED else {}
    if scheduler.connector is not None:
        extra["kv_connector_output"] = connector_output()
    scheduler.update_from_output(output, ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled, **extra))
    proposals = {}
    for request_id, before in lengths.items():
        request = scheduler.requests.get(request_id)
        if request is not None and request.num_tokens > before and request.num_tokens in DRAFTS[request_id]:
            proposals[request_id] = DRAFTS[request_id][request.num_tokens]
    if proposals:
        scheduler.update_draft_token_ids(
            DraftTokenIds(req_ids=list(proposals), draft_token_ids=list(proposals.values()))
        )
    return output


def drain():
    """No more arrivals: every load in flight completes, then a step, until no request is left;
    past the bound the engine has stopped making progress."""
    work = sum(r.num_tokens + r.sampling_params.max_tokens for r in scheduler.requests.values())
    bound = 50 + 4 * work * max(1, len(scheduler.requests))
    steps = 0
    while scheduler.requests:
        for request_id in sorted({rid for rid, load, _ in transfers.values() if load}):
            finish_load(request_id, True)
        if steps >= bound and not JUDGE_LIVENESS:
            break  # another property is this script's: past the bound it has nothing more to see
        assert steps < bound, (
            f"liveness: {len(scheduler.requests)} request(s) still unfinished after {steps} steps with no "
            f"new arrivals: " + ", ".join(f"{rid} ({r.status.name}, {r.num_computed_tokens} of "
            f"{r.num_tokens} tokens computed)" for rid, r in sorted(scheduler.requests.items()))
        )
        step()
        steps += 1
        check()
    return steps

# ---- from kvprop operation 0 (AddRequest)
add('r0', [1, 2, 1, 1, 2, 1, 1, 2, 1, 1, 2, 1, 1, 2, 1, 1], max_tokens=1)

# ---- from kvprop operation 1 (AddRequest)
add('r1', [0, 0, 1, 0, 0, 1, 0, 0, 1, 0, 0, 1, 0, 0, 1, 0, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 1, 2, 2, 1, 2, 2, 1, 2, 2, 1, 2, 2, 1, 2, 2, 1, 1], max_tokens=1)

# ---- from kvprop operation 2 (AddRequest)
add('r2', [1, 2, 1, 1, 2, 1, 1, 2, 1, 1, 2, 1, 1, 2, 1, 1], max_tokens=1)

# ---- from kvprop operation 3 (AddRequest)
add('r3', [1, 2, 1, 1, 2, 1, 1, 2, 1, 1, 2, 1, 1, 2, 1, 1, 1], max_tokens=1)

# ---- from kvprop operation 4 (AddRequest)
add('r4', [0, 0, 1, 0, 0, 1, 0, 0, 1, 0, 0, 1, 0, 0, 1, 0, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 1, 2, 2, 1, 2, 2, 1, 2, 2, 1, 2, 2, 1, 2, 2, 1], max_tokens=1)

# ---- from kvprop's drain (engine steps until every request has finished)
drain()

print("OK: liveness holds; the bug is fixed")
