"""vLLM's v1 Scheduler at a production shape: full attention and a sliding window of 128 (gpt-oss's
layers) in blocks of 16 (the smallest block FlashAttention, FlashInfer and Triton attention take),
prefix-cache retention interval 0 (vLLM's default), KV cache events on, a token budget of 2048, and
requests asking for the full KV cache report (`extra_args={"kv_cache_report_mode": "full"}`).

r1 (160 tokens) is computed and finishes; r2, r1's prompt and 5 tokens more, hits 144 of them, the
last boundary whose window retention kept: full attention holds the 9 blocks, the window the last 8
(`[null, block, ...]` in its table). `KVCacheManager.get_computed_blocks` calls `emit_cached_block_events`, which announces the
request's block hash at every index below `len(group_blocks)`, the null entries included: a
`BlockStored` with the window's `group_idx` for hashes that group does not hold. A router replaying
the events learns a prefix the group lacks, and no `BlockRemoved` ever retracts it.

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
import vllm.config.kv_events
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
    json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 2, "vocab_size": 32000, "max_position_embeddings": 1048576, "rms_norm_eps": 1e-05, "torch_dtype": "float32"}, f)
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

# ---- the scheduler: full attention and a window of 128, blocks of 16, retention 0, events on
BLOCK, WINDOW, MAX_LEN, BUDGET, NUM_BLOCKS = 16, 128, 1024, 2048, 160
try:
    model_config = made(vllm.config.model.ModelConfig, model=model_dir, skip_tokenizer_init=True, dtype='float32', max_model_len=MAX_LEN)
    cache_config = made(vllm.config.cache.CacheConfig, block_size=BLOCK, enable_prefix_caching=True, prefix_cache_retention_interval=0)
    cache_config.num_gpu_blocks = NUM_BLOCKS
    scheduler_config = made(vllm.config.scheduler.SchedulerConfig, max_num_seqs=8, max_num_batched_tokens=BUDGET, max_model_len=MAX_LEN, enable_chunked_prefill=True, is_encoder_decoder=False, async_scheduling=False)
    kv_events_config = made(vllm.config.kv_events.KVEventsConfig, enable_kv_cache_events=True, publisher='null')
    device_config = made(vllm.config.device.DeviceConfig, device='cpu')
    vllm_config = made(vllm.config.vllm.VllmConfig, model_config=model_config, cache_config=cache_config, scheduler_config=scheduler_config, device_config=device_config, kv_events_config=kv_events_config)
    kv_cache_config = made(vllm.v1.kv_cache_interface.KVCacheConfig, num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[vllm.v1.kv_cache_interface.KVCacheGroupSpec(layer_names=['layer0'], kv_cache_spec=vllm.v1.kv_cache_interface.FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32, head_size_v=1)), vllm.v1.kv_cache_interface.KVCacheGroupSpec(layer_names=['layer1'], kv_cache_spec=vllm.v1.kv_cache_interface.SlidingWindowSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32, head_size_v=1, sliding_window=WINDOW))], prefix_cache_retention_interval=0)
    cache_config.block_size = BLOCK
    vllm_config.validate_block_size()  # vLLM's own start-up check
    structured_output_manager = made(vllm.v1.structured_output.StructuredOutputManager, vllm_config)
    scheduler = made(vllm.v1.core.sched.scheduler.Scheduler, vllm_config=vllm_config, kv_cache_config=kv_cache_config, structured_output_manager=structured_output_manager, block_size=BLOCK, log_stats=True)
except TypeError as e:  # another release's signature: no answer either way
    print(f"vLLM {vllm.__version__} does not take this scheduler: {e}")
    sys.exit(2)
except (AssertionError, ValueError, NotImplementedError) as e:  # its own start-up checks: not a find
    print(f"vLLM {vllm.__version__} refuses this configuration at start-up: {type(e).__name__}: {e}")
    sys.exit(2)

# ---- the model: each request's prompt, then the one token it samples
P1 = [100 + i for i in range(160)]
P2 = P1 + [900 + i for i in range(5)]
TOKENS = {'r1': P1 + [7], 'r2': P2 + [7]}
DRAFTS = {'r1': {}, 'r2': {}}
SYNC_LOADS = False  # the worker completes a load in the step that starts it
JUDGE_LIVENESS = False  # the drain's bound is this script's property
FULL = {'kv_cache_report_mode': 'full'}

# ---- the property: the KV cache events, replayed as a router replays them
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
ledger = collections.Counter()  # (block hash, group) -> blocks the events say hold it
lookups = set()  # ids of the events a prefix-cache lookup queued: a hit's blocks announced again


def watch_events(manager):
    """Every event the scheduler takes from the manager is replayed; the ones a lookup queued are a
    hit's blocks announced again, and must name keys the events already hold."""
    lookup, take = manager.get_computed_blocks, manager.take_events

    def get_computed_blocks(*args, **kwargs):
        queue = manager.block_pool.kv_event_queue
        before = len(queue)
        result = lookup(*args, **kwargs)
        lookups.update(id(event) for event in queue[before:])
        return result

    def take_events():
        events = take()
        replay(events or ())
        return events

    manager.get_computed_blocks, manager.take_events = get_computed_blocks, take_events


def replay(events):
    for event in events:
        if isinstance(event, AllBlocksCleared):
            ledger.clear()
            continue
        for block_hash in event.block_hashes:
            key = (block_hash, getattr(event, "group_idx", None))
            if isinstance(event, BlockRemoved):
                assert ledger[key] > 0, f"a BlockRemoved for {key}, which no event before stored"
                ledger[key] -= 1
            elif id(event) in lookups:
                assert ledger[key] > 0, (
                    f"a hit's block announced again (BlockStored) under {key}, which the events so far do not "
                    "hold: a router learns a prefix this group does not have, and no BlockRemoved will retract it"
                )
            else:
                ledger[key] += 1

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

watch_events(scheduler.kv_cache_manager)

# ---- r1 is computed and finishes
add('r1', P1, max_tokens=1, extra_args=FULL)
drain()

# ---- r2 hits 144 of r1's tokens; its full report announces the hit's blocks again
add('r2', P2, max_tokens=1, extra_args=FULL)
drain()

print("OK: the events name only keys the groups hold; the bug is fixed")
