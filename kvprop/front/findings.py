"""``kvprop findings [DIR]``: every recorded finding's reproducer, run again on each release it names.

A finding is a folder of ``DIR`` (default ``findings``) holding ``finding.json``, the trace,
and the reproducer ``kvprop report`` wrote (``repro.py``). ``finding.json`` names, per vLLM
release, what ``kvprop bisect`` found there: ``affected`` (the script must exit 1),
``passes`` (0) or ``refuses`` (2: the release does not take the configuration or the
script's API). Each script runs in that release's environment (``--envs``, the prefix of their
folders, as ``bisect``), isolated and with every import of kvprop refused, as a maintainer
runs it. Exit 0 when every script answers as recorded; 1 when one does not (the engine's
behaviour changed from the record); 2 when the folder or a finding is malformed or an
environment is missing (the message says how to build it).
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs

from kvprop.errors import ConfigError
from kvprop.exits import EXIT_CLEAN, EXIT_FOUND
from kvprop.front.bisect import ENGINES, environments, version
from kvprop.front.commands import print_json
from kvprop.front.report import run_reproducer
from kvprop.targets.protocol import REGISTRY

FORMAT = "kvprop-finding/1"
EXPECTED_EXIT = {"affected": 1, "passes": 0, "refuses": 2}
FIELDS = ("format", "id", "title", "kind", "target", "status", "upstream", "written_on", "releases")


@attrs.frozen
class Finding:
    folder: Path
    id: str
    title: str
    kind: str
    target: str
    status: str  # "new" or "known"
    upstream: tuple  # the upstream issues and PRs read to confirm it, e.g. "vLLM issue #46453"
    written_on: str  # the release repro.py was written on
    releases: dict  # release -> "affected" | "passes" | "refuses"


@attrs.frozen
class Answer:
    finding: str
    release: str
    expected: str
    exit_code: int | None  # None: no environment
    last_line: str

    @property
    def agrees(self) -> bool:
        return self.exit_code == EXPECTED_EXIT[self.expected]


def read_finding(folder: Path) -> Finding:
    path = folder / "finding.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not a readable finding: {e}") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ConfigError(f"{path}: not a finding (format {FORMAT!r} expected)")
    missing = [f for f in FIELDS if f not in data]
    if missing:
        raise ConfigError(f"{path}: missing {missing}; a finding has {list(FIELDS)}")
    releases = data["releases"]
    wrong = {r: v for r, v in releases.items() if v not in EXPECTED_EXIT} if isinstance(releases, dict) else releases
    if not isinstance(releases, dict) or wrong:
        raise ConfigError(f"{path}: releases maps each release to one of {sorted(EXPECTED_EXIT)}; got {wrong!r}")
    if not (folder / "repro.py").is_file():
        raise ConfigError(f"{folder}: no repro.py (write it with kvprop report)")
    fields = {f: data[f] for f in FIELDS if f not in ("format", "upstream", "releases")}
    return Finding(folder, upstream=tuple(data["upstream"]), releases=dict(releases), **fields)


def read_findings(root: Path) -> list[Finding]:
    if not root.is_dir():
        raise ConfigError(f"{root} is not a folder of findings")
    folders = sorted(p for p in root.iterdir() if (p / "finding.json").exists())
    if not folders:
        raise ConfigError(f"{root} holds no finding (a folder with finding.json)")
    return [read_finding(folder) for folder in folders]


def run_script(finding: Finding, release: str, env: Path | None) -> Answer:
    expected = finding.releases[release]
    if env is None:
        return Answer(finding.id, release, expected, None, "no environment")
    run = run_reproducer(finding.folder, str((env / "bin" / "python").absolute()))  # run from the finding's folder
    # the assertion or exception where the bug shows (stderr), else what the script printed last
    said = run.stderr if run.returncode == 1 else run.stdout
    lines = [line.strip() for line in said.splitlines() if line.strip()]
    return Answer(finding.id, release, expected, run.returncode, lines[-1][:300] if lines else "")


def needed_releases(findings: list[Finding]) -> list[str]:
    return sorted({r for f in findings for r in f.releases}, key=version)


def cmd_findings(args) -> int:
    findings = read_findings(Path(args.dir))
    if args.releases:  # what make findings builds first
        if args.json:
            print_json(args, needed_releases(findings))
        else:
            print(" ".join(needed_releases(findings)))
        return EXIT_CLEAN
    envs = environments(args.envs)
    missing = [r for r in needed_releases(findings) if r not in envs]
    if missing:
        described = REGISTRY.get(findings[0].target)  # one folder holds one engine's findings
        package = described.package if described is not None and described.package in ENGINES else "vllm"
        engine, make = ENGINES[package]
        raise ConfigError(
            f"no environment for {engine} {', '.join(missing)} at {args.envs}RELEASE; build them with "
            f"make {make}=RELEASE (make findings builds every one it needs)"
        )
    answers = []
    for finding in findings:
        for release in sorted(finding.releases, key=version):
            answer = run_script(finding, release, envs[release])
            answers.append(answer)
            if not args.json:
                mark = "ok" if answer.agrees else "DIFFERS"
                print(
                    f"{finding.id:32} {release:8} {answer.expected:9} exit {answer.exit_code}  {mark}  "
                    f"{answer.last_line[:100]}"
                )
    differ = [a for a in answers if not a.agrees]
    if args.json:
        print_json(args, [attrs.asdict(a) | {"agrees": a.agrees} for a in answers])
    else:
        print(f"{len(answers) - len(differ)} of {len(answers)} answers as recorded in {len(findings)} findings")
    return EXIT_FOUND if differ else EXIT_CLEAN
