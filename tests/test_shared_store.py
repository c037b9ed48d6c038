"""Failures shared between machines through a real redis-server (skipped where none is installed)."""

import shutil
import socket
import subprocess
import time

import pytest
from test_cli import BUG, kvprop, kvprop_fuzz

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")


@pytest.fixture(scope="module")
def redis_url():
    redis = pytest.importorskip("redis")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.exceptions.ConnectionError:
            time.sleep(0.05)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


def test_a_walk_find_is_shared_with_the_next_machine(redis_url, tmp_path):
    from kvprop.search.store import TraceStore

    first = kvprop_fuzz(
        tmp_path, tmp_path / "a", f"--variant {BUG} --seed 0 --max-runs 3000 --seconds 600 --redis {redis_url}"
    )
    assert first.returncode == 1, first.stdout + first.stderr
    store = TraceStore(redis_url, None, BUG)
    assert len(store) == 1
    # Another machine, with a budget too small to find anything itself, learns of it at once.
    second = kvprop_fuzz(
        tmp_path, tmp_path / "b", f"--variant {BUG} --seed 424242 --max-runs 1 --seconds 60 --redis {redis_url}"
    )
    assert second.returncode == 1, second.stdout + second.stderr
    assert "shared store" in second.stdout
    assert len(list((tmp_path / "b").glob("*.json"))) == 1


def test_the_hypothesis_engine_saves_examples_to_redis(redis_url, tmp_path):
    import redis

    args = (
        f"--engine hypothesis --variant swa-skip-off-by-one --seed 0 --max-runs 1000 --seconds 300 --redis {redis_url}"
    )
    r = kvprop_fuzz(tmp_path, tmp_path / "h", args)
    assert r.returncode == 1, r.stdout + r.stderr
    keys = redis.Redis.from_url(redis_url).keys(b"kvprop-hypothesis:*")
    assert keys, "Hypothesis saved no example to the shared database"


def test_an_unreachable_redis_is_a_clear_error(tmp_path):
    r = kvprop("fuzz", "--seconds", "1", "--redis", "redis://127.0.0.1:1/0", cwd=tmp_path)
    assert r.returncode == 2
    assert "cannot connect" in r.stderr
