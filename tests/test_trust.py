"""The "Trust the tool" findings, one behaviour per test, through the real ``kvprop`` command.

Exit codes: 0 clean, 1 found/reproduced, 2 unusable input or configuration (a message on
stderr, never a traceback), 3 an error of kvprop itself, 130 interrupted.

Most commands here are independent and spend their time starting Python and torch, so the
``ran`` fixture starts them up front, three at a time, and each test reads its own result; the
Popen-driven tests run first, alongside them.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import attrs
import pytest
from test_cli import ROOT
from test_cli import kvprop as cli

from kvprop.repro import counterexample
from kvprop.search import trace as tr
from kvprop.search.trace import Failure
from kvprop.search.walk import plan, walk_seed

BUG = "interleaved-external-alloc"
FIND = f"fuzz --variant {BUG} --seed 3 --max-runs 3000 --seconds 600 --workers 1"  # a find within seconds
SEED5 = f"fuzz --variant {BUG} --seed 5 --workers 2 --max-runs 2000 --seconds 600"

# ---- targets and files the commands use ---------------------------------------------------------

MODULES = {
    "refuser": """\
import kvprop.errors


def make(config):
    raise kvprop.errors.ConfigError("no shapes here")
""",
    "one_group": """\
from kvprop.allocator.view import AllocatorView
from kvprop.errors import ConfigError
from kvprop.targets.kvprop import make_allocator


def make(config):
    if len(config.groups) != 1:
        raise ConfigError("one group only")
    allocator = make_allocator(config)
    return allocator, AllocatorView(allocator)
""",
    "crasher": """\
from kvprop.allocator.kv_cache_manager import KVCacheManager
from kvprop.allocator.view import AllocatorView


class FifthCallCrashes(KVCacheManager):
    calls = 0

    def allocate_slots(self, *args, **kwargs):
        self.calls += 1
        if self.calls == 5:
            raise RuntimeError("the fifth allocate_slots")
        return super().allocate_slots(*args, **kwargs)


def make(config):
    allocator = FifthCallCrashes(config)
    return allocator, AllocatorView(allocator)
""",
    "boom": 'raise RuntimeError("boom at import")\n',
    "broken": "def make(config:\n    pass\n",
    "plain": "x = 3\n",
    "factories": """\
from kvprop.targets.kvprop import make_allocator


def bare(config):
    return make_allocator(config)


def no_view(config):
    return make_allocator(config), None
""",
    # `kvprop fuzz` where Ctrl-C arrives during the minimiser's first replay of the find
    "ctrl_c_at_first_replay": """\
import sys

import kvprop.repro.minimise as minimise
from kvprop.front.cli import main

real = minimise.execute
calls = [0]


def execute(*args, **kwargs):
    calls[0] += 1
    if calls[0] == 1:
        raise KeyboardInterrupt
    return real(*args, **kwargs)


minimise.execute = execute
sys.exit(main(sys.argv[1:]))
""",
}


def _first(d, op):
    return next(s for s in d["steps"] if s["op"] == op)


CORRUPTIONS = {
    "drain": (lambda d: d.update(drain="no"), "drain: expected bool"),
    "seed": (lambda d: d.update(seed="abc"), "seed: expected int"),
    "extra": (lambda d: _first(d, "AddRequest").update(extra=1_000_000_000), ".extra: expected an integer in"),
    "times": (lambda d: _first(d, "Step").update(times=1_000_000_000), ".times: expected an integer in"),
    "num_blocks": (lambda d: d["config"].update(num_blocks=10_000_000), "num_blocks"),
    "failure-step": (
        lambda d: d.update(failure={"step": len(d["steps"]) + 1, "kind": "k", "message": "m"}),
        "failure.step: expected an integer in",
    ),
}


def _files() -> dict[str, bytes]:
    valid = tr.to_dict(plan(0))
    files = {"valid.json": json.dumps(valid).encode(), "taken": b"not a directory"}
    files["binary.json"] = b"\x00\x01\xff\xfe\x80 binary \x9c"
    files["utf16.json"] = json.dumps(valid).encode("utf-16")
    for field, (corrupt, _) in CORRUPTIONS.items():
        data = copy.deepcopy(valid)
        corrupt(data)
        files[f"corrupt-{field}.json"] = json.dumps(data).encode()
    return files


# ---- the commands: name -> (command line, cwd); {w} is the fixture's directory -------------------

W, R = "w", "root"
COMMANDS = {
    # the long ones first, so that they overlap everything else
    "seed0": (f"{FIND} --out {{w}}/cx-seed0", W),
    "seed5-a": (f"{SEED5} --out {{w}}/cx-seed5-a", W),
    "seed5-b": (f"{SEED5} --out {{w}}/cx-seed5-b", W),
    "ctrl-c-at-first-replay": (f"{FIND} --out {{w}}/cx-first-replay", W),  # run with ctrl_c_at_first_replay.py
    "crasher": ("fuzz --target crasher:make --seed 0 --max-runs 200 --seconds 120 --workers 1 --out {w}/cx-crash", W),
    "one-group": ("fuzz --target one_group:make --seed 3 --max-runs 40 --seconds 120 --workers 1 --out {w}/cx-1g", W),
    "canary-kvprop": (
        "fuzz --canary --canary-seconds 60 --seed 1 --max-runs 5 --seconds 90 --workers 1 --out {w}/cx-ck",
        R,
    ),
    "canary-path": (
        "fuzz --canary --canary-seconds 60 --target tests.example_target:make_target --seed 1 --max-runs 5 --seconds 90 --workers 1 --out {w}/cx-cp",
        R,
    ),
    # a run budget, not only --seconds 3: the budget counts from the command's start, which a busy
    # machine can spend on starting Python and torch alone (then the run is "untested", exit 2)
    "json": ("fuzz --json --seed 2 --max-runs 5 --seconds 120 --workers 1 --out {w}/cx-json", W),
    "vllm": ("fuzz --target vllm --seconds 3 --workers 1 --out {w}/cx-vllm", W),
    "vllm-canary": ("fuzz --canary --target vllm --seconds 3 --workers 1 --out {w}/cx-vllm", W),
    "vllm-scheduler": ("fuzz --target vllm-scheduler --seconds 3 --workers 1 --out {w}/cx-vllm-s", W),
    "refuser-walk": ("fuzz --target refuser:make --driver walk --seconds 5 --workers 1 --out {w}/cx-r", W),
    "refuser-hypothesis": ("fuzz --target refuser:make --driver hypothesis --seconds 5 --workers 1 --out {w}/cx-r", W),
    "variant-with-path-target": (
        f"fuzz --variant {BUG} --target tests.example_target:make_target --seconds 3 --workers 1 --out {{w}}/cx-variant",
        R,
    ),
    "out-is-a-file": (f"{FIND} --out {{w}}/taken", W),
    "device-cuda": ("fuzz --device cuda --seconds 3 --workers 1 --out {w}/cx-dev", W),
    "device-tpu": ("fuzz --device tpu --seconds 3 --workers 1 --out {w}/cx-dev", W),
    "target-raises-on-import": ("fuzz --target boom:make --seconds 5 --workers 1 --out {w}/cx-t", W),
    "target-syntax-error": ("fuzz --target broken:make --seconds 5 --workers 1 --out {w}/cx-t", W),
    "target-not-callable": ("fuzz --target plain:x --seconds 5 --workers 1 --out {w}/cx-t", W),
    "target-bare-allocator": ("fuzz --target factories:bare --seconds 5 --workers 1 --out {w}/cx-t", W),
    "target-allocator-and-none": ("fuzz --target factories:no_view --seconds 5 --workers 1 --out {w}/cx-t", W),
    "replay-binary": ("replay {w}/binary.json", W),
    "replay-utf16": ("replay {w}/utf16.json", W),
    **{f"replay-corrupt-{field}": (f"replay {{w}}/corrupt-{field}.json", W) for field in CORRUPTIONS},
    "variants": ("variants", W),
    "fuzz-help": ("fuzz --help", W),
}


class Ran:
    """The commands of COMMANDS, all started at once: ``ran[name]`` waits for one (result, seconds)."""

    def __init__(self, where):
        self.where = where
        self.pool = ThreadPoolExecutor(max_workers=3)
        self.futures = {name: self.pool.submit(self._run, name) for name in COMMANDS}

    def _run(self, name):
        line, cwd = COMMANDS[name]
        args = line.format(w=self.where).split()
        if name == "ctrl-c-at-first-replay":
            return _timed(_python, str(self.where / "ctrl_c_at_first_replay.py"), *args, cwd=self.where)
        return _timed(cli, *args, cwd=ROOT if cwd == R else self.where)

    def __getitem__(self, name):
        return self.futures[name].result(timeout=900)


def _timed(run, *args, cwd):
    started = time.monotonic()
    r = run(*args, cwd=cwd)
    return r, time.monotonic() - started


def _python(*args, cwd):
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{cwd}"},
        timeout=900,
    )


@pytest.fixture(scope="module", autouse=True)
def ran(tmp_path_factory):
    where = tmp_path_factory.mktemp("trust")
    for name, source in MODULES.items():
        (where / f"{name}.py").write_text(source)
    for name, content in _files().items():
        (where / name).write_bytes(content)
    ran = Ran(where)
    yield ran
    ran.pool.shutdown(wait=True, cancel_futures=True)


def result(ran, name):
    return ran[name][0]


def no_traceback(r):
    return "Traceback" not in r.stdout + r.stderr


def traces_in(out):
    """(minimised traces, as-found traces) written to ``out``."""
    paths = sorted(out.glob("*.json")) if out.exists() else []
    found = [p for p in paths if p.name.endswith(".found.json")]
    return [p for p in paths if p not in found], found


# ---- a long-running kvprop read line by line ----------------------------------------------------


class Running:
    """``kvprop`` started with Popen; its stdout read line by line in a thread, never blocking the pipe."""

    def __init__(self, args, cwd, stderr_path):
        self._stderr = open(stderr_path, "w")  # closed in finish()
        self.stderr_path = stderr_path
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvprop", *args],
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            start_new_session=True,  # a group of its own, as `timeout` and a CI runner start it
        )
        self.lines: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        for line in self.proc.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, predicate, timeout: float) -> str | None:
        """The first new stdout line satisfying ``predicate`` (None: the process ended or time ran out)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                return None
            if line is None:
                self._queue.put(None)
                return None
            self.lines.append(line)
            if predicate(line):
                return line
        return None

    def finish(self, timeout: float = 60) -> tuple[int, str, str]:
        """Wait for the exit; (exit code, all of stdout, all of stderr)."""
        try:
            rc = self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self._thread.join(timeout=10)
            self._stderr.close()
        while True:
            try:
                line = self._queue.get_nowait()
            except queue.Empty:
                break
            if line is not None:
                self.lines.append(line)
        return rc, "".join(self.lines), self.stderr_path.read_text()


@pytest.fixture
def running(tmp_path):
    started = []

    def start(*args, cwd=None):
        r = Running(args, cwd or tmp_path, tmp_path / f"stderr{len(started)}.txt")
        started.append(r)
        return r

    yield start
    for r in started:
        if r.proc.poll() is None:
            r.proc.kill()
            r.proc.wait()


# ---- Popen runs first, while the batch of ``ran`` works in the background ---------------------


# 8. Ctrl-C while minimising keeps the best so far ----------------------------------------------


def test_ctrl_c_while_minimising_keeps_the_smallest_trace_so_far(tmp_path, running):
    out = tmp_path / "cx"
    k = running(*FIND.split(), "--out", str(out))
    # the progress line is printed from inside the minimiser; if it finishes first, the run just ends
    if k.wait_for(lambda line: line.startswith("  minimising:"), timeout=180) is not None:
        os.kill(k.proc.pid, signal.SIGINT)
    rc, stdout, stderr = k.finish(timeout=120)
    interrupted = "minimising interrupted at" in stdout
    assert (rc, interrupted or "minimised to" in stdout) == (130 if interrupted else 1, True), stdout + stderr
    traces, found = traces_in(out)
    assert (len(traces), len(found)) == (1, 1), sorted(p.name for p in out.iterdir())
    assert f"wrote {traces[0]}" in stdout, stdout
    best, first = tr.load(traces[0]), tr.load(found[0])
    assert best.failure.kind == first.failure.kind and len(best.steps) <= len(first.steps)


# 8b. a signal to the whole process group while minimising (what `timeout` and a CI cancelling send) ---


def _stderr_says(path, text: str, timeout: float) -> bool:
    """Whether ``text`` appears in the file ``path`` within ``timeout`` seconds (a guard, not a measure)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in path.read_text():
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_group_while_minimising_keeps_the_trace_and_prints_one_json_document(tmp_path, running, signum):
    out = tmp_path / "cx"
    k = running(*FIND.split(), "--out", str(out), "--json")
    if _stderr_says(k.stderr_path, "  minimising:", timeout=180):  # if it finishes first, the run just ends
        os.killpg(k.proc.pid, signum)
    rc, stdout, stderr = k.finish(timeout=120)
    summary = json.loads(stdout)
    traces, found = traces_in(out)
    interrupted = summary["stopped"] == "interrupted"
    assert (rc, summary["exit"], len(traces), len(found), "internal error" in stderr) == (
        130 if interrupted else 1,
        rc,
        1,
        1,
        False,
    ), stdout + stderr
    assert summary["find"]["trace"] == str(traces[0])


# 11. Ctrl-C during the search --------------------------------------------------------------------


def test_ctrl_c_during_the_search_prints_a_summary_and_exits_130(tmp_path, running):
    k = running("fuzz", "--seed", "7", "--seconds", "120", "--workers", "1", "--out", str(tmp_path / "cx"))
    assert k.wait_for(lambda line: line.startswith("["), timeout=90) is not None, "".join(k.lines)
    os.kill(k.proc.pid, signal.SIGINT)
    rc, stdout, stderr = k.finish(timeout=60)
    summary = re.search(r"interrupted: ([\d,]+) runs, ([\d,]+) steps in [\d.]+s, seed 7\b", stdout)
    assert (rc, summary is not None) == (130, True), stdout + stderr
    assert int(summary[1].replace(",", "")) > 0 and int(summary[2].replace(",", "")) > 0, stdout
    assert "Traceback" not in stderr, stderr


@pytest.mark.parametrize(
    "command",
    [("coverage", "--seconds", "120"), ("agree", "--target", "tests.example_target:make_target", "--walks", "100000")],
    ids=["coverage", "agree"],
)
def test_ctrl_c_while_a_supervised_worker_runs_the_target_exits_130(tmp_path, running, command):
    k = running(*command, "--out", str(tmp_path / "cx"), cwd=ROOT)
    assert k.wait_for(lambda line: line.startswith("kvprop "), timeout=90) is not None, "".join(k.lines)
    time.sleep(2)  # the worker is walking by now
    os.kill(k.proc.pid, signal.SIGINT)
    rc, stdout, stderr = k.finish(timeout=60)
    assert (rc, "Traceback" in stderr) == (130, False), stdout + stderr


# 18. bugs prints its header first ---------------------------------------------------------------


def test_an_interrupt_lost_inside_a_finalizer_still_ends_the_search(monkeypatch):
    """A KeyboardInterrupt raised inside a finalizer is printed and dropped; the handler's
    flag ends the search all the same (``kvprop.interrupt``)."""
    from kvprop import interrupt
    from kvprop.search import fuzz

    monkeypatch.setattr(interrupt, "requested", threading.Event())
    interrupt.requested.set()
    result = fuzz.search(fuzz.FuzzOptions(seconds=60, workers=1, seed=0, driver="walk"))
    assert result.interrupted is True


def test_the_interrupt_handler_remembers_and_raises(monkeypatch):
    from kvprop import interrupt

    monkeypatch.setattr(interrupt, "requested", threading.Event())
    with pytest.raises(KeyboardInterrupt):
        interrupt.handler(signal.SIGTERM, None)
    assert interrupt.requested.is_set()


def test_bugs_prints_its_header_first(tmp_path, running):
    k = running("bugs", "--seconds-per-bug", "5", "--workers", "1", "--driver", "walk")
    first = k.wait_for(lambda line: True, timeout=90)
    k.proc.terminate()
    k.finish(timeout=30)
    assert first is not None and first.startswith("kvprop ") and " bugs: " in first and "5s each" in first, first


# ---- 1. the vLLM target without vLLM -------------------------------------------------------------


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed in this environment")
@pytest.mark.parametrize("name", ["vllm", "vllm-canary", "vllm-scheduler"])
def test_vllm_target_without_vllm_exits_2_before_searching_and_says_how_to_build_it(ran, name):
    r = result(ran, name)
    assert (r.returncode, "make vllm-env" in r.stderr) == (2, True), r.stdout + r.stderr
    assert "clean" not in r.stdout and not any(line.startswith("[") for line in r.stdout.splitlines()), r.stdout
    assert no_traceback(r), r.stderr


# ---- 2. a target that refuses every configuration -------------------------------------------------


@pytest.mark.parametrize("name", ["refuser-walk", "refuser-hypothesis"])
def test_target_refusing_every_configuration_exits_2_with_its_reason(ran, name):
    r = result(ran, name)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "could not build any of" in r.stderr and "no shapes here" in r.stderr, r.stderr
    assert "Unsatisfiable" not in r.stdout + r.stderr and no_traceback(r), r.stdout + r.stderr
    assert "clean" not in r.stdout, r.stdout


# ---- 3. a target that refuses most configurations -------------------------------------------------


def test_target_refusing_most_configurations_reports_how_many_and_why(ran):
    r = result(ran, "one-group")
    report = re.search(
        r"refused ([\d,]+) of ([\d,]+) configurations; most often \(([\d,]+)\): one group only", r.stdout
    )
    assert report is not None, r.stdout + r.stderr
    refused, runs = int(report[1].replace(",", "")), int(report[2].replace(",", ""))
    assert 0 < refused < runs == 40, r.stdout
    assert (r.returncode, "clean:" in r.stdout) == (0, True), r.stdout + r.stderr


# ---- 4. a variant belongs to kvprop's own allocator -----------------------------------------------


def test_variant_with_a_path_target_exits_2(ran):
    r = result(ran, "variant-with-path-target")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--variant" in r.stderr and "kvprop target only" in r.stderr and no_traceback(r), r.stderr
    assert "FOUND" not in r.stdout and not (ran.where / "cx-variant").exists(), r.stdout


# ---- 5. every value is checked ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, flag",
    [
        ("fuzz --max-runs 0", "--max-runs"),
        ("fuzz --max-ops 0", "--max-ops"),
        ("fuzz --seconds nan", "--seconds"),
        ("fuzz --canary-seconds -1", "--canary-seconds"),
        ("bugs --workers 0", "--workers"),
        ("bugs --seconds-per-bug -1", "--seconds-per-bug"),
        ("fuzz --max-ops -5", "--max-ops"),
        ("fuzz --workers 1000", "--workers"),
        ("bugs --driver foo", "--driver"),
        ("fuzz --driver foo", "--driver"),
        ("fuzz --known liveness,foo", "--known"),
    ],
)
def test_bad_value_exits_2_naming_the_flag(tmp_path, args, flag):
    r = cli(*args.split(), cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"argument {flag}:" in r.stderr and no_traceback(r), r.stderr
    assert r.stdout == ""


# ---- 6. the canary is switched on in the target being fuzzed ---------------------------------------


@pytest.mark.parametrize(
    "name, target", [("canary-kvprop", "kvprop"), ("canary-path", "tests.example_target:make_target")]
)
def test_canary_is_found_in_the_target_being_fuzzed(ran, name, target):
    r = result(ran, name)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"canary: searching target {target} " in r.stdout and "canary ok" in r.stdout, r.stdout
    assert "clean:" in r.stdout, r.stdout


# ---- 7. a find is on disk before it is minimised ----------------------------------------------------


def test_find_is_written_before_minimising_and_replays(ran):
    r = result(ran, "seed0")
    traces, found = traces_in(ran.where / "cx-seed0")
    assert (r.returncode, len(traces), len(found)) == (1, 1, 1), r.stdout + r.stderr
    lines = [line.strip() for line in r.stdout.splitlines()]
    saved = lines.index(f"found {tr.load(found[0]).failure.kind} (seed {tr.load(found[0]).seed}); saved {found[0]}")
    assert saved < next(i for i, line in enumerate(lines) if line.startswith("minimising")), r.stdout
    replay = cli("replay", str(found[0]))
    assert (replay.returncode, "REPRODUCED" in replay.stdout) == (1, True), replay.stdout + replay.stderr


# ---- 8. Ctrl-C at the minimiser's first replay ----------------------------------------------------


def test_ctrl_c_at_the_minimisers_first_replay_keeps_the_find_and_says_where(ran):
    r = result(ran, "ctrl-c-at-first-replay")
    out = ran.where / "cx-first-replay"
    traces, found = traces_in(out)
    assert (r.returncode, len(traces), len(found)) == (1, 1, 1), r.stdout + r.stderr
    assert f"wrote {traces[0]}" in r.stdout, r.stdout


# ---- 9. --out is checked before the search --------------------------------------------------------


def test_out_that_is_a_regular_file_exits_2_before_searching(ran):
    r = result(ran, "out-is-a-file")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--out" in r.stderr and "not a directory" in r.stderr and no_traceback(r), r.stderr
    assert "found" not in r.stdout.lower(), r.stdout


@pytest.mark.skipif(os.geteuid() == 0, reason="running as root: directory permissions are not enforced")
def test_out_in_a_read_only_directory_exits_2_before_searching(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        r = cli(*FIND.split(), "--out", str(locked / "cx"), cwd=tmp_path)
    finally:
        locked.chmod(0o700)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--out" in r.stderr and no_traceback(r), r.stderr
    assert "found" not in r.stdout.lower(), r.stdout


# ---- 10. a second find never overwrites the first ----------------------------------------------------


@pytest.mark.parametrize("same_name", [False, True], ids=["name_for", "forced-same-name"])
def test_second_find_with_the_same_kind_and_seed_never_overwrites_the_first(tmp_path, same_name):
    failure = Failure(step=3, kind="block-in-two-groups", message="block 1 is live in groups [0, 1]")
    first = attrs.evolve(plan(0), variant=BUG, failure=failure)
    second = attrs.evolve(first, variant="evict-keeps-hash")
    names = ("same", "same") if same_name else (counterexample.name_for(first), counterexample.name_for(second))
    path1, _ = counterexample.write(first, tmp_path, names[0])
    path2, _ = counterexample.write(second, tmp_path, names[1])
    assert path1 != path2
    assert (tr.load(path1), tr.load(path2)) == (first, second)


# ---- 13. exit codes for unusable input --------------------------------------------------------------


def test_device_cuda_without_cuda_exits_2(ran):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is present here")
    r = result(ran, "device-cuda")
    assert (r.returncode, "'cuda'" in r.stderr) == (2, True), r.stdout + r.stderr
    assert no_traceback(r) and r.stdout == "", r.stdout + r.stderr


def test_device_tpu_exits_2(ran):
    r = result(ran, "device-tpu")
    assert (r.returncode, "'tpu'" in r.stderr) == (2, True), r.stdout + r.stderr
    assert no_traceback(r) and r.stdout == "", r.stdout + r.stderr


@pytest.mark.parametrize(
    "name, message",
    [
        ("target-raises-on-import", "RuntimeError: boom at import"),
        ("target-syntax-error", "SyntaxError"),
        ("target-not-callable", "not a callable"),
        ("target-bare-allocator", "must return Built(allocator, view, capabilities) or (allocator, view)"),
        ("target-allocator-and-none", "the view (NoneType) lacks"),
    ],
)
def test_unusable_target_exits_2_with_a_message_and_no_traceback(ran, name, message):
    r = result(ran, name)
    assert (r.returncode, message in r.stderr) == (2, True), r.stdout + r.stderr
    assert no_traceback(r) and "FOUND" not in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("name", ["replay-binary", "replay-utf16"])
def test_replay_of_a_file_that_is_not_utf8_json_exits_2(ran, name):
    r = result(ran, name)
    assert (r.returncode, "not UTF-8" in r.stderr) == (2, True), r.stdout + r.stderr
    assert no_traceback(r), r.stderr


@pytest.mark.parametrize(
    "command, relative, success",
    [("emit-test", "missing/dir/t.py", 0), ("minimise", "missing/x.json", 1)],
    ids=["emit-test", "minimise"],
)
def test_out_in_a_missing_directory_is_created_or_refused_never_a_traceback(ran, tmp_path, command, relative, success):
    result(ran, "seed0")
    traces, _ = traces_in(ran.where / "cx-seed0")
    assert len(traces) == 1
    out = tmp_path / relative
    r = cli(command, str(traces[0]), "--out", str(out), cwd=tmp_path)
    assert no_traceback(r), r.stderr
    if r.returncode == 2:
        assert r.stderr.strip() and not out.exists(), r.stderr
    else:
        assert (r.returncode, out.is_file(), f"wrote {out}" in r.stdout) == (success, True, True), r.stdout + r.stderr


# ---- 14. a crash of the target is a find of its own kind ---------------------------------------------


def test_target_raising_inside_allocate_slots_is_a_target_crash_find(ran):
    r = result(ran, "crasher")
    assert (r.returncode, "FOUND target-crash" in r.stdout) == (1, True), r.stdout + r.stderr
    assert "RuntimeError raised by the target's allocate_slots()" in r.stdout, r.stdout
    [trace], _ = traces_in(ran.where / "cx-crash")
    failure = json.loads(trace.read_text())["failure"]
    assert (failure["kind"], failure["origin"], failure["exception"]) == (
        "target-crash",
        "target-crash",
        "RuntimeError",
    )


# ---- 15. hand-made traces are checked field by field ---------------------------------------------------


def test_the_uncorrupted_trace_loads(ran):
    assert tr.load(ran.where / "valid.json") == plan(0)


@pytest.mark.parametrize("field", list(CORRUPTIONS))
def test_corrupted_trace_field_exits_2_naming_it(ran, field):
    r = result(ran, f"replay-corrupt-{field}")
    assert (r.returncode, CORRUPTIONS[field][1] in r.stderr, no_traceback(r)) == (2, True, True), r.stdout + r.stderr


# ---- 17. the run seed decides the walks ------------------------------------------------------------------


def _reported(r) -> tuple:
    walk = re.search(r"FOUND \S+ after [\d.]+s \(walk seed (\d+)\)", r.stdout)
    wrote = re.search(r"^wrote (\S+\.json)$", r.stdout, re.MULTILINE)
    return (walk and walk[1], wrote and os.path.basename(wrote[1]))


def test_same_seed_with_two_workers_reports_the_same_find_twice(ran):
    first, second = result(ran, "seed5-a"), result(ran, "seed5-b")  # run at the same time: timing must not matter
    assert (first.returncode, second.returncode) == (1, 1), first.stdout + second.stdout
    assert None not in _reported(first), first.stdout
    assert _reported(first) == _reported(second), first.stdout + "\n----\n" + second.stdout


@pytest.mark.parametrize("run_seed", [0, 5, 1_000_000])
def test_neighbouring_run_seeds_share_no_walk_seed(run_seed):
    assert walk_seed(run_seed, 0) != walk_seed(run_seed + 1, 0)
    assert {walk_seed(run_seed, i) for i in range(100)} & {walk_seed(run_seed + 1, i) for i in range(100)} == set()


# ---- 18. the commands say what they do ----------------------------------------------------------------------


def test_variants_lists_correct(ran):
    r = result(ran, "variants")
    assert r.returncode == 0 and "correct" in [line.split()[0] for line in r.stdout.splitlines()], r.stdout + r.stderr


@pytest.mark.parametrize("option", ["--seconds SECONDS", "--workers WORKERS", "--out OUT"])
def test_fuzz_help_shows_the_default(ran, option):
    r = result(ran, "fuzz-help")
    assert r.returncode == 0, r.stderr
    options = " ".join(r.stdout.split("options:", 1)[1].split())
    entry = re.search(rf"{re.escape(option)} (.*?)(?= --[a-z]|$)", options)
    assert entry is not None and re.search(r"\(default: [^)]+\)", entry[1]), options


# ---- 19. --json ---------------------------------------------------------------------------------------------


def test_json_prints_one_object_with_the_summary(ran):
    r = result(ran, "json")
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads(r.stdout)
    assert {"runs", "steps", "refused_configurations", "events", "find", "verdict"} <= set(summary), summary
    assert isinstance(summary["events"], dict) and summary["events"], summary
    assert (summary["find"], summary["verdict"], summary["refused_configurations"]) == (None, "clean", 0), summary
    assert summary["runs"] > 0 and summary["steps"] > 0, summary


# ---- 12. workers die with the parent (last: its 5 s deadline wants a quiet machine) ---------------


def test_workers_die_when_the_parent_is_killed(tmp_path, running):
    psutil = pytest.importorskip("psutil")

    def alive(proc) -> bool:
        try:
            return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    k = running("fuzz", "--workers", "2", "--seconds", "120", "--out", str(tmp_path / "cx"))
    assert k.wait_for(lambda line: line.startswith("["), timeout=90) is not None, "".join(k.lines)
    workers = psutil.Process(k.proc.pid).children(recursive=True)
    assert len(workers) >= 2, workers
    os.kill(k.proc.pid, signal.SIGKILL)
    k.proc.wait()
    deadline = time.monotonic() + 5
    while any(alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [w.pid for w in workers if alive(w)] == []
