"""Every recorded finding's reproducers answer on the installed vLLM release as its record says
(``findings/<id>/finding.json``): exit 1 where the bug is recorded, 0 where the release passes, 2
where it refuses the script's configuration or API. That is ``repro.py``, and the reproducer at a
production shape where the record names another script (``production.reproducer``). ``make
findings`` runs them on every release named; here each runs on the release of this environment,
isolated, with kvprop unimportable."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
vllm = __import__("vllm") if os.environ.get("KVPROP_REQUIRE_VLLM") else pytest.importorskip("vllm")

from kvprop.front.findings import EXPECTED_EXIT, read_findings, run_script  # noqa: E402

pytestmark = pytest.mark.vllm
FINDINGS = read_findings(Path(__file__).parent.parent / "findings")
SCRIPTS = [(finding, script, releases) for finding in FINDINGS for script, releases in finding.scripts]


@pytest.mark.parametrize(
    "finding, script, releases", SCRIPTS, ids=[f"{f.id}/{Path(script).stem}" for f, script, _ in SCRIPTS]
)
def test_the_reproducer_answers_on_this_release_as_recorded(finding, script, releases):
    if vllm.__version__ not in releases:
        pytest.skip(f"{finding.id}'s {script} records no answer for vLLM {vllm.__version__}")
    answer = run_script(finding, vllm.__version__, Path(sys.prefix), script)
    expected = releases[vllm.__version__]
    assert answer.exit_code == EXPECTED_EXIT[expected], f"recorded {expected}; it ends: {answer.last_line}"
