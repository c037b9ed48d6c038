"""``kvprop findings``: each finding's reproducer runs on every release its record names and must
answer as recorded. The environments here are folders whose ``bin/python`` is this interpreter,
and the reproducers are scripts that exit as a reproducer does (1 bug present, 0 fixed)."""

from __future__ import annotations

import json
import os
import sys

from kvprop.front.cli import main


def environment(tmp_path, release: str) -> str:
    """An environment folder for ``release`` under the prefix ``tmp_path / "env-"``."""
    folder = tmp_path / f"env-{release}" / "bin"
    folder.mkdir(parents=True)
    os.symlink(sys.executable, folder / "python")
    return str(tmp_path / "env-")


def finding(root, name: str, releases: dict, script: str) -> None:
    folder = root / name
    folder.mkdir(parents=True)
    record = {
        "format": "kvprop-finding/1",
        "id": name,
        "title": "a find",
        "kind": "liveness",
        "target": "vllm-scheduler",
        "status": "new",
        "upstream": [],
        "written_on": "0.1.0",
        "releases": releases,
    }
    (folder / "finding.json").write_text(json.dumps(record))
    (folder / "repro.py").write_text(script)


# exits 1 on the release named 0.1.x, else 0: the bug fixed in 0.2.0
BY_RELEASE = (
    "import sys, pathlib; sys.exit(1 if pathlib.Path(sys.executable).parent.parent.name == 'env-0.1.0' else 0)\n"
)


def test_every_reproducer_answering_as_recorded_is_exit_0(tmp_path, capsys):
    prefix = environment(tmp_path, "0.1.0")
    environment(tmp_path, "0.2.0")
    finding(tmp_path / "findings", "f", {"0.1.0": "affected", "0.2.0": "passes"}, BY_RELEASE)
    code = main(["findings", str(tmp_path / "findings"), "--envs", prefix])
    assert (code, capsys.readouterr().out.splitlines()[-1]) == (0, "2 of 2 answers as recorded in 1 findings")


def test_environments_named_by_a_relative_prefix_are_found_from_each_findings_folder(tmp_path, monkeypatch, capsys):
    environment(tmp_path, "0.1.0")
    finding(tmp_path / "findings", "f", {"0.1.0": "affected"}, BY_RELEASE)
    monkeypatch.chdir(tmp_path)
    code = main(["findings", "findings", "--envs", "env-"])
    assert (code, capsys.readouterr().out.splitlines()[-1]) == (0, "1 of 1 answers as recorded in 1 findings")


def test_a_reproducer_answering_otherwise_is_exit_1_and_named(tmp_path, capsys):
    prefix = environment(tmp_path, "0.1.0")
    environment(tmp_path, "0.2.0")
    finding(tmp_path / "findings", "f", {"0.1.0": "affected", "0.2.0": "affected"}, BY_RELEASE)
    code = main(["findings", str(tmp_path / "findings"), "--envs", prefix, "--json"])
    answers = json.loads(capsys.readouterr().out)
    assert (code, [(a["release"], a["exit_code"], a["agrees"]) for a in answers]) == (
        1,
        [("0.1.0", 1, True), ("0.2.0", 0, False)],
    )


def test_a_missing_environment_is_exit_2_saying_how_to_build_it(tmp_path, capsys):
    prefix = environment(tmp_path, "0.1.0")
    finding(tmp_path / "findings", "f", {"0.1.0": "affected", "0.2.0": "passes"}, BY_RELEASE)
    code = main(["findings", str(tmp_path / "findings"), "--envs", prefix])
    err = capsys.readouterr().err
    assert (code, "no environment for vLLM 0.2.0" in err, "make vllm-env VLLM_VERSION=" in err) == (2, True, True)


def test_a_release_verdict_outside_the_three_is_exit_2_naming_them(tmp_path, capsys):
    finding(tmp_path / "findings", "f", {"0.1.0": "broken"}, BY_RELEASE)
    code = main(["findings", str(tmp_path / "findings")])
    err = capsys.readouterr().err
    assert (code, "['affected', 'passes', 'refuses']" in err) == (2, True)


def test_the_releases_it_needs_are_listed_for_make_to_build(tmp_path, capsys):
    finding(tmp_path / "findings", "a", {"0.10.0": "affected"}, BY_RELEASE)
    finding(tmp_path / "findings", "b", {"0.9.1": "passes", "0.10.0": "passes"}, BY_RELEASE)
    code = main(["findings", str(tmp_path / "findings"), "--releases"])
    assert (code, capsys.readouterr().out.strip()) == (0, "0.9.1 0.10.0")


def test_the_repository_findings_are_well_formed(capsys):
    code = main(["findings", "findings", "--releases"])
    assert (code, capsys.readouterr().out.strip() != "") == (0, True)
