"""Every recorded SGLang finding's reproducer answers on the installed SGLang release as its record
says (``findings/sglang/<id>/finding.json``): exit 1 where the bug is recorded, 0 where the
release passes, 2 where it refuses the script's configuration or API. Each runs on the release of
this environment, isolated, with kvprop unimportable."""

from __future__ import annotations

import os
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

sglang = __import__("sglang") if os.environ.get("KVPROP_REQUIRE_SGLANG") else pytest.importorskip("sglang")

from kvprop.front.findings import EXPECTED_EXIT, read_findings, run_script  # noqa: E402

pytestmark = pytest.mark.sglang
FINDINGS = read_findings(Path(__file__).parent.parent / "findings" / "sglang")
RELEASE = version("sglang")


@pytest.mark.parametrize("finding", FINDINGS, ids=[f.id for f in FINDINGS])
def test_the_reproducer_answers_on_this_release_as_recorded(finding):
    if RELEASE not in finding.releases:
        pytest.skip(f"{finding.id} records no answer for SGLang {RELEASE}")
    answer = run_script(finding, RELEASE, Path(sys.prefix))
    expected = finding.releases[RELEASE]
    assert answer.exit_code == EXPECTED_EXIT[expected], f"recorded {expected}; it ends: {answer.last_line}"
