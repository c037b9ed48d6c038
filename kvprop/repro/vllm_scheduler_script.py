"""A find on the ``vllm-scheduler`` target as a Python script that needs only vLLM.

The script writes the tiny model configuration vLLM's ``ModelConfig`` reads, builds the
scheduler by the recorded constructor calls (``Recipe``; a keyword the installed release does
not take is dropped only at its neutral value, as kvprop's adapter does, else exit 2), plays
the model runner and the offloading connector's worker (``scheduler_runner``), makes kvprop's
acts in order — each under a comment naming the kvprop operation it came from — and states
the broken property: the drain's bound (``liveness``), vLLM's own exception
(``target-crash``), the pool's state after every act (the block kinds of ``vllm_script``),
the blocks an allocation hands the connector (``connector-handoff``), the events a router
replays (``script_events``), or what each pass attends to (``data-mismatch``, attention
groups). Trace data reaches the script only as values written by ``repr``.
"""

from __future__ import annotations

import json
import textwrap

from kvprop.repro.scheduler_runner import DATA, NO_DATA, PIPELINED, RUNNER
from kvprop.repro.script_events import EVENT_KINDS, EVENTS
from kvprop.repro.vllm_scheduler_record import SchedulerRecording
from kvprop.repro.vllm_script import CHECKS as POOL_CHECKS
from kvprop.repro.vllm_script import constructor, where
from kvprop.targets.vllm.recipe import Assigned, Checked, Made, Recipe

HANDOFF = '''
def watch_handoffs(manager):
    """Every block an allocation hands the connector for external tokens must be the request's
    alone and uncached: the load writes it without looking at anyone else (checked as the
    scheduler's allocate_slots returns, calling through with the same arguments)."""
    allocate = manager.allocate_slots

    def allocate_slots(request, num_new_tokens, *args, **kwargs):
        local = request.num_computed_tokens + kwargs.get("num_new_computed_tokens", 0)
        external = kwargs.get("num_external_computed_tokens", 0)
        result = allocate(request, num_new_tokens, *args, **kwargs)
        if result is None or not external:
            return result
        pool, size = manager.block_pool, scheduler.block_size
        for group, table in enumerate(manager.get_block_ids(request.request_id)):
            for index in range(local // size, -(-(local + external) // size)):
                block = pool.blocks[table[index]]
                if block.block_id == pool.null_block.block_id:
                    continue
                assert block.ref_cnt == 1 and block.block_hash is None, (
                    f"block {block.block_id} handed to the connector for {request.request_id!r} group {group} is "
                    f"not its own alone and uncached (ref_cnt={block.ref_cnt}, cached={block.block_hash is not None}); "
                    "the load overwrites what others read"
                )
        return result

    manager.allocate_slots = allocate_slots
'''

# The kinds a script states: the drain's bound, vLLM's exception, the blocks an allocation hands the
# connector (``watch_handoffs``), the events (``watch_events``) and the pool after every act (``check``).
SUPPORTED = ("target-crash", "liveness", "connector-handoff", "data-mismatch", *EVENT_KINDS, *POOL_CHECKS)


def supported(kind: str) -> bool:
    return kind in SUPPORTED


def value_source(x, recipe: Recipe, modules: set) -> str:
    """``x`` as source: an object the recipe made by its name, the model folder by the script's
    own, anything else as ``constructor`` writes it."""
    name = recipe.name_of(x)
    if name is not None:
        return name
    if isinstance(x, str) and x == recipe.model_dir:
        return "model_dir"
    if isinstance(x, list):
        return "[" + ", ".join(value_source(item, recipe, modules) for item in x) + "]"
    return constructor(x, modules)


def recipe_lines(recipe: Recipe, modules: set) -> list[str]:
    """The constructor calls, one statement each."""
    lines = []
    for step in recipe.steps:
        if isinstance(step, Made):
            modules.add(step.cls.__module__)
            args = [value_source(a, recipe, modules) for a in step.args]
            args += [f"{k}={value_source(v, recipe, modules)}" for k, v in step.kwargs]
            call = f"made({step.cls.__module__}.{step.cls.__qualname__}, {', '.join(args)})"
            lines.append(f"{step.name} = {call}")
        elif isinstance(step, Assigned):
            lines.append(f"{step.name}.{step.attr} = {value_source(step.value, recipe, modules)}")
        elif isinstance(step, Checked):
            lines.append(f"{step.name}.{step.method}()  # vLLM's own start-up check")
    return lines


MADE = '''
def made(cls, *args, **kwargs):
    """``cls(...)`` with the keywords this release takes; one it lacks only at a neutral value.
    A class that passes its keywords on (``AsyncScheduler``) takes those of its base."""
    takes = inspect.signature(cls).parameters
    if any(p.kind is p.VAR_KEYWORD for p in takes.values()):
        takes = inspect.signature(cls.__mro__[1]).parameters
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
'''


def act_lines(act) -> list[str]:
    if act.name == "add":
        rid, prompt, max_tokens, extra = act.args
        tail = f", extra_args={extra!r}" if extra else ""
        return [f"add({rid!r}, {list(prompt)!r}, max_tokens={max_tokens!r}{tail})"]
    if act.name == "finish_load":
        return [f"finish_load({act.args[0]!r}, ok={act.args[1]!r})"]
    if act.name == "finish":
        return [f"scheduler.finish_requests({act.args[0]!r}, RequestStatus.{act.args[1]})"]
    if act.name == "reset":
        return ["scheduler.reset_prefix_cache()"]
    return [f"{act.name}()"]


def render(recording: SchedulerRecording, steps: tuple, kind: str, sentence: str, version: str) -> str:
    """The reproducer's source."""
    recipe = recording.recipe
    modules: set = set()
    built = recipe_lines(recipe, modules)
    engine = recording.engine
    s, v = engine.s, engine.allocator.v
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata

    tokens = {rid: list(model.tokens) for rid, model in recording.models}
    drafts = {rid: {n: list(d) for n, d in model.drafts} for rid, model in recording.models}
    header = [
        '"""A reproducer for vLLM\'s v1 Scheduler (vLLM ' + version + "), written by kvprop report.",
        "",
        f"Broken: {sentence}.",
        "It builds the scheduler kvprop drove, plays its model runner and its offloading connector's worker",
        "as kvprop did, makes kvprop's calls in order, and exits 1 while the bug is present (an",
        "AssertionError, or vLLM's own exception), 0 once fixed, 2 where the installed vLLM does not take",
        "this configuration (another release's API) or refuses it at start-up.",
        '"""',
        "",
        "import collections",
        "import inspect",
        "import json",
        "import os",
        "import sys",
        "import tempfile",
        "",
    ]
    header += [f"os.environ[{k!r}] = {val!r}  # read when the scheduler is built" for k, val in recipe.env.items()]
    header += [f"import {m}" for m in sorted(modules | {"vllm"})]
    header += [
        f"from {v.SamplingParams.__module__} import SamplingParams",
        f"from {v.sha256.__module__} import sha256",
        f"from {v.kvu.__name__} import get_request_block_hasher, init_none_hash",
        f"from {v.Request.__module__} import Request",
        f"from {v.kvi.__name__} import KVCacheTensor",
        f"from {s.RequestStatus.__module__} import RequestStatus",
        f"from {s.ModelRunnerOutput.__module__} import DraftTokenIds, ModelRunnerOutput",
        f"from {s.KVConnectorOutput.__module__} import KVConnectorOutput",
        f"from {OffloadingWorkerMetadata.__module__} import OffloadingWorkerMetadata",
        *(
            [f"from {v.kv_events.__name__} import AllBlocksCleared, BlockRemoved, BlockStored"]
            if kind in EVENT_KINDS
            else []
        ),
        "",
        'print(f"vLLM {vllm.__version__}")',
        "init_none_hash(sha256)  # as vLLM's engine does once per process",
        f"block_hasher = get_request_block_hasher({recipe_unit(recording)!r}, sha256)",
        "# the model's architecture, all vLLM's ModelConfig reads (no weights, no tokenizer)",
        'model_dir = tempfile.mkdtemp(prefix="repro-model-")',
        'with open(os.path.join(model_dir, "config.json"), "w") as f:',
        f"    json.dump({json.dumps(recipe.model)}, f)",
        *MADE.strip("\n").splitlines(),
        "",
        "# ---- the scheduler, as kvprop built it",
        "try:",
        *[f"    {line}" for line in built],
        "except TypeError as e:  # another release's signature: no answer either way",
        f'    print(f"vLLM {{vllm.__version__}} does not take the scheduler written for vLLM {version}: {{e}}")',
        "    sys.exit(2)",
        "except (AssertionError, ValueError, NotImplementedError) as e:  # its own start-up checks: not a find",
        '    print(f"vLLM {vllm.__version__} refuses this configuration at start-up: {type(e).__name__}: {e}")',
        "    sys.exit(2)",
        "",
        "# ---- kvprop's model: a request's tokens are a function of its prefix (prompt first), and",
        "# so are the drafts an n-gram proposer offers once it holds n tokens",
        f"TOKENS = {tokens!r}",
        f"DRAFTS = {drafts!r}",
        f"SYNC_LOADS = {engine.config.connector == 'sync'!r}  # the worker completes a load in the step that starts it",
        f"JUDGE_LIVENESS = {kind == 'liveness'!r}  # the drain's bound is this script's property",
        f"DEPTH = {engine.config.pipeline_depth}  # batches in flight at once (1: each step completes its own)",
        *_checks(kind),
        *RUNNER.strip("\n").splitlines(),
        *(["", "", *PIPELINED.strip("\n").splitlines()] if engine.config.pipeline_depth > 1 else []),
    ]
    if kind in EVENT_KINDS:
        header += ["", *EVENTS.strip("\n").splitlines(), "", "", "watch_events(scheduler.kv_cache_manager)"]
    if kind == "connector-handoff":
        header += ["", *HANDOFF.strip("\n").splitlines(), "", "", "watch_handoffs(scheduler.kv_cache_manager)"]
    body: list[str] = []
    last_op = None
    for act in recording.acts:
        if act.op != last_op:
            body += ["", f"# ---- from {where(act.op, steps)}"]
            last_op = act.op
        body += act_lines(act)
        if act.name != "drain" and (kind in POOL_CHECKS or kind in EVENT_KINDS or kind == "data-mismatch"):
            body.append("check()")
    tail = ["", f'print("OK: {kind} holds; the bug is fixed")']
    if kind == "target-crash":
        tail = ["", "# A call above raises while the bug is present: kvprop's target-crash find.", tail[1]]
    return "\n".join(header + body + tail) + "\n"


def recipe_unit(recording: SchedulerRecording) -> int:
    return recording.engine.allocator.config.unit


def _checks(kind: str) -> list[str]:
    """``check()`` for ``kind``, run after every act: a no-op unless the kind's property is the pool's
    or the events'."""
    check = POOL_CHECKS.get(kind)
    lines = ["", f"# ---- the property kvprop found broken ({kind})"]
    if kind == "data-mismatch":
        return [*lines, *DATA.strip("\n").splitlines(), "", ""]
    lines += [*NO_DATA.strip("\n").splitlines(), "", "", "def check():"]
    if kind in EVENT_KINDS:
        lines.append("    scheduler.kv_cache_manager.take_events()  # the events it holds for its next publication")
    elif check is None:
        lines.append("    pass")
    else:
        lines += [
            "    manager = scheduler.kv_cache_manager",
            "    live = list(scheduler.requests)",
            "    null = manager.block_pool.null_block.block_id",
            *textwrap.indent(check.strip("\n"), "    ").splitlines(),
        ]
    return [*lines, "", ""]
