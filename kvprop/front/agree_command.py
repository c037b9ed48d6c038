"""``kvprop agree``: kvprop's allocator and another target walked side by side, with the options
that name a vLLM release's own rules (``--release-rules``)."""

from __future__ import annotations

import re

import attrs

from kvprop import __version__
from kvprop.errors import ConfigError
from kvprop.exits import EXIT_CLEAN, EXIT_FOUND
from kvprop.front.commands import _check_out, check_allocator, died_find, print_json, say, supervisor_for

RELEASE_OPTIONS = ("no_junction", "block_hits", "no_checkpoints", "incremental_report", "reference_variant")


def _take_release_rules(args) -> str:
    """``--release-rules``: the options of the installed vLLM release (``release_rules``), in
    place of the flags, which it refuses beside it rather than merge; returns the line that
    names them."""
    from importlib.metadata import PackageNotFoundError, version

    from kvprop.targets.protocol import VLLM_TARGETS
    from kvprop.targets.vllm.loading import INSTALL_HINT
    from kvprop.targets.vllm.releases import as_flags, release_rules

    given = as_flags(_release_options(args))
    if given:
        raise ConfigError(f"--release-rules sets {given} itself: give one or the other")
    if args.target not in VLLM_TARGETS:
        raise ConfigError(
            f"--release-rules applies to the vLLM targets ({', '.join(VLLM_TARGETS)}), not {args.target!r}"
        )
    try:
        installed = version("vllm")
    except PackageNotFoundError:
        raise ConfigError(f"--release-rules: vLLM is not installed here; {INSTALL_HINT}") from None
    numbers = re.match(r"(\d+)\.(\d+)", installed)
    if numbers is None:
        raise ConfigError(f"--release-rules: the installed vLLM's version {installed!r} is not MAJOR.MINOR...")
    rules = release_rules((int(numbers[1]), int(numbers[2])))
    for name in RELEASE_OPTIONS:
        setattr(args, name, rules.get(name, None if name == "reference_variant" else False))
    return f"the rules of vLLM {installed}: {as_flags(rules) or 'no options'}"


def _release_options(args) -> dict:
    return {name: getattr(args, name) for name in RELEASE_OPTIONS}


def _agree_flags(args) -> str:
    """The options this run compared with, as flags (the reproduce line repeats them)."""
    from kvprop.targets.vllm.releases import as_flags

    return "--release-rules" if args.release_rules else as_flags(_release_options(args))


def cmd_agree(args) -> int:
    from kvprop.search.agree import agree, reference_of
    from kvprop.search.supervisor import Died

    if args.target == "kvprop":
        raise ConfigError("agree compares kvprop's allocator with another target: give --target vllm or pkg.mod:f")
    rules = _take_release_rules(args) if args.release_rules else None
    _check_out(args)
    check_allocator(args.reference_variant, None)  # an unknown name is refused before anything runs
    check_allocator(None, args.target)
    reference = reference_of(args.target) or "kvprop"
    if reference != "kvprop" and args.reference_variant is not None:
        raise ConfigError(
            f"--reference-variant names a variant of kvprop's allocator; target {args.target!r} agrees with "
            f"{reference!r}"
        )
    say(
        args,
        f"kvprop {__version__} agree: {reference} vs {args.target}, walks {args.seed}..{args.seed + args.walks - 1}",
    )
    if rules is not None:
        say(args, rules)
    seeds = range(args.seed, args.seed + args.walks)
    options = {
        "target": args.target,
        "seeds": seeds,
        "max_ops": args.max_ops,
        "no_junction": args.no_junction,
        "block_hits": args.block_hits,
        "reference_variant": args.reference_variant,
        "no_checkpoints": args.no_checkpoints,
        "incremental_report": args.incremental_report,
    }
    args.device = None
    with supervisor_for(args, None, args.target) as supervisor:
        try:
            result = supervisor.call(agree, options)
        except Died as died:
            return died_find(args, died, "agree")
    if result.walks == 0:
        raise ConfigError(
            f"target {args.target!r} refused all {result.refused} configurations, nothing compared; "
            f"first refusal: {result.first_refusal}"
        )
    d = result.disagreement
    if args.json:
        print_json(args, {**attrs.asdict(result), "agree": d is None})
    elif d is None:
        print(f"agree: {result.walks} walks, {result.steps:,} steps ({result.refused} configurations refused)")
    else:
        reproduce = f"kvprop agree --target {args.target} --seed {d.seed} --walks 1 {_agree_flags(args)}"
        print(
            f"DISAGREE at walk seed {d.seed}, operation {d.step} ({d.operation}), {d.what}:\n"
            f"  {reference}:  {d.reference}\n  {args.target}: {d.target}\n"
            f"reproduce: {reproduce.rstrip()}"
        )
    return EXIT_CLEAN if d is None else EXIT_FOUND
