"""``kvprop findings``: each finding's reproducer runs on every release its record names and must
answer as recorded. The environments here are folders whose ``bin/python`` is this interpreter,
and the reproducers are scripts that exit as a reproducer does (1 bug present, 0 fixed)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from kvprop.front.cli import main


def environment(tmp_path, release: str) -> str:
    """An environment folder for ``release`` under the prefix ``tmp_path / "env-"``."""
    folder = tmp_path / f"env-{release}" / "bin"
    folder.mkdir(parents=True)
    os.symlink(sys.executable, folder / "python")
    return str(tmp_path / "env-")


def finding(root, name: str, releases: dict, script: str, production=None, scripts=None) -> None:
    """A finding folder: ``repro.py`` is ``script``; ``scripts`` are more files by name, and
    ``production`` its record at a production shape."""
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
    if production is not None:
        record["production"] = production
    (folder / "finding.json").write_text(json.dumps(record))
    (folder / "repro.py").write_text(script)
    for other, text in (scripts or {}).items():
        (folder / other).write_text(text)


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


# exits 1 on every release: a bug that holds at the production shape
ALWAYS = "import sys; sys.exit(1)\n"
SHAPE = "blocks of 16"


def test_a_production_reproducer_runs_on_the_releases_its_record_names(tmp_path, capsys):
    prefix = environment(tmp_path, "0.1.0")
    environment(tmp_path, "0.2.0")
    production = {"shape": SHAPE, "holds": True, "reproducer": "repro_production.py", "releases": {"0.2.0": "affected"}}
    scripts = {"repro_production.py": ALWAYS}
    finding(tmp_path / "findings", "f", {"0.1.0": "affected"}, BY_RELEASE, production, scripts)
    code = main(["findings", str(tmp_path / "findings"), "--envs", prefix, "--json"])
    answers = json.loads(capsys.readouterr().out)
    assert (code, [(a["script"], a["release"], a["exit_code"], a["agrees"]) for a in answers]) == (
        0,
        [("repro.py", "0.1.0", 1, True), ("repro_production.py", "0.2.0", 1, True)],
    )


def test_a_production_reproducer_answering_otherwise_is_exit_1_and_named(tmp_path, capsys):
    prefix = environment(tmp_path, "0.1.0")
    production = {"shape": SHAPE, "holds": True, "reproducer": "repro_production.py", "releases": {"0.1.0": "passes"}}
    finding(tmp_path / "findings", "f", {"0.1.0": "affected"}, BY_RELEASE, production, {"repro_production.py": ALWAYS})
    code = main(["findings", str(tmp_path / "findings"), "--envs", prefix])
    lines = capsys.readouterr().out.splitlines()
    assert (code, [line.split()[:2] + line.split()[5:6] for line in lines[:-1]]) == (
        1,
        [["f", "0.1.0", "ok"], ["f/repro_production", "0.1.0", "DIFFERS"]],
    )


def test_a_find_already_at_a_production_shape_runs_its_reproducer_once(tmp_path, capsys):
    prefix = environment(tmp_path, "0.1.0")
    production = {"shape": SHAPE, "holds": True, "reproducer": "repro.py"}
    finding(tmp_path / "findings", "f", {"0.1.0": "affected"}, BY_RELEASE, production)
    code = main(["findings", str(tmp_path / "findings"), "--envs", prefix])
    assert (code, capsys.readouterr().out.splitlines()[-1]) == (0, "1 of 1 answers as recorded in 1 findings")


def test_a_find_that_does_not_hold_at_a_production_shape_says_why_and_runs_only_repro_py(tmp_path, capsys):
    prefix = environment(tmp_path, "0.1.0")
    production = {"shape": SHAPE, "holds": False, "why": "a one-token prompt is a full block only at blocks of 1"}
    finding(tmp_path / "findings", "f", {"0.1.0": "affected"}, BY_RELEASE, production)
    code = main(["findings", str(tmp_path / "findings"), "--envs", prefix])
    assert (code, capsys.readouterr().out.splitlines()[-1]) == (0, "1 of 1 answers as recorded in 1 findings")


def test_the_releases_a_production_reproducer_names_are_built_too(tmp_path, capsys):
    production = {"shape": SHAPE, "holds": True, "reproducer": "repro_production.py", "releases": {"0.3.0": "affected"}}
    finding(tmp_path / "findings", "f", {"0.1.0": "affected"}, BY_RELEASE, production, {"repro_production.py": ALWAYS})
    code = main(["findings", str(tmp_path / "findings"), "--releases"])
    assert (code, capsys.readouterr().out.strip()) == (0, "0.1.0 0.3.0")


@pytest.mark.parametrize(
    "production, says",
    [
        ({"holds": True, "reproducer": "repro_production.py", "releases": {}}, "production has a shape"),
        ({"shape": SHAPE, "holds": True, "reproducer": "absent.py", "releases": {}}, "names a script"),
        (
            {"shape": SHAPE, "holds": True, "reproducer": "repro_production.py", "releases": {"0.1.0": "broken"}},
            "production.releases maps",
        ),
        (
            {"shape": SHAPE, "holds": True, "reproducer": "repro.py", "releases": {"0.1.0": "affected"}},
            "whose releases the finding records",
        ),
        ({"shape": SHAPE, "holds": False}, "says why"),
        ({"shape": SHAPE, "holds": False, "why": "no", "reproducer": "repro_production.py"}, "says why"),
        ({"shape": SHAPE, "holds": True, "reproducer": "repro.py", "note": "x"}, "production has no field"),
    ],
)
def test_a_malformed_production_record_is_exit_2_saying_what_it_needs(tmp_path, capsys, production, says):
    finding(tmp_path / "findings", "f", {"0.1.0": "affected"}, BY_RELEASE, production, {"repro_production.py": ALWAYS})
    code = main(["findings", str(tmp_path / "findings"), "--releases"])
    err = capsys.readouterr().err
    assert (code, says in err) == (2, True), err


def test_a_field_a_finding_does_not_have_is_exit_2(tmp_path, capsys):
    finding(tmp_path / "findings", "f", {"0.1.0": "affected"}, BY_RELEASE)
    path = tmp_path / "findings" / "f" / "finding.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"productoin": {}}))
    code = main(["findings", str(tmp_path / "findings"), "--releases"])
    assert (code, "no field ['productoin']" in capsys.readouterr().err) == (2, True)


def test_every_vllm_finding_says_whether_it_holds_at_a_production_shape():
    from pathlib import Path

    from kvprop.front.findings import read_findings

    findings = read_findings(Path(__file__).parent.parent / "findings")
    assert [f.id for f in findings if f.production is None] == []
