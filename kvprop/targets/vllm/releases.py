"""What kvprop knows of each vLLM release: how ``agree`` must walk it to compare like with like.

kvprop's allocator models vLLM 0.33.0's rules without the bugs found in them. A release from
before 0.33.0 lacks parts of that model, and every release from 0.30.0 on has known bugs that
kvprop fixes (README, finds); the step-for-step comparison leaves the parts a release lacks out
of its walks and runs kvprop's allocator as the release's known bugs (``reference_variant``),
so that everything else is still compared. One table, read by ``kvprop agree --release-rules``,
the vLLM tests and ``scripts/vllm-matrix.sh``.
"""

from __future__ import annotations

# The rules of 0.33.0's finds (README, finds), each a variant of kvprop's allocator.
RULES_0_33 = "checkpoint-over-running-state+reannounces-every-position+copy-before-compute"


def release_rules(release: tuple[int, ...]) -> dict:
    """``agree``'s options for vLLM ``release`` (its first two numbers count).

    - before 0.30.0: no shared-prefix junction (walks without retention or state groups), no
      prefill checkpoints, no full KV cache report;
    - 0.30.0 to 0.32: hits inside a block and checkpoints follow other rules (hits end on
      block boundaries, no checkpoints); the full report announces every position;
    - 0.33.0 and 0.34.0: kvprop's model, with the three known rules of 0.33.0 (0.34.0 changed
      none of the code they live in: ``single_type_kv_cache_manager.py`` and the report's
      ``emit_cached_block_events`` are the same, and the agreement holds over the tests' walks).
    """
    release = tuple(release[:2])
    if release < (0, 30):
        return {"no_junction": True, "no_checkpoints": True, "incremental_report": True}
    if release < (0, 33):
        return {"block_hits": True, "no_checkpoints": True, "reference_variant": "reannounces-every-position"}
    return {"reference_variant": RULES_0_33}


def as_flags(rules: dict) -> str:
    """The same options as ``kvprop agree`` flags."""
    flags = [f"--{name.replace('_', '-')}" for name, value in rules.items() if value is True]
    if rules.get("reference_variant"):
        flags.append(f"--reference-variant {rules['reference_variant']}")
    return " ".join(flags)
