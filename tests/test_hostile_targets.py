"""Targets that hang, exit, crash or print: each is a find or a target error, never kvprop's.

Every test writes a small hostile target module: kvprop's own allocator behind a facade
whose fault fires at import, in the factory, or in ``allocate_slots`` for the third request
(``r2``, reached within a few operations by any walk). kvprop runs the target only in a
supervised worker (``kvprop.search.supervisor``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from test_cli import ROOT
from test_cli import kvprop as cli

MODULE = """
import os, signal, sys, time
from kvprop.allocator.view import AllocatorView
from kvprop.targets.kvprop import make_allocator

{at_import}


class Hostile:
    def __init__(self, allocator):
        self._allocator = allocator

    def __getattr__(self, name):
        return getattr(self._allocator, name)

    def allocate_slots(self, request, *args, **kwargs):
        {every_call}
        if request.request_id == "r2":
            {in_call}
        return self._allocator.allocate_slots(request, *args, **kwargs)


def make_target(config):
    {in_factory}
    allocator = make_allocator(config)
    return Hostile(allocator), AllocatorView(allocator)
"""

FAULTS = {
    "hang": "time.sleep(3600)",
    "exit": "os._exit(3)",
    "segfault": "os.kill(os.getpid(), signal.SIGSEGV)",
    "system-exit": "raise SystemExit(0)",
    "keyboard-interrupt": "raise KeyboardInterrupt",
}


def write_target(tmp_path: Path, at_import="pass", in_factory="pass", in_call="pass", every_call="pass") -> str:
    source = MODULE.format(at_import=at_import, in_factory=in_factory, in_call=in_call, every_call=every_call)
    (tmp_path / "hostile.py").write_text(source)
    return "hostile:make_target"


def kvprop(tmp_path: Path, *args):
    """``kvprop`` run in ``tmp_path``, where the test writes its target module."""
    return cli(*args, cwd=tmp_path, env={"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"})


def fuzz(tmp_path: Path, target: str, *more):
    args = ("fuzz", "--workers", "1", "--seconds", "120", "--seed", "1", "--call-timeout", "2", "--out", "cx")
    return kvprop(tmp_path, *args, "--target", target, "--json", *more)


def minimised(tmp_path: Path) -> Path:
    (trace,) = [p for p in (tmp_path / "cx").glob("*.json") if not p.name.endswith(".found.json")]
    return trace


@pytest.mark.parametrize(
    ("where", "fault", "kind", "cause", "phase"),
    [
        ("at_import", "hang", "target-hang", "hang", "while building the target"),
        ("in_factory", "hang", "target-hang", "hang", "while building the target"),
        ("in_call", "hang", "target-hang", "hang", "in "),
        ("in_factory", "system-exit", "target-crash", "exit status 0", "while building the target"),
        ("in_factory", "keyboard-interrupt", "target-crash", "exit status 130", "while building the target"),
        ("in_call", "exit", "target-crash", "exit status 3", "in "),
        ("in_call", "segfault", "target-crash", "signal SIGSEGV", "in "),
    ],
)
def test_a_dying_or_hanging_target_is_a_find_saved_and_replayed(tmp_path, where, fault, kind, cause, phase):
    target = write_target(tmp_path, **{where: FAULTS[fault]})
    r = fuzz(tmp_path, target)
    find = json.loads(r.stdout)["find"]
    trace = minimised(tmp_path)
    saved = json.loads(trace.read_text())["failure"]
    replayed = kvprop(tmp_path, "replay", str(trace), "--target", target, "--call-timeout", "2")
    assert (r.returncode, find["kind"], saved["exception"], phase in saved["message"]) == (1, kind, cause, True), (
        r.stderr
    )
    assert (replayed.returncode, f"REPRODUCED {kind} (the recorded violation)" in replayed.stdout) == (1, True)


def test_a_call_that_raises_system_exit_is_a_target_crash_in_that_call(tmp_path):
    r = fuzz(tmp_path, write_target(tmp_path, in_call=FAULTS["system-exit"]))
    find = json.loads(r.stdout)["find"]
    assert (r.returncode, find["kind"], "SystemExit raised by the target's allocate_slots()" in find["message"]) == (
        1,
        "target-crash",
        True,
    )


OUTCOME = "class Outcome(BaseException):\n    pass\n"  # as a test framework's outcome or asyncio.CancelledError


@pytest.mark.parametrize("driver", ["walk", "hypothesis"])
def test_a_target_raising_its_own_base_exception_in_a_call_is_a_target_crash_naming_it(tmp_path, driver):
    target = write_target(tmp_path, at_import=OUTCOME, in_call="raise Outcome('cancelled')")
    r = fuzz(tmp_path, target, "--driver", driver)
    find = json.loads(r.stdout)["find"]
    assert (r.returncode, find["kind"], "Outcome raised by the target's allocate_slots()" in find["message"]) == (
        1,
        "target-crash",
        True,
    ), r.stderr


@pytest.mark.parametrize("driver", ["walk", "hypothesis"])
def test_a_factory_raising_its_own_base_exception_is_a_target_crash_naming_it(tmp_path, driver):
    target = write_target(tmp_path, at_import=OUTCOME, in_factory="raise Outcome('cancelled')")
    r = fuzz(tmp_path, target, "--driver", driver)
    find = json.loads(r.stdout)["find"]
    saved = json.loads(minimised(tmp_path).read_text())["failure"]
    assert (r.returncode, find["kind"], saved["exception"], "while building the target" in saved["message"]) == (
        1,
        "target-crash",
        "Outcome",
        True,
    ), r.stderr


@pytest.mark.parametrize("command", ["replay", "agree"])
def test_a_target_raising_its_own_base_exception_is_a_find_under_replay_and_agree(tmp_path, command):
    target = write_target(tmp_path, at_import=OUTCOME, in_call="raise Outcome('cancelled')")
    fuzz(tmp_path, target)
    args = ("replay", str(minimised(tmp_path))) if command == "replay" else ("agree", "--walks", "20", "--out", "cx2")
    r = kvprop(tmp_path, *args, "--target", target)
    assert (r.returncode, "Outcome" in r.stdout + r.stderr, "internal error" in r.stderr) == (1, True, False), (
        r.stdout + r.stderr
    )


@pytest.mark.parametrize("error", ["TypeError", "ValueError", "RecursionError", "MemoryError"])
@pytest.mark.parametrize("command", ["fuzz", "replay"])
def test_a_factory_that_raises_exits_2_naming_the_target_and_the_exception(tmp_path, error, command):
    target = write_target(tmp_path, in_factory=f"raise {error}('broken factory')")
    if command == "fuzz":
        r = fuzz(tmp_path, target)
    else:
        r = kvprop(tmp_path, "replay", str(ROOT / "tests/data/one-token-reload-uncached.json"), "--target", target)
    says = f"target 'hostile:make_target': its factory raised {error}: broken factory"
    assert (r.returncode, says in r.stderr, "internal error" in r.stderr, "Traceback" in r.stderr) == (
        2,
        True,
        False,
        False,
    ), r.stderr


def test_an_import_that_raises_exits_2_naming_the_target(tmp_path):
    r = fuzz(tmp_path, write_target(tmp_path, at_import="raise RuntimeError('broken import')"))
    says = "target 'hostile:make_target': importing 'hostile' raised RuntimeError: broken import"
    assert (r.returncode, says in r.stderr) == (2, True), r.stderr


def test_what_the_target_prints_goes_to_a_log_beside_the_find_not_to_kvprops_output(tmp_path):
    noisy = "sys.stdout.write('x' * 100_000); sys.stderr.write('y' * 100_000)"
    r = fuzz(tmp_path, write_target(tmp_path, every_call=noisy, in_call=FAULTS["exit"]))
    find = json.loads(r.stdout)["find"]  # stdout is one JSON object and nothing else
    log = Path(tmp_path / find["log"]).read_text()
    assert (r.returncode, "xxxx" in r.stdout + r.stderr, log.count("x") >= 100_000, "yyyy" in log) == (
        1,
        False,
        True,
        True,
    )


@pytest.mark.parametrize(
    "command", [("agree", "--walks", "20"), ("coverage", "--seconds", "60")], ids=["agree", "coverage"]
)
def test_a_target_dying_under_agree_or_coverage_is_a_find_saved_with_its_replay(tmp_path, command):
    target = write_target(tmp_path, in_call=FAULTS["segfault"])
    r = kvprop(tmp_path, *command, "--target", target, "--out", "cx")
    (found,) = (tmp_path / "cx").glob("*.found.json")
    replayed = kvprop(tmp_path, "replay", str(found), "--target", target)
    says = "FOUND target-crash while"
    assert (r.returncode, says in r.stderr, replayed.returncode) == (1, True, 1), r.stdout + r.stderr


def test_a_hanging_target_under_coverage_ends_past_the_call_timeout_as_a_target_hang(tmp_path):
    target = write_target(tmp_path, in_call=FAULTS["hang"])
    r = kvprop(tmp_path, "coverage", "--seconds", "600", "--call-timeout", "2", "--target", target, "--out", "cx")
    assert (r.returncode, "FOUND target-hang while coverage ran the target" in r.stderr) == (1, True), r.stderr


def test_a_minimised_trace_that_cannot_be_written_where_asked_exits_2_naming_the_path_before_minimising(tmp_path):
    target = write_target(tmp_path, in_call=FAULTS["exit"])
    fuzz(tmp_path, target)
    (found,) = (tmp_path / "cx").glob("*.found.json")
    r = kvprop(tmp_path, "minimise", str(found), "--target", target, "--out", "/proc/kvprop-cannot-write.json")
    assert (
        r.returncode,
        "'/proc/kvprop-cannot-write.json' cannot be written" in r.stderr,
        "minimising" in r.stdout,
    ) == (
        2,
        True,
        False,
    ), r.stdout + r.stderr


# ---- processes a target starts end with its run ----------------------------------------------------

FORK = (
    "child = os.fork()\n"
    "        if child == 0:\n"
    "            time.sleep(3600)\n"
    "            os._exit(0)\n"
    "        open(os.environ['KVPROP_TEST_PIDS'], 'a').write(f'{child}\\n')"
)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting to be reaped does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def forked_survivors(tmp_path: Path, *args) -> tuple[int, list[int]]:
    """(exit code, the target's forked processes still alive) after ``kvprop ARGS`` ran a target
    that forks a sleeping child in every allocation."""
    pids = tmp_path / "pids"
    env = {"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}", "KVPROP_TEST_PIDS": str(pids)}
    r = cli(*args, cwd=tmp_path, env=env)
    forked = [int(line) for line in pids.read_text().split()] if pids.exists() else []
    assert forked, r.stdout + r.stderr  # the target did fork
    return r.returncode, [pid for pid in forked if alive(pid)]


@pytest.mark.parametrize(
    "command",
    [
        ("fuzz", "--workers", "1", "--seed", "1", "--max-runs", "20", "--out", "cx"),
        ("fuzz", "--workers", "1", "--seed", "1", "--max-runs", "20", "--driver", "hypothesis", "--out", "cx"),
        ("agree", "--walks", "3", "--out", "cx"),
    ],
    ids=["fuzz-walk", "fuzz-hypothesis", "agree"],
)
def test_no_process_a_target_forks_outlives_the_command(tmp_path, command):
    target = write_target(tmp_path, every_call=FORK)
    rc, survivors = forked_survivors(tmp_path, *command, "--target", target)
    assert (rc in (0, 1), survivors) == (True, [])


def test_no_process_a_target_forks_outlives_a_replay(tmp_path):
    target = write_target(tmp_path, in_call=FAULTS["exit"])
    fuzz(tmp_path, target)
    trace = minimised(tmp_path)
    write_target(tmp_path, every_call=FORK, in_call=FAULTS["exit"])
    rc, survivors = forked_survivors(tmp_path, "replay", str(trace), "--target", target)
    assert (rc, survivors) == (1, [])


# ---- a target that leaks is a find, not a machine brought down --------------------------------------

LEAK = "LEAKED.append(b'x' * (64 * 2**20))"


@pytest.mark.parametrize("driver", ["walk", "hypothesis"])
def test_a_target_leaking_past_the_memory_bound_is_a_target_oom_with_its_trace(tmp_path, driver):
    target = write_target(tmp_path, at_import="LEAKED = []", every_call=LEAK)
    r = fuzz(tmp_path, target, "--driver", driver, "--max-memory", "512")
    find = json.loads(r.stdout)["find"]
    saved = json.loads(minimised(tmp_path).read_text())["failure"]
    assert (r.returncode, find["kind"], saved["kind"]) == (1, "target-oom", "target-oom"), r.stderr


def test_a_target_leaking_under_replay_is_a_target_oom(tmp_path):
    target = write_target(tmp_path, at_import="LEAKED = []", every_call=LEAK)
    fuzz(tmp_path, target, "--max-memory", "512")
    r = kvprop(tmp_path, "replay", str(minimised(tmp_path)), "--target", target, "--max-memory", "512")
    assert (r.returncode, "REPRODUCED target-oom" in r.stdout) == (1, True), r.stdout + r.stderr


# ---- a hang is found, saved and minimised within the time budget -------------------------------------


def test_a_hanging_target_under_the_default_call_timeout_is_found_within_the_budget(tmp_path):
    """The call timeout fits the budget (a quarter of --seconds, at least 10 s): the hang is a
    find with its trace, not a run that "tested nothing"."""
    target = write_target(tmp_path, in_call=FAULTS["hang"])
    args = ("fuzz", "--workers", "1", "--seconds", "40", "--seed", "1", "--out", "cx", "--json")
    r = kvprop(tmp_path, *args, "--target", target)
    summary = json.loads(r.stdout)
    assert (r.returncode, summary["find"]["kind"], len(list((tmp_path / "cx").glob("*.found.json")))) == (
        1,
        "target-hang",
        1,
    ), r.stderr


def test_a_factory_that_never_returns_is_saved_before_minimising_and_minimised_within_the_budget(tmp_path):
    target = write_target(tmp_path, in_factory=FAULTS["hang"])
    args = ("fuzz", "--workers", "1", "--seconds", "20", "--call-timeout", "3", "--out", "cx")
    r = kvprop(tmp_path, *args, "--target", target)
    said = r.stdout + r.stderr
    saved = said.find("found target-hang while building the target; saved ")
    assert (r.returncode, saved != -1, -1 < saved < said.find("minimising"), "at most 20s" in said) == (
        1,
        True,
        True,
        True,
    ), said
    assert "FAILED at building the target" in said, said


# ---- a verdict never depends on what an earlier run left in the worker -----------------------------

LEAKS_STATE = "import builtins\nBUILT = []"  # a module global that outlives a run in its process


def test_a_target_whose_behaviour_depends_on_earlier_runs_gives_finds_that_replay(tmp_path):
    """The target crashes only in the first allocator its process builds: in a reused worker the
    find would pass when minimised or replayed; each run in a fresh fork of the worker fails alike."""
    target = write_target(
        tmp_path,
        at_import=LEAKS_STATE,
        in_factory="BUILT.append(1)",
        in_call="if len(BUILT) % 2 == 1: raise RuntimeError('first build only')",
    )
    r = fuzz(tmp_path, target)
    replayed = kvprop(tmp_path, "replay", str(minimised(tmp_path)), "--target", target)
    assert (r.returncode, json.loads(r.stdout)["find"]["kind"], replayed.returncode) == (1, "target-crash", 1), (
        r.stdout + r.stderr + replayed.stdout
    )
