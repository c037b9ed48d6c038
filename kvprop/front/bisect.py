"""``kvprop bisect TRACE --releases A..B``: which releases of an engine a find affects.

The trace is replayed with ``kvprop replay`` in each release's own environment (one per
release, ``scripts/vllm-env.sh`` or ``scripts/sglang-env.sh``; ``--envs`` names the prefix of
their folders, ``.venv-vllm-`` or ``.venv-sglang-`` by default) between the two
releases named, both included, each replay in a process of that environment. A release
*affected* reproduces a failure, one that *passes* runs the trace clean, and one that
*refuses* does not build the configuration (its own start-up validation, or kvprop's rules of
what it can run): a refusal is neither. The releases are those with an environment in the
range; the two ends must have one.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import attrs

from kvprop.errors import ConfigError
from kvprop.exits import EXIT_CLEAN, EXIT_FOUND, EXIT_INTERNAL
from kvprop.front.choices import ENGINE_TARGETS, ENGINES  # the engines with environments, their targets
from kvprop.front.commands import print_json
from kvprop.targets.protocol import REGISTRY

VERSION = r"\d+\.\d+(?:\.\d+)?"
RANGE = re.compile(rf"^({VERSION})\.\.({VERSION})$")
REPLAY_TIMEOUT = 900  # seconds for one release's replay, its start-up included


@attrs.frozen
class Verdict:
    """One release's answer: ``outcome`` is "affected", "passes", "refuses" or "error"."""

    release: str
    outcome: str
    detail: str


def version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def parse_range(text: str) -> tuple[str, str]:
    match = RANGE.match(text)
    if match is None:
        raise ConfigError(
            f"--releases takes FIRST..LAST, two releases of the engine such as 0.22.1..0.34.0; got {text!r}"
        )
    first, last = match.groups()
    if version(first) > version(last):
        raise ConfigError(f"--releases {text}: the first release comes after the last")
    return first, last


def environments(prefix: str) -> dict[str, Path]:
    """Release -> environment folder, for every folder named ``prefix`` + a release that has a Python."""
    base = Path(prefix)
    found = {}
    for folder in base.parent.glob(base.name + "*"):
        release = folder.name[len(base.name) :]
        if re.fullmatch(VERSION, release) and (folder / "bin" / "python").is_file():
            found[release] = folder
    return found


def releases_in(first: str, last: str, prefix: str, package: str = "vllm") -> list[tuple[str, Path]]:
    envs = environments(prefix)
    engine, make = ENGINES[package]
    for end in (first, last):
        if end not in envs:
            have = ", ".join(sorted(envs, key=version)) or "none"
            raise ConfigError(
                f"no environment for {engine} {end} at {prefix}{end} (environments there: {have}); "
                f"build it with: make {make}={end}, or name their prefix with --envs"
            )
    span = [r for r in envs if version(first) <= version(r) <= version(last)]
    return [(r, envs[r]) for r in sorted(span, key=version)]


def replay_on(release: str, env: Path, trace: Path, target: str) -> Verdict:
    """The trace replayed by ``env``'s kvprop on ``target``, kvprop's allocator variant off."""
    command = [str(env / "bin" / "python"), "-m", "kvprop", "replay", str(trace), "--target", target]
    try:
        run = subprocess.run([*command, "--variant", "correct"], capture_output=True, text=True, timeout=REPLAY_TIMEOUT)
    except subprocess.TimeoutExpired:
        return Verdict(release, "error", f"no answer in {REPLAY_TIMEOUT} s")
    lines = [line for line in run.stdout.splitlines() if line.strip()]
    if run.returncode == EXIT_FOUND and lines and lines[-1].startswith("REPRODUCED "):
        return Verdict(release, "affected", lines[-1].split()[1])
    if run.returncode == EXIT_CLEAN:
        return Verdict(release, "passes", "")
    said = [line for line in run.stderr.splitlines() if line.strip()]
    if run.returncode == 2:
        return Verdict(release, "refuses", said[-1] if said else "")
    return Verdict(release, "error", f"exit status {run.returncode}: {(said or lines or [''])[-1][:300]}")


def summary(verdicts: list[Verdict]) -> dict:
    def named(outcome: str) -> list[str]:
        return [v.release for v in verdicts if v.outcome == outcome]

    affected = named("affected")
    return {
        "first_affected": affected[0] if affected else None,
        "last_affected": affected[-1] if affected else None,
        "affected": affected,
        "passes": named("passes"),
        "refuses": named("refuses"),
        "errors": named("error"),
        "releases": [attrs.asdict(v) for v in verdicts],
    }


def cmd_bisect(args) -> int:
    from kvprop.search import trace as tr

    first, last = parse_range(args.releases)
    trace = tr.load(args.file)
    target = args.target or trace.target
    if target not in ENGINE_TARGETS:
        raise ConfigError(
            f"{args.file} records target {target or 'kvprop'!r}; bisect replays on an engine's releases: "
            f"--target {' or '.join(ENGINE_TARGETS)}"
        )
    package = REGISTRY[target].package
    assert package is not None  # ENGINE_TARGETS drive a package
    engine = ENGINES[package][0]
    releases = releases_in(first, last, args.envs or f".venv-{package}-", package)
    verdicts = []
    with tempfile.TemporaryDirectory(prefix="kvprop-bisect-") as tmp:
        for release, env in releases:
            copy = Path(tmp) / release / Path(args.file).name  # a replay writes its log beside the trace
            copy.parent.mkdir()
            shutil.copyfile(args.file, copy)
            if not args.json:
                print(f"{engine} {release}: replaying on {target} ...", file=sys.stderr, flush=True)
            verdicts.append(replay_on(release, env, copy, target))
    result = summary(verdicts)
    if args.json:
        print_json(args, {"trace": str(args.file), "target": target, **result})
    else:
        for v in verdicts:
            print(f"{v.release:>8}  {v.outcome:9} {v.detail}")
        span = f"{result['first_affected']} to {result['last_affected']}" if verdicts and result["affected"] else "none"
        print(f"affected: {span} ({len(result['affected'])} of {len(verdicts)} releases)")
        print(f"passes: {', '.join(result['passes']) or 'none'}; refuses: {', '.join(result['refuses']) or 'none'}")
    if result["errors"]:
        return EXIT_INTERNAL
    return EXIT_FOUND if result["affected"] else EXIT_CLEAN
