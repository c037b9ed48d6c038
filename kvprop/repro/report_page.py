"""``REPORT.md``: a find written up for an engine's maintainers, beside its reproducer.

A title, the engine and release, the configuration as the script builds it, the steps in
plain words under the kvprop operation each came from, expected and actual, and how to run
the script; with a picture of the failing step where one was taken (``picture``).
"""

from __future__ import annotations

import re

import attrs

from kvprop.repro.vllm_script import call_lines, where
from kvprop.search.trace import Failure

# A file of an installed package, named from its package on: the folder of the environment that
# wrote the report means nothing to a maintainer.
SITE_PACKAGES = re.compile(r"\S*/site-packages/")


@attrs.frozen
class Page:
    component: str  # vLLM's class the script drives: "Scheduler" or "KVCacheManager"
    version: str
    failure: Failure
    sentence: str  # the kind's sentence: what should hold
    configuration: str  # markdown
    steps: tuple  # markdown lines
    actual: str  # the script's last line of output
    picture: str | None = None  # the SVG's file name, beside REPORT.md
    no_picture: str | None = None  # why there is none


def _manager_words(call) -> str:
    """One call into vLLM's manager in plain words."""
    if call.name == "Request":
        return f"request `{call.args[0]}` arrives: {len(call.args[1])} prompt tokens, max_tokens={call.args[2]}"
    if call.name == "append_output_token_ids":
        return f"`{call.args[0]}` gets {len(call.args[1])} output token(s)"
    if call.name in ("num_computed_tokens", "shared_prefix_boundary"):
        return f"`{call.args[0]}`.{call.name} = {call.args[1]}"
    if call.name == "new_step_starts":
        return "a new engine step starts (`manager.new_step_starts()`)"
    said = call_lines(call)[0].split("  # ")[0]
    return f"`{said}`" + (f": {call.outcome}" if call.outcome else "")


def _under_operations(items, steps: tuple, words) -> tuple:
    """``items`` (calls or acts, each with its kvprop operation ``op``) in words, under a line
    naming the operation each run of them came from."""
    lines: list[str] = []
    last_op = None
    for item in items:
        if item.op != last_op:
            lines += ["", f"From {where(item.op, steps)}:", ""]
            last_op = item.op
        lines.append(f"- {words(item)}")
    return tuple(lines)


def manager_steps(recording, steps: tuple) -> tuple:
    return _under_operations(recording.calls, steps, _manager_words)


def _act_words(act) -> str:
    """One act on vLLM's scheduler in plain words."""
    if act.name == "add":
        rid, prompt, max_tokens, extra = act.args
        also = f", {extra}" if extra else ""
        return f"request `{rid}` arrives: {len(prompt)} prompt tokens, max_tokens={max_tokens}{also}"
    if act.name == "step":
        return "an engine step: `schedule()`, the model runner and the connector's worker, `update_from_output()`"
    if act.name == "finish_load":
        rid, ok = act.args
        return f"the worker's load for `{rid}` " + ("completes" if ok else "fails (reported by request)")
    if act.name == "finish":
        return f"`scheduler.finish_requests({act.args[0]!r}, RequestStatus.{act.args[1]})`"
    if act.name == "reset":
        return "`scheduler.reset_prefix_cache()`"
    return "no more arrivals: loads in flight complete and steps run until every request has finished"


def scheduler_steps(recording, steps: tuple) -> tuple:
    return _under_operations(recording.acts, steps, _act_words)


def markdown(page: Page) -> str:
    failure = page.failure
    title = (
        f"vLLM {page.version}: {page.component} raises {failure.exception or 'an exception'}"
        if failure.kind == "target-crash"
        else f"vLLM {page.version}: {page.sentence} (broken)"
    )
    expected = "every call returns without an exception" if failure.kind == "target-crash" else page.sentence
    lines = [
        f"# {title}",
        "",
        f"Engine: vLLM's v1 `{page.component}`, vLLM {page.version}, driven through its public calls.",
        f"Find: `{failure.kind}`, as kvprop names it; the steps below are what a kvprop trace did to vLLM.",
        "",
        "## Configuration",
        "",
        page.configuration.rstrip(),
        "",
        "## Steps",
        *page.steps,
        "",
        "## Expected and actual",
        "",
        f"- Expected: {expected}.",
        f"- Actual (kvprop): {SITE_PACKAGES.sub('', failure.message)}",
        f"- Actual (repro.py): `{page.actual}`",
        "",
    ]
    if page.picture:
        lines += [
            "## The failing step",
            "",
            f"![the pool and the block tables before and after the failing operation]({page.picture})",
            "",
            "Blocks outlined in red are the ones the find names.",
            "",
        ]
    elif page.no_picture:
        lines += ["## The failing step", "", f"No picture: {page.no_picture}.", ""]
    lines += [
        "## Running it",
        "",
        f"In an environment with vLLM {page.version} (and its torch), nothing else: `python repro.py`.",
        "It exits 1 while the bug is present (an AssertionError, or vLLM's own exception), 0 once it is fixed,",
        "2 where the installed vLLM does not take this configuration (another release's API) or refuses it",
        "at start-up.",
        "",
    ]
    return "\n".join(lines)
