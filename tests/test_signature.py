"""A find's signature, and campaigns that count triaged findings by it (``--triaged``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
from helpers import BUGGY, motivating_trace

from kvprop.allocator.specs import AllocatorConfig, EngineConfig, FullAttention, SlidingWindow
from kvprop.search.execute import execute
from kvprop.search.signature import features, read_triaged, signature_of
from kvprop.search.trace import TraceError

ROOT = Path(__file__).resolve().parent.parent
CAMPAIGN = ["--variant", "hit-stops-early", "--workers", "1", "--seed", "2", "--max-runs", "40", "--json"]


def fuzz(tmp_path, *args):
    run = subprocess.run(
        [sys.executable, "-m", "kvprop", "fuzz", *CAMPAIGN, "--out", str(tmp_path / "cx"), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=600,
    )
    return run.returncode, json.loads(run.stdout) if run.stdout.strip() else None, run.stderr


def triaged_file(tmp_path, keys) -> Path:
    path = tmp_path / "triaged.json"
    path.write_text(json.dumps({"triaged": [{"signature": key, "finding": "a test's"} for key in keys]}))
    return path


def test_the_key_is_the_kind_and_the_operation_it_was_detected_at():
    trace = motivating_trace()
    found = attrs.evolve(trace, failure=execute(trace, variant=BUGGY))
    assert signature_of(found).key == "block-in-two-groups@drain"  # its four additions, then the drain


def test_features_are_the_group_kinds_and_the_options_away_from_their_defaults():
    config = EngineConfig(AllocatorConfig((FullAttention(4), SlidingWindow(4, 8)), 20), connector="sync")
    assert features(config) == ("groups=full+sliding_window", "connector=sync")


def test_a_passing_trace_has_no_signature():
    with pytest.raises(ValueError, match="no signature"):
        signature_of(motivating_trace())


@pytest.mark.parametrize(
    "content",
    ['{"triaged": "x"}', '{"triaged": [{"signature": "liveness"}]}', '{"triaged": [{"signature": "nosuch@Step"}]}'],
)
def test_a_malformed_triaged_file_is_refused_naming_what_is_wrong(tmp_path, content):
    path = tmp_path / "triaged.json"
    path.write_text(content)
    with pytest.raises(TraceError, match="triaged"):
        read_triaged(path)


def test_fuzz_refuses_a_malformed_triaged_file_with_exit_2(tmp_path):
    status, _, err = fuzz(tmp_path, "--triaged", str(triaged_file(tmp_path, ["liveness"])))
    assert (status, "kind[:exception]@operation" in err, "Traceback" in err) == (2, True, False)


def test_triaged_signatures_count_distinct_findings_as_known_kinds_do(tmp_path):
    _, by_kind, _ = fuzz(tmp_path / "a", "--known", "hit-too-short")
    keys = sorted(by_kind["known_finds"])
    status, by_signature, _ = fuzz(tmp_path / "b", "--triaged", str(triaged_file(tmp_path, keys)))
    assert (status, by_signature["known_finds"]) == (0, by_kind["known_finds"])


def test_a_new_signature_of_a_triaged_kind_still_ends_the_search(tmp_path):
    status, summary, _ = fuzz(tmp_path, "--triaged", str(triaged_file(tmp_path, ["hit-too-short@Step"])))
    assert (status, summary["find"]["signature"]["kind"], summary["find"]["signature"]["key"]) == (
        1,
        "hit-too-short",
        "hit-too-short@drain",
    )


def test_the_triaged_vllm_findings_file_reads_as_signatures():
    keys = read_triaged(ROOT / "findings" / "triaged.json")
    assert sorted(keys) == [
        "connector-handoff@Step",
        "connector-handoff@drain",
        "data-mismatch@Step",
        "data-mismatch@drain",
        "events-reannounce-unheld@Step",
        "events-reannounce-unheld@drain",
        "liveness:admission+load@drain",
        "liveness:admission@drain",
        "liveness:load@drain",
        "router-forgets-resident@Abort",
        "router-forgets-resident@AddLargeRequest",
        "router-forgets-resident@AddRequest",
        "router-forgets-resident@Finish",
        "router-forgets-resident@FinishLoad",
        "router-forgets-resident@FinishSave",
        "router-forgets-resident@Preempt",
        "router-forgets-resident@PublishPrefix",
        "router-forgets-resident@ResetPrefixCache",
        "router-forgets-resident@Step",
        "router-forgets-resident@drain",
        "target-crash:IndexError@Step",
        "target-crash:IndexError@drain",
    ]
