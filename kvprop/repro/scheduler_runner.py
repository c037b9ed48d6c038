"""The part of a ``vllm-scheduler`` reproducer that plays what kvprop played: the model runner
and the offloading connector's worker, as source text for the script (``vllm_scheduler_script``).

It is the same behaviour as ``kvprop.targets.vllm.scheduler.SchedulerEngine.step`` and
``kvprop.targets.vllm.offload.OffloadWorker``, restated over vLLM's objects alone: a step
schedules, starts the connector's jobs (a synchronous load completes at once; a store reads
its blocks after the next step's pass, or before it when the scheduler flushes it), answers
each request whose scheduled tokens reach its end with the drafts the model accepts and the
token after them (``TOKENS``), hands the output back with the worker's report, then offers
each request that grew its next drafts (``DRAFTS``). The drain is kvprop's: every load in
flight completes, then a step, until no request is left or the bound passes.
"""

RUNNER = '''
transfers = {}  # job id -> (request id, is a load)
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
    request_id, load = transfers.pop(job_id)
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
    for job_id, (rid, load) in list(transfers.items()):
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
    meta = getattr(output, "kv_connector_metadata", None)
    due = list(stores_due)
    stores_due.clear()
    if meta is not None:
        for job_id in getattr(meta, "jobs_to_flush", None) or ():
            complete(job_id)
        for job_id, job in meta.load_jobs.items():
            transfers[job_id] = (job.req_id, True)
            if SYNC_LOADS:
                finish_load(job.req_id, True)
    for job_id in due:
        complete(job_id)
    if meta is not None:
        for job_id, job in meta.store_jobs.items():
            transfers[job_id] = (job.req_id, False)
            stores_due.append(job_id)
    at = starts(output)
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
        for request_id in sorted({rid for rid, load in transfers.values() if load}):
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
