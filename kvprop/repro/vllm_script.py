"""A find on the ``vllm`` target as a Python script that needs only vLLM: the reproducer ``kvprop report`` writes.

The script builds the same ``KVCacheManager`` through vLLM's public constructors (each
configuration object written as the constructor call of the installed release's class,
checked to rebuild an equal object), performs the recorded calls (``kvprop.repro.vllm_record``)
in order, and ends with the broken property stated over vLLM's own state, or lets vLLM's
exception propagate for a ``target-crash``. Either way it exits 1 while the bug is present.
Trace data reaches the script only as values written by ``repr`` (ints, lists of ints, the
engine's request ids); comments carry only kvprop's operation class names.
"""

from __future__ import annotations

import dataclasses
import enum

from kvprop.errors import ConfigError
from kvprop.repro.script_events import EVENT_KINDS, EVENTS
from kvprop.repro.vllm_record import MANAGER_CALLS, Call, Computed, Recording, Req

# The broken property, over vLLM's state, for each kind a script can state from it alone.
# ``live`` is the requests built and not freed; ``null`` the null block's id.
CHECKS = {
    "block-in-two-groups": """
groups_of = {}
for request_id in live:
    for group, block_ids in enumerate(manager.get_block_ids(request_id)):
        for block_id in block_ids:
            if block_id != null:
                groups_of.setdefault(block_id, set()).add(group)
in_two = {b: sorted(g) for b, g in sorted(groups_of.items()) if len(g) > 1}
assert not in_two, (
    f"block ids in the block tables of more than one KV cache group at once (block id -> groups): {in_two}; "
    "a block holds one group's KV, so the groups overwrite each other's"
)
""",
    "ref-cnt-mismatch": """
held = collections.Counter(
    b for request_id in live for block_ids in manager.get_block_ids(request_id) for b in block_ids if b != null
)
wrong = {
    b.block_id: (b.ref_cnt, held[b.block_id])
    for b in manager.block_pool.blocks
    if b.block_id != null and b.ref_cnt != held[b.block_id]
}
assert not wrong, (
    f"blocks whose ref_cnt differs from the block-table entries of live requests holding them "
    f"(block id -> (ref_cnt, entries)): {wrong}"
)
""",
    "free-queue-membership": """
free = {b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()}
unreferenced = {b.block_id for b in manager.block_pool.blocks if b.ref_cnt == 0 and b.block_id != null}
assert free == unreferenced, (
    f"the free queue differs from the blocks with ref_cnt 0: in the queue but referenced "
    f"{sorted(free - unreferenced)}, unreferenced but not in the queue {sorted(unreferenced - free)}"
)
""",
    "free-count": """
linked = len(manager.block_pool.free_block_queue.get_all_free_blocks())
counted = manager.block_pool.get_num_free_blocks()
assert counted == linked, f"get_num_free_blocks() says {counted}, but {linked} blocks are linked into the free queue"
""",
}
SUPPORTED = ("target-crash", *EVENT_KINDS, *CHECKS)


def supported(kind: str) -> bool:
    return kind in SUPPORTED


def constructor(x, modules: set) -> str:
    """``x`` as Python source that rebuilds it: a dataclass as its class's constructor call
    (the fields it takes that differ from their defaults), a torch dtype by name."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return repr(x)
    if isinstance(x, enum.Enum):
        modules.add(type(x).__module__)
        return f"{type(x).__module__}.{type(x).__qualname__}.{x.name}"
    if isinstance(x, (list, tuple)):
        items = [constructor(item, modules) for item in x]
        return (
            f"({', '.join(items)},)"
            if isinstance(x, tuple) and len(items) == 1
            else (f"({', '.join(items)})" if isinstance(x, tuple) else f"[{', '.join(items)}]")
        )
    if isinstance(x, dict):
        return "{" + ", ".join(f"{constructor(k, modules)}: {constructor(v, modules)}" for k, v in x.items()) + "}"
    if type(x).__module__ == "torch" and type(x).__name__ == "dtype":
        modules.add("torch")
        return str(x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        cls = type(x)
        modules.add(cls.__module__)
        args = []
        for f in dataclasses.fields(x):
            value = getattr(x, f.name)
            if not f.init or (f.default is not dataclasses.MISSING and value == f.default):
                continue
            args.append(f"{f.name}={constructor(value, modules)}")
        return f"{cls.__module__}.{cls.__qualname__}({', '.join(args)})"
    raise ConfigError(f"kvprop report: vLLM's manager is built with a {type(x).__name__}, which a script cannot state")


def _value(x) -> str:
    if isinstance(x, Req):
        return f"requests[{x.request_id!r}]"
    if isinstance(x, Computed):
        return f"computed{x.number}[0]"
    return repr(x)


def call_lines(call: Call) -> list[str]:
    """The script's lines for one recorded call."""
    if call.name == "Request":
        rid, prompt, max_tokens, extra = call.args
        params = f"max_tokens={max_tokens!r}" + (f", extra_args={extra!r}" if extra is not None else "")
        return [
            f"requests[{rid!r}] = Request(request_id={rid!r}, prompt_token_ids={prompt!r}, "
            f"sampling_params=SamplingParams({params}), pooling_params=None, block_hasher=block_hasher)"
        ]
    if call.name == "append_output_token_ids":
        return [f"requests[{call.args[0]!r}].append_output_token_ids({call.args[1]!r})"]
    if call.name in ("num_computed_tokens", "shared_prefix_boundary"):
        return [f"requests[{call.args[0]!r}].{call.name} = {call.args[1]!r}"]
    args = [_value(a) for a in call.args] + [f"{k}={_value(v)}" for k, v in call.kwargs]
    line = f"manager.{call.name}({', '.join(args)})"
    if call.name == "get_computed_blocks":
        return [f"computed{call.number} = {line}"]
    if call.name == "take_kv_cache_block_copies":  # its references released as vLLM's scheduler does
        return [f"copies, retained = {line}", "if retained:", "    manager.block_pool.free_blocks(retained)"]
    if call.name == "free":
        return [line, f"freed.add({call.args[0].request_id!r})"]
    if call.name == "allocate_slots" and call.outcome:
        return [f"{line}  # {call.outcome} when recorded"]
    return [line]


def where(op: int, steps: tuple) -> str:
    """Which kvprop operation a call came from, by its class name only."""
    if op >= len(steps):
        return "kvprop's drain (engine steps until every request has finished)"
    return f"kvprop operation {op} ({type(steps[op]).__name__})"


def render(recording: Recording, steps: tuple, kind: str, sentence: str, version: str, arguments: tuple) -> str:
    """The reproducer's source."""
    kwargs, env = arguments
    modules: set = set()
    built = [f"    {name}={constructor(value, modules)}," for name, value in kwargs.items()]
    api: dict[str, list[str]] = {}
    for call in recording.calls:
        if call.name in MANAGER_CALLS:
            keywords = api.setdefault(call.name, [])
            keywords += [k for k, _ in call.kwargs if k not in keywords]
    v = recording.allocator.v
    unit = recording.allocator.config.unit
    header = [
        '"""A reproducer for vLLM\'s KVCacheManager (vLLM ' + version + "), written by kvprop report.",
        "",
        f"Broken: {sentence}.",
        "It builds the manager kvprop drove, makes the calls kvprop's engine made, in order, and",
        "exits 1 while the bug is present (an AssertionError, or vLLM's own exception), 0 once fixed,",
        "2 where the installed vLLM does not take the manager's configuration or calls (another release's API)",
        "or refuses the configuration at start-up.",
        '"""',
        "",
        "import collections",
        "import inspect",
        "import os",
        "import sys",
        "",
    ]
    header += [f"os.environ[{name!r}] = {value!r}  # read when the manager is built" for name, value in env.items()]
    imports = sorted(modules | {"vllm"})
    header += [f"import {m}" for m in imports]
    header += [
        f"from {v.SamplingParams.__module__} import SamplingParams",
        f"from {v.sha256.__module__} import sha256",
        f"from {v.kvu.__name__} import get_request_block_hasher, init_none_hash",
        f"from {v.KVCacheManager.__module__} import KVCacheManager",
        f"from {v.Request.__module__} import Request",
        "",
        'print(f"vLLM {vllm.__version__}")',
        "init_none_hash(sha256)  # as vLLM's engine does once per process",
        f"block_hasher = get_request_block_hasher({unit!r}, sha256)",
        "try:",
        "    manager = KVCacheManager(",
        *[f"    {line}" for line in built],
        "    )",
        "except TypeError as e:  # another release's signature: no answer either way",
        f'    print(f"vLLM {{vllm.__version__}} does not take the manager written for vLLM {version}: {{e}}")',
        "    sys.exit(2)",
        "except (AssertionError, ValueError, NotImplementedError) as e:  # its own start-up checks: not a find",
        '    print(f"vLLM {vllm.__version__} refuses this configuration at start-up: {type(e).__name__}: {e}")',
        "    sys.exit(2)",
        "# the manager's calls below and their keywords; a release without them is another API: exit 2",
        f"API = {api!r}",
        "for method, keywords in API.items():",
        "    takes = inspect.signature(getattr(manager, method)).parameters if hasattr(manager, method) else None",
        "    if takes is None or not set(keywords) <= set(takes):",
        '        print(f"vLLM {vllm.__version__} does not take manager.{method}() with {keywords} "',
        f'              "as vLLM {version} does")',
        "        sys.exit(2)",
        "requests = {}  # request id -> vLLM Request",
        "freed = set()  # the requests freed",
    ]
    if kind in EVENT_KINDS:
        header += [
            f"from {v.kv_events.__name__} import AllBlocksCleared, BlockRemoved, BlockStored",
            *EVENTS.strip("\n").splitlines(),
            "",
            "",
            "watch_events(manager)",
        ]
    body: list[str] = []
    last_op, engine_step = None, 0
    for call in recording.calls:
        if call.op != last_op:
            body += ["", f"# ---- from {where(call.op, steps)}"]
            last_op = call.op
        if call.name == "new_step_starts":
            engine_step += 1
            body.append(f"# engine step {engine_step}")
        body += call_lines(call)
    if kind == "target-crash":
        tail = [
            "",
            f"# The last call above raises on vLLM {version}: kvprop's target-crash find.",
            'print("OK: no exception; the crash is fixed")',
        ]
    elif kind in EVENT_KINDS:
        tail = [
            "",
            f"# The property kvprop found broken ({kind}): {sentence}.",
            "manager.take_events()  # the events it holds for its next publication",
            f'print("OK: {kind} holds; the bug is fixed")',
        ]
    else:
        tail = [
            "",
            f"# The property kvprop found broken ({kind}): {sentence}.",
            "live = [request_id for request_id in requests if request_id not in freed]",
            "null = manager.block_pool.null_block.block_id",
            *CHECKS[kind].strip("\n").splitlines(),
            f'print("OK: {kind} holds; the bug is fixed")',
        ]
    return "\n".join(header + body + tail) + "\n"


def check_constructors(kwargs: dict) -> None:
    """Each configuration object, rebuilt from its written constructor call, equals the one kvprop built."""
    for name, value in kwargs.items():
        modules: set = set()
        text = constructor(value, modules)
        namespace: dict = {}
        for m in modules:
            exec(f"import {m}", namespace)  # noqa: S102 - module names of vLLM's own classes
        if eval(text, namespace) != value:  # noqa: S307 - source written above from vLLM's objects
            raise ConfigError(f"kvprop report: vLLM's {name} does not rebuild from its constructor call: {text}")
