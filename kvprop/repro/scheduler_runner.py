"""The part of a ``vllm-scheduler`` reproducer that plays what kvprop played: the model runner
and the offloading connector's worker, as source text for the script (``vllm_scheduler_script``).

It is the same behaviour as ``kvprop.targets.vllm.scheduler.SchedulerEngine.step`` and
``kvprop.targets.vllm.offload.OffloadWorker``, restated over vLLM's objects alone: a step
schedules, starts the connector's jobs (a synchronous load completes at once; a store reads
its blocks after the next step's pass, or before it when the scheduler flushes it), answers
each request whose scheduled tokens reach its end with the drafts the model accepts and the
token after them (``TOKENS``), hands the output back with the worker's report, then offers
each request that grew its next drafts (``DRAFTS``). The drain is kvprop's: every load in
flight completes, then a step, until no request is left or the bound passes. What the worker
writes is seen through three calls a script defines (``NO_DATA`` where its property is not
the data, ``DATA`` where it is): ``scheduled``, ``transferred`` and ``computed``.
"""

NO_DATA = """
def scheduled(output):
    pass


def transferred(job, load, ok):
    pass


def computed(output, at, rows=None):
    pass
"""

# The data the worker writes, restated from kvprop's data oracle (``kvprop.check.data``) for
# attention groups: a pass writes each scheduled position of each attention group through the
# worker's block table (the request's prefix up to it), a block copy copies a block's slots, a
# store reads a GPU block into the CPU tier and a load writes it back; the pass then attends, for
# each scheduled request, to every position before its end (the null block's skipped ones aside),
# and each must read back what it must hold. State groups (``MambaSpec``) are not judged here.
DATA = '''
memory = {}  # (block id, offset) -> (group, position, prefix) the worker wrote there last
cpu_tier = {}  # (CPU chunk id, block within it) -> {offset: value}
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


def chunk_places(gpu, cpu):
    """Each GPU block's place in the CPU tier, (chunk, block within it): a group's blocks start
    ``block_indices[g] % CHUNK`` blocks into its first chunk, and each group takes its chunks
    in turn (vLLM's offloading worker, ``iter_pointer_groups``)."""
    ids, chunks = [int(b) for b in gpu.block_ids], [int(c) for c in cpu.block_ids]
    if CHUNK == 1:
        return [(gpu_id, (chunk, 0)) for gpu_id, chunk in zip(ids, chunks)]
    sizes, firsts = list(gpu.group_sizes), list(gpu.block_indices)  # chunks: 0.30.0 on
    places, start, taken = [], 0, 0
    for size, first in zip(sizes, firsts):
        skip = first % CHUNK if size else 0
        for j in range(size):
            places.append((ids[start + j], (chunks[taken + (skip + j) // CHUNK], (skip + j) % CHUNK)))
        start, taken = start + size, taken + -(-(skip + size) // CHUNK)
    return places


def transferred(job, load, ok):
    """A store reads its GPU blocks into the CPU tier; a load that succeeds writes them back."""
    src, dst = job.transfer_spec if hasattr(job, "transfer_spec") else (job.src_spec, job.dst_spec)
    gpu, cpu = (dst, src) if load else (src, dst)
    for gpu_id, place in chunk_places(gpu, cpu):
        if not load:
            cpu_tier[place] = {o: memory.get((gpu_id, o)) for o in range(SIZE)}
        elif ok:
            for offset, held in cpu_tier.get(place, {}).items():
                memory[(gpu_id, offset)] = held


def computed(output, at, rows=None):
    """The pass writes every scheduled position of every attention group (drafts included), then
    attends to every position before each request's end: each must read back its own data.
    ``rows`` (a batch run after others were scheduled): each request's block tables and tokens
    as the batch was launched, which the pass runs through."""
    manager = scheduler.kv_cache_manager
    null = manager.block_pool.null_block.block_id
    tokens, held_tables = {}, {}
    for request_id in output.num_scheduled_tokens:
        if rows is not None:
            held_tables[request_id], tokens[request_id] = rows[request_id]
        else:
            request = scheduler.requests[request_id]
            held_tables[request_id] = tables[request_id]
            tokens[request_id] = [*request.all_token_ids, *output.scheduled_spec_decode_tokens.get(request_id, ())]
    for request_id, n in output.num_scheduled_tokens.items():
        for g in ATTENTION:
            table = held_tables[request_id][g]
            for position in range(at[request_id], at[request_id] + n):
                memory[(table[position // SIZE], position % SIZE)] = value(g, position, tokens[request_id])
    for request_id, n in output.num_scheduled_tokens.items():
        for g in ATTENTION:
            table = held_tables[request_id][g]
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
'''

RUNNER = '''
TRANSFER = vllm_config.kv_transfer_config
CHUNK = int((TRANSFER.kv_connector_extra_config or {}).get("blocks_per_chunk", 1)) if TRANSFER else 1
if CHUNK > 1:  # a release that ignores the key would run a tier of one block per chunk
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading import config as offloading_config

        TAKES_CHUNKS = "blocks_per_chunk" in inspect.getsource(offloading_config)
    except ImportError:
        TAKES_CHUNKS = False
    if not TAKES_CHUNKS:
        print(f"vLLM {vllm.__version__}'s offloading connector takes no blocks_per_chunk: another release's API")
        sys.exit(2)
transfers = {}  # job id -> (request id, is a load, the job)
in_flight = collections.deque()  # batches scheduled and not yet completed, newest first (DEPTH above 1)
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


def connector_meta(output):
    """The connector's metadata a step carries (None without a connector)."""
    return getattr(output, "kv_connector_metadata", None)


def flushed(meta):
    """The store jobs a step's metadata asks the worker to finish before its pass."""
    return getattr(meta, "jobs_to_flush", None) or ()


def hand_back(output, ids, sampled):
    """The model runner's output for the batch ``output`` scheduled, with the worker's report."""
    extra = {"req_id_to_index": {rid: i for i, rid in enumerate(ids)}} if INDEXED else {}
    if scheduler.connector is not None:
        extra["kv_connector_output"] = connector_output()
    scheduler.update_from_output(output, ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled, **extra))


def step():
    """One engine step: schedule, run the connector's jobs and the model, hand the output back."""
    output = scheduler.schedule()
    scheduled(output)
    meta = connector_meta(output)
    due = list(stores_due)
    stores_due.clear()
    if meta is not None:
        for job_id in flushed(meta):
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
    hand_back(output, ids, sampled)
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
    while scheduler.requests or in_flight:
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
'''

# With batches in flight (``EngineConfig.pipeline_depth`` above 1): the engine core's batch queue
# (``EngineCore.step_with_batch_queue``), as ``kvprop.sim.pipeline.BatchQueue.turn`` and
# ``kvprop.targets.vllm.batches`` run it: schedule ahead while fewer than DEPTH batches are in
# flight, else take the oldest batch's output. The worker takes a batch's tables and transfers as
# it is launched, flushes again just before its pass, and the pass samples the token after each
# row that reaches its request's end, whatever happened to the request since.
PIPELINED = '''
stored_early = set()  # store jobs a flush in their own step ran before the pass
try:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker

    FLUSHES_OWN_STEP = "store_jobs.pop" in inspect.getsource(OffloadingConnectorWorker.handle_preemptions)
except ImportError:  # a release whose worker lives elsewhere: only the stores already submitted are flushed
    FLUSHES_OWN_STEP = False


def flush(meta):
    """Run every store the flush names that the worker holds; from 0.30.0 one of the flush's own
    step too (``handle_preemptions`` pops it from ``store_jobs``)."""
    for job_id in flushed(meta):
        if job_id in meta.store_jobs and job_id not in stored_early and FLUSHES_OWN_STEP:
            transfers[job_id] = (meta.store_jobs[job_id].req_id, False, meta.store_jobs[job_id])
            stored_early.add(job_id)
        if job_id in transfers and not transfers[job_id][1]:
            complete(job_id)


def launch():
    """``schedule()``: the worker takes the batch's tables, its flush and its loads."""
    output = scheduler.schedule()
    scheduled(output)
    meta = connector_meta(output)
    if meta is not None:
        flush(meta)
        for job_id, job in meta.load_jobs.items():
            transfers[job_id] = (job.req_id, True, job)
            if SYNC_LOADS:
                finish_load(job.req_id, True)
    at = starts(output)
    rows, samples = {}, {}
    for request_id, n in output.num_scheduled_tokens.items():
        request = scheduler.requests[request_id]
        rows[request_id] = ([list(table) for table in tables[request_id]], TOKENS[request_id])
        samples[request_id] = at[request_id] + n >= request.num_tokens
    return output, at, rows, samples


def finish(batch):
    """The batch's pass, then its output: the flush again, the pass, the stores due."""
    global stores_due
    output, at, rows, samples = batch
    meta = connector_meta(output)
    if meta is not None:
        flush(meta)
    computed(output, at, rows)
    due, stores_due = stores_due, []
    for job_id in due:
        complete(job_id)
    for job_id, job in (meta.store_jobs.items() if meta is not None else ()):
        if job_id in stored_early:
            stored_early.discard(job_id)
            continue
        transfers[job_id] = (job.req_id, False, job)
        stores_due.append(job_id)
    ids = list(output.num_scheduled_tokens)
    sampled = [
        [TOKENS[rid][at[rid] + output.num_scheduled_tokens[rid]]] if samples[rid] else [] for rid in ids
    ]
    hand_back(output, ids, sampled)


def step():
    """One turn of the batch queue: schedule ahead while fewer than DEPTH are in flight (and the
    batch scheduled something or more work waits), else complete the oldest batch."""
    if scheduler.has_requests():
        output = launch()
        in_flight.appendleft(output)
        if len(in_flight) < DEPTH and (output[0].num_scheduled_tokens or scheduler.has_requests()):
            return output[0]
    if in_flight:
        finish(in_flight.pop())
'''
