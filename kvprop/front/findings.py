"""``kvprop findings [DIR]``: every recorded finding's reproducer, run again on each release it names.

A finding is a folder of ``DIR`` (default ``findings``) holding ``finding.json``, the trace,
and the reproducer ``kvprop report`` wrote (``repro.py``). ``finding.json`` names, per vLLM
release, what ``kvprop bisect`` found there: ``affected`` (the script must exit 1),
``passes`` (0) or ``refuses`` (2: the release does not take the configuration or the
script's API). An optional ``production`` record says whether the find holds at a shape a GPU
server runs (attention block sizes the CUDA backends take, a hybrid model's own block size,
drafts the configured proposer can make): ``shape`` (that shape in words), ``holds``, and either
``reproducer`` (the script at that shape, ``repro.py`` itself when the recorded one already is)
with its own ``releases``, or ``why`` it does not hold there. Each script runs in that
release's environment (``--envs``, the prefix of their folders, as ``bisect``), isolated and
with every import of kvprop refused, as a maintainer runs it. Exit 0 when every script
answers as recorded; 1 when one does not (the engine's behaviour changed from the record); 2
when the folder or a finding is malformed or an environment is missing (the message says how
to build it).
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs

from kvprop.errors import ConfigError
from kvprop.exits import EXIT_CLEAN, EXIT_FOUND
from kvprop.front.bisect import ENGINES, environments, version
from kvprop.front.commands import print_json
from kvprop.front.report import REPRODUCER, run_reproducer
from kvprop.targets.protocol import REGISTRY

FORMAT = "kvprop-finding/1"
EXPECTED_EXIT = {"affected": 1, "passes": 0, "refuses": 2}
FIELDS = ("format", "id", "title", "kind", "target", "status", "upstream", "written_on", "releases")
OPTIONAL = ("production",)


@attrs.frozen
class Production:
    """Whether the find holds at a production shape, and the script that shows it there."""

    shape: str
    holds: bool
    reproducer: str | None  # a script in the finding's folder; None where it does not hold
    releases: dict  # release -> "affected" | "passes" | "refuses", for ``reproducer``
    why: str  # why it does not hold there ("" where it holds)


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
    production: Production | None = None

    @property
    def scripts(self) -> list[tuple[str, dict]]:
        """Each reproducer to run and the answer recorded per release: ``repro.py``, then the
        production-shape one where it is another script."""
        out = [(REPRODUCER, self.releases)]
        prod = self.production
        if prod is not None and prod.reproducer is not None and prod.reproducer != REPRODUCER:
            out.append((prod.reproducer, prod.releases))
        return out


@attrs.frozen
class Answer:
    finding: str
    release: str
    expected: str
    exit_code: int | None  # None: no environment
    last_line: str
    script: str = REPRODUCER

    @property
    def agrees(self) -> bool:
        return self.exit_code == EXPECTED_EXIT[self.expected]


def _releases(path: Path, releases, where: str) -> dict:
    wrong = {r: v for r, v in releases.items() if v not in EXPECTED_EXIT} if isinstance(releases, dict) else releases
    if not isinstance(releases, dict) or wrong:
        raise ConfigError(f"{path}: {where} maps each release to one of {sorted(EXPECTED_EXIT)}; got {wrong!r}")
    return dict(releases)


def _production(path: Path, folder: Path, data, releases: dict) -> Production:
    """The ``production`` record: where the find holds, the script at that shape (its own
    ``releases``, or the finding's where it is ``repro.py``); where it does not, why."""
    if not isinstance(data, dict) or not isinstance(data.get("shape"), str) or not isinstance(data.get("holds"), bool):
        raise ConfigError(f"{path}: production has a shape (words) and holds (true or false); got {data!r}")
    extra = sorted(set(data) - {"shape", "holds", "reproducer", "releases", "why"})
    if extra:
        raise ConfigError(f"{path}: production has no field {extra}")
    if not data["holds"]:
        if not isinstance(data.get("why"), str) or not data["why"] or "reproducer" in data:
            raise ConfigError(f"{path}: a production record where the find does not hold says why, with no reproducer")
        return Production(data["shape"], False, None, {}, data["why"])
    script = data.get("reproducer")
    if not isinstance(script, str) or "/" in script or not (folder / script).is_file():
        raise ConfigError(f"{path}: production.reproducer names a script in {folder}; got {script!r}")
    if script == REPRODUCER:
        if "releases" in data:
            raise ConfigError(f"{path}: production.reproducer is {REPRODUCER}, whose releases the finding records")
        return Production(data["shape"], True, script, releases, "")
    return Production(data["shape"], True, script, _releases(path, data.get("releases"), "production.releases"), "")


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
    unknown = sorted(set(data) - set(FIELDS) - set(OPTIONAL))
    if unknown:
        raise ConfigError(f"{path}: no field {unknown}; a finding has {list(FIELDS)} and optionally {list(OPTIONAL)}")
    releases = _releases(path, data["releases"], "releases")
    if not (folder / REPRODUCER).is_file():
        raise ConfigError(f"{folder}: no {REPRODUCER} (write it with kvprop report)")
    production = _production(path, folder, data["production"], releases) if "production" in data else None
    fields = {f: data[f] for f in FIELDS if f not in ("format", "upstream", "releases")}
    return Finding(folder, upstream=tuple(data["upstream"]), releases=releases, production=production, **fields)


def read_findings(root: Path) -> list[Finding]:
    if not root.is_dir():
        raise ConfigError(f"{root} is not a folder of findings")
    folders = sorted(p for p in root.iterdir() if (p / "finding.json").exists())
    if not folders:
        raise ConfigError(f"{root} holds no finding (a folder with finding.json)")
    return [read_finding(folder) for folder in folders]


def run_script(finding: Finding, release: str, env: Path | None, script: str = REPRODUCER) -> Answer:
    """``script`` (a reproducer ``finding.scripts`` names) in ``release``'s environment ``env``."""
    expected = dict(finding.scripts)[script][release]
    if env is None:
        return Answer(finding.id, release, expected, None, "no environment", script)
    python = str((env / "bin" / "python").absolute())
    run = run_reproducer(finding.folder, python, script)  # run from the finding's folder
    # the assertion or exception where the bug shows (stderr), else what the script printed last
    said = run.stderr if run.returncode == 1 else run.stdout
    lines = [line.strip() for line in said.splitlines() if line.strip()]
    return Answer(finding.id, release, expected, run.returncode, lines[-1][:300] if lines else "", script)


def needed_releases(findings: list[Finding]) -> list[str]:
    return sorted({r for f in findings for _, releases in f.scripts for r in releases}, key=version)


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
        for script, releases in finding.scripts:
            name = finding.id if script == REPRODUCER else f"{finding.id}/{Path(script).stem}"
            for release in sorted(releases, key=version):
                answer = run_script(finding, release, envs[release], script)
                answers.append(answer)
                if not args.json:
                    mark = "ok" if answer.agrees else "DIFFERS"
                    print(
                        f"{name:32} {release:8} {answer.expected:9} exit {answer.exit_code}  {mark}  "
                        f"{answer.last_line[:100]}"
                    )
    differ = [a for a in answers if not a.agrees]
    if args.json:
        print_json(args, [attrs.asdict(a) | {"agrees": a.agrees} for a in answers])
    else:
        print(f"{len(answers) - len(differ)} of {len(answers)} answers as recorded in {len(findings)} findings")
    return EXIT_FOUND if differ else EXIT_CLEAN
