"""vLLM's v1 Scheduler at a production shape: full attention and a Mamba group with prefill
checkpoints (every `mamba_mixer2` layer's: one checkpoint block, alignment 1) in blocks of 48, the
block vLLM's `_align_hybrid_block_size` gives Zamba2-2.7B's dimensions (a `mamba_mixer2` model: a
state of 686,848 bytes, 20,480 bytes of attention KV per token: the smallest multiple of
FlashAttention's kernel block of 16 whose attention page holds a state), prefix-match unit 1
(`prefix_match_unit`, which vLLM takes for any unit dividing the block sizes), a token budget of
256, and a pool of 11 usable blocks.

Step A: r6 (65 tokens) is prefilled in one chunk; full attention keys its block 1 at 64 tokens
(`_cache_partial_tail_block`) and the Mamba group keeps the state after 64 tokens (the prompt's
checkpoint). Step B: re's decode crosses a block boundary and rf's last prompt token needs a block
for its copy; the pool is full, so the scheduler preempts r6, and those two allocations take r6's
running state block and both of its attention blocks, so its attention prefix is gone while the
state after 64 tokens stays cached. Step C: r6 comes back (66 tokens) without a hit and recomputes
from token 0: full attention keys its new block 1 at 64 tokens, which this step's forward pass
computes, and its Mamba checkpoint is now at 65. r7, r6's prompt and one token more, is admitted
next in the same step and hits 64 tokens: the attention blocks r6 keyed this step, and the state
after 64 tokens cached in step A, which the same-step sentinel (`cached_blocks_this_step`) does not
hold back. `_apply_cow` queues the copy of r6's block 1, which the worker applies before the
forward pass: r7 attends, at positions 48 to 63, to what the block held before the step. Attention
groups have no counterpart of the state group's sentinel.

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
block_hasher = get_request_block_hasher(1, sha256)
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

# ---- the scheduler: full attention and a Mamba group with checkpoints, blocks of 48, prefix-match unit 1
BLOCK, UNIT, BUDGET, NUM_BLOCKS = 48, 1, 256, 12
try:
    model_config = made(vllm.config.model.ModelConfig, model=model_dir, skip_tokenizer_init=True, dtype='float32', max_model_len=4 * BLOCK)
    cache_config = made(vllm.config.cache.CacheConfig, block_size=BLOCK, enable_prefix_caching=True, mamba_cache_mode='align', prefix_match_unit=UNIT)
    cache_config.num_gpu_blocks = NUM_BLOCKS
    scheduler_config = made(vllm.config.scheduler.SchedulerConfig, max_num_seqs=8, max_num_batched_tokens=BUDGET, max_model_len=4 * BLOCK, enable_chunked_prefill=True, is_encoder_decoder=False, async_scheduling=False)
    device_config = made(vllm.config.device.DeviceConfig, device='cpu')
    vllm_config = made(vllm.config.vllm.VllmConfig, model_config=model_config, cache_config=cache_config, scheduler_config=scheduler_config, device_config=device_config)
    kv_cache_config = made(vllm.v1.kv_cache_interface.KVCacheConfig, num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[vllm.v1.kv_cache_interface.KVCacheGroupSpec(layer_names=['layer0'], kv_cache_spec=vllm.v1.kv_cache_interface.FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32, head_size_v=1)), vllm.v1.kv_cache_interface.KVCacheGroupSpec(layer_names=['layer1'], kv_cache_spec=vllm.v1.kv_cache_interface.MambaSpec(block_size=BLOCK, shapes=((2,),), dtypes=(torch.float32,), mamba_cache_mode='align', num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1))], prefix_cache_retention_interval=None)
    cache_config.block_size = BLOCK
    vllm_config.validate_block_size()  # vLLM's own start-up check
    structured_output_manager = made(vllm.v1.structured_output.StructuredOutputManager, vllm_config)
    scheduler = made(vllm.v1.core.sched.scheduler.Scheduler, vllm_config=vllm_config, kv_cache_config=kv_cache_config, structured_output_manager=structured_output_manager, block_size=BLOCK, log_stats=True, hash_block_size=UNIT)
except TypeError as e:  # another release's signature: no answer either way
    print(f"vLLM {vllm.__version__} does not take this scheduler: {e}")
    sys.exit(2)
except (AssertionError, ValueError, NotImplementedError) as e:  # its own start-up checks: not a find
    print(f"vLLM {vllm.__version__} refuses this configuration at start-up: {type(e).__name__}: {e}")
    sys.exit(2)

# ---- the model: each request's prompt, then the tokens it samples
P = [100 + i for i in range(65)]  # r6's prompt: its last hash boundary, 64, is inside block 1
PE = [700 + i for i in range(95)]  # re's prompt: its second decode needs a block at 96
PF = [500 + i for i in range(17)]  # rf's prompt: its chunk stops at 16, inside block 0; its last token needs a block for the copy
PG = [600]  # rg's prompt: one token, nothing of it is keyed
TOKENS = {'re': PE + [7, 7, 7], 'rf': PF + [7], 'rg': PG + [7, 7], 'r6': P + [7, 7], 'r7': P + [8, 7]}
DRAFTS = {'re': {}, 'rf': {}, 'rg': {}, 'r6': {}, 'r7': {}}
SYNC_LOADS = False  # the worker completes a load in the step that starts it
JUDGE_LIVENESS = False  # the drain's bound is this script's property

# ---- the property kvprop found broken (data-mismatch)
memory = {}  # (block id, offset) -> (group, position, prefix) the worker wrote there last
cpu_tier = {}  # CPU block id -> {offset: value}
tables = {}  # request id -> the block ids the worker holds, per group
GROUPS = [group.kv_cache_spec for group in kv_cache_config.kv_cache_groups]
ATTENTION = [g for g, spec in enumerate(GROUPS) if type(spec).__name__ != "MambaSpec"]
SIZE = scheduler.block_size


def value(group, position, tokens):
    return (group, position, hash(tuple(tokens[: position + 1])))


def scheduled(output):
    """The worker's block tables: a new request's ids; a running one's new ids appended (a
    resumed one's replaced); then the block copies, before the pass (vLLM 0.30 on)."""
    for new in output.scheduled_new_reqs:
        tables[new.req_id] = [list(ids) for ids in new.block_ids]
    cached = output.scheduled_cached_reqs
    resumed = getattr(cached, "resumed_req_ids", None)
    flags = getattr(cached, "resumed_from_preemption", None)
    for i, request_id in enumerate(cached.req_ids):
        new_ids = cached.new_block_ids[i]
        again = request_id in resumed if resumed is not None else flags is not None and flags[i]
        if again or request_id not in tables:
            tables[request_id] = [list(ids) for ids in new_ids] if new_ids else [[] for _ in GROUPS]
        elif new_ids:
            for table, ids in zip(tables[request_id], new_ids):
                table.extend(ids)
    for copy in getattr(output, "kv_cache_block_copies", None) or ():
        for offset in range(SIZE):
            memory[(copy.dst_block_id, offset)] = memory.get((copy.src_block_id, offset))


def transferred(job, load, ok):
    """A store reads its GPU blocks into the CPU tier; a load that succeeds writes them back."""
    src, dst = job.transfer_spec if hasattr(job, "transfer_spec") else (job.src_spec, job.dst_spec)
    gpu, cpu = (dst, src) if load else (src, dst)
    for gpu_id, cpu_id in zip(gpu.block_ids, cpu.block_ids):
        if not load:
            cpu_tier[int(cpu_id)] = {o: memory.get((int(gpu_id), o)) for o in range(SIZE)}
        elif ok:
            for offset, held in cpu_tier.get(int(cpu_id), {}).items():
                memory[(int(gpu_id), offset)] = held


def computed(output, at):
    """The pass writes every scheduled position of every attention group (drafts included), then
    attends to every position before each request's end: each must read back its own data."""
    manager = scheduler.kv_cache_manager
    null = manager.block_pool.null_block.block_id
    tokens = {}
    for request_id, n in output.num_scheduled_tokens.items():
        request = scheduler.requests[request_id]
        tokens[request_id] = [*request.all_token_ids, *output.scheduled_spec_decode_tokens.get(request_id, ())]
        for g in ATTENTION:
            table = tables[request_id][g]
            for position in range(at[request_id], at[request_id] + n):
                memory[(table[position // SIZE], position % SIZE)] = value(g, position, tokens[request_id])
    for request_id, n in output.num_scheduled_tokens.items():
        for g in ATTENTION:
            table = tables[request_id][g]
            for position in range(at[request_id] + n):
                block_id = table[position // SIZE]
                if block_id == null:
                    continue
                held = memory.get((block_id, position % SIZE))
                assert held == value(g, position, tokens[request_id]), (
                    f"{request_id} group {g} attends to position {position} in block {block_id}, which holds "
                    + ("nothing written there" if held is None else f"position {held[1]} of group {held[0]}"
                       + (" for another prefix" if held[:2] == (g, position) else ""))
                    + ": the pass reads data no pass wrote for this prefix"
                )


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

# ---- step 0: re is prefilled
add('re', PE, max_tokens=3)
step()

# ---- step A: rf's chunk stops at 16; rg (one token) and r6 (65 tokens) are prefilled; the pool is full
add('rf', PF, max_tokens=1)
add('rg', PG, max_tokens=2)
add('r6', P, max_tokens=2)
step()

# ---- step B: re and rf need three blocks; r6 is preempted and its attention blocks are taken
step()

# ---- step C: r6 comes back without a hit; r7 arrives and hits 64 tokens inside r6's new block 1
add('r7', P + [8], max_tokens=1)
drain()

print("OK: data-mismatch holds; the bug is fixed")
