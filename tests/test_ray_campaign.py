"""A walk campaign as Ray tasks has the process pool's finds for the same seed and run budget,
loses no find and counts no run twice when a worker is lost (and says so, with stdout left to
its JSON document), saves its finds on Ctrl-C, and refuses to start (exit 2) where it cannot
run or Ray ends its driver. One local Ray instance with 2 CPUs for the module."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys

import pytest

from kvprop.errors import ConfigError
from kvprop.search import fuzz
from kvprop.search import ray_campaign as rc
from kvprop.search import trace as tr

SEED = 11
RUNS = 48
BATCH = 8  # runs per task: a campaign of RUNS is six tasks, spread over both CPUs
VARIANT = "evict-keeps-hash"  # found in most walks: a campaign of a few dozen runs has many finds
KINDS = frozenset({"cache-map-stale", "cache-map-missing", "target-crash", "hit-too-long", "data-mismatch"})

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'kvprop[ray]' (make setup installs it)")
pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def cluster():
    """The address of a local Ray instance with 2 CPUs (the CLI joins it as a cluster)."""
    context = ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield context.address_info["gcs_address"]
    ray.shutdown()


def options(known=frozenset()) -> fuzz.FuzzOptions:
    return fuzz.FuzzOptions(seconds=600, workers=1, seed=SEED, variant=VARIANT, max_runs=RUNS, known=known)


@functools.cache
def on_ray(known=frozenset()):
    """As ``on_ray_with``: a campaign's outcome depends on its options alone."""
    return on_ray_with(known)


def on_ray_with(known=frozenset(), on_started=None):
    """(the reported find as a dict or None, every find as (run seed, kind), the runs counted, the result)."""
    finds = []
    result = rc.campaign(
        options(known),
        slots=2,
        on_find=lambda trace, log: finds.append((trace.seed, trace.failure.kind)),
        batch_runs=BATCH,
        on_started=on_started,
    )
    return (tr.to_dict(result.found) if result.found else None), sorted(finds), result.runs, result


@functools.cache
def in_pool(workers: int, known=frozenset()):
    finds = []
    opts = fuzz.FuzzOptions(seconds=600, workers=workers, seed=SEED, variant=VARIANT, max_runs=RUNS, known=known)
    result = fuzz.search(opts, on_find=lambda trace, log=None: finds.append((trace.seed, trace.failure.kind)))
    return (tr.to_dict(result.found) if result.found else None), sorted(finds), result.runs


@pytest.mark.parametrize("workers", [1, 2])
def test_the_reported_find_is_the_process_pool_s(cluster, workers):
    assert on_ray()[0] == in_pool(workers)[0]


@pytest.mark.parametrize("workers", [1, 2])
def test_a_campaign_going_on_past_finds_has_the_process_pool_s_finds_and_runs(cluster, workers):
    assert on_ray(KINDS)[1:3] == in_pool(workers, KINDS)[1:]


def test_a_worker_killed_mid_campaign_loses_no_find_and_counts_no_run_twice(cluster):
    started: list[int] = []

    def kill_the_second(pid: int, node: str) -> None:
        started.append(pid)
        if len(started) == 2:
            os.kill(pid, signal.SIGKILL)

    _, finds, runs, result = on_ray_with(KINDS, on_started=kill_the_second)
    assert (finds, runs, result.requeued) == (*in_pool(1, KINDS)[1:], 1)


def test_a_node_without_the_target_refuses_the_campaign(cluster):
    with pytest.raises(ConfigError, match="cannot run target vllm"):
        rc.check_nodes(fuzz.FuzzOptions(target="vllm"))


def kvprop(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "kvprop", "fuzz", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kw,
    )


def test_ctrl_c_cancels_the_tasks_and_keeps_every_find_saved(cluster, tmp_path):
    out = tmp_path / "out"
    p = kvprop(
        f"--ray={cluster}", "--variant", VARIANT, "--known", ",".join(sorted(KINDS)), "--seed", "1",
        "--seconds", "300", "--out", str(out),
    )  # fmt: skip
    assert p.stdout is not None
    for line in p.stdout:
        if line.startswith("found "):
            break
    p.send_signal(signal.SIGINT)
    p.communicate(timeout=60)
    saved = sorted(out.glob("*.found.json"))
    assert (p.returncode, bool(saved), all(tr.from_dict(json.loads(f.read_text())).failure for f in saved)) == (
        130,
        True,
        True,
    )


def test_an_unreachable_cluster_is_exit_2_with_what_to_do(tmp_path):
    p = kvprop("--ray=127.0.0.1:1", "--max-runs", "4", "--out", str(tmp_path))
    output, _ = p.communicate(timeout=60)
    assert (p.returncode, "ray start --head" in output) == (2, True)


def test_without_ray_installed_the_campaign_is_exit_2_with_what_to_do(tmp_path):
    code = (
        "import sys; sys.modules['ray'] = None; from kvprop.front.cli import main; "
        f"sys.exit(main(['fuzz', '--ray', '--max-runs', '4', '--out', {str(tmp_path)!r}]))"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (p.returncode, "pip install 'kvprop[ray]'" in p.stderr + p.stdout) == (2, True)


def test_the_hypothesis_driver_is_refused_on_ray(tmp_path):
    p = kvprop("--ray", "--driver", "hypothesis", "--max-runs", "4", "--out", str(tmp_path))
    output, _ = p.communicate(timeout=60)
    assert (p.returncode, "--ray runs the walk driver" in output) == (2, True)


def test_the_campaign_s_status_names_runs_per_second_per_node_finds_and_eta(cluster):
    lines: list[str] = []
    rc.campaign(options(KINDS), slots=2, status=lines.append, batch_runs=BATCH)
    node = rc.node_name()
    assert [("runs/s" in s, f"({node} " in s, "finds 0 | known" in s, "ETA 0s" in s) for s in lines[-1:]] == [
        (True, True, True, True)
    ]


# `kvprop fuzz` (argv[1:]) whose second batch loses its Ray worker (SIGKILL) as it starts, as in
# test_a_worker_killed_mid_campaign_loses_no_find_and_counts_no_run_twice, but through the CLI.
KILL_THE_SECOND_BATCH_S_WORKER = """
import functools, os, signal, sys
from kvprop.front.cli import main
from kvprop.search import ray_campaign as rc

started = []


def kill_the_second(pid, node):
    started.append(pid)
    if len(started) == 2:
        os.kill(pid, signal.SIGKILL)


rc.campaign = functools.partial(rc.campaign, on_started=kill_the_second)
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def json_campaign_losing_a_worker(cluster, tmp_path_factory):
    """``kvprop fuzz --ray --json`` on the module's cluster whose second batch loses its worker: the
    finished process (stdout and stderr apart)."""
    out = tmp_path_factory.mktemp("json-out")
    argv = [
        "fuzz", f"--ray={cluster}", "--json", "--variant", VARIANT, "--known", ",".join(sorted(KINDS)),
        "--seed", str(SEED), "--max-runs", str(RUNS), "--ray-batch", str(BATCH), "--out", str(out),
    ]  # fmt: skip
    return subprocess.run(
        [sys.executable, "-c", KILL_THE_SECOND_BATCH_S_WORKER, *argv], capture_output=True, text=True, timeout=300
    )


def test_json_stdout_is_one_document_after_a_lost_worker(json_campaign_losing_a_worker):
    p = json_campaign_losing_a_worker
    summary = json.loads(p.stdout)
    assert (p.returncode, summary["verdict"], summary["ray"]["requeued_batches"]) == (0, "clean", 1), p.stderr


def test_the_summary_says_how_many_batches_ran_again_and_why(json_campaign_losing_a_worker):
    lines = json_campaign_losing_a_worker.stderr.splitlines()
    assert [line for line in lines if "run again from" in line] == [
        "1 batch run again from its first run (a Ray worker lost: 1)"
    ]


def drive_then(end: str) -> subprocess.CompletedProcess:
    """A process that goes on as the Ray driver's child (``ray_fuzz.drive_in_child``) and then ends by ``end``."""
    code = (
        "import os, sys, types; from kvprop.front import ray_fuzz; "
        f"ray_fuzz.drive_in_child(types.SimpleNamespace(command='fuzz', json=False)); {end}"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_a_driver_that_ray_ends_is_exit_2_naming_ray():
    p = drive_then("os._exit(1)")  # as Ray's core library ends a driver whose raylet died as it connected
    assert (p.returncode, "Ray ended kvprop's Ray driver" in p.stderr) == (2, True)


def test_a_driver_that_kvprop_ends_keeps_its_exit_status():
    p = drive_then("sys.exit(1)")
    assert (p.returncode, p.stderr) == (1, "")
