"""The pytest plugin: ``pytest --kvprop-target package.module:factory`` in a user's own suite.

Each test runs a fresh pytest in a temporary project (its own ``pytest.ini``, so neither this
repository's configuration nor its conftest applies), the way a team's CI would; the plugin
comes in through the ``pytest11`` entry point of the installed package, never by ``-p``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from test_hostile_targets import alive

from kvprop.search import trace as tr
from kvprop.search.execute import execute

ROOT = Path(__file__).resolve().parents[1]  # puts tests.example_target on the path of the inner pytest
CORRECT = "tests.example_target:make_target"
BUGGY = "tests.example_target:make_stale_map_target"  # found in a few examples: the plumbing is what is tested

TARGETS = '''
import os
import random
import signal
import time

from kvprop.allocator.view import AllocatorView
from kvprop.errors import ConfigError
from kvprop.search.alphabet import RandomChooser, sample_config
from kvprop.targets.kvprop import make_allocator
from tests.example_target import make_target

ONLY = sample_config(RandomChooser(random.Random(0))).allocator


def refuse_all(config):
    raise ConfigError(f"this allocator needs 4096 blocks, got {config.num_blocks}")


def build_one_shape(config):
    """Builds exactly one shape: the probe meets it, Hypothesis never draws it."""
    if config != ONLY:
        raise ConfigError("not the one shape this allocator builds")
    return make_target(config)


def crash(config):
    return {}["allocator"]


class Outcome(BaseException):
    """A target's own BaseException, as a test framework's outcome or asyncio.CancelledError."""


def _fork():
    child = os.fork()
    if child == 0:
        time.sleep(3600)
        os._exit(0)
    with open("forked.pids", "a") as f:
        f.write(f"{child}\\n")


FAULTS = {
    "exit": lambda: os._exit(3),
    "segfault": lambda: os.kill(os.getpid(), signal.SIGSEGV),
    "keyboard-interrupt": lambda: (_ for _ in ()).throw(KeyboardInterrupt),
    "base-exception": lambda: (_ for _ in ()).throw(Outcome("cancelled")),
    "hang": lambda: time.sleep(3600),
}


class Hostile:
    def __init__(self, allocator, fault):
        self._allocator, self._fault = allocator, fault

    def __getattr__(self, name):
        return getattr(self._allocator, name)

    def allocate_slots(self, request, *args, **kwargs):
        if self._fault == "fork":
            _fork()
        elif request.request_id == "r2":
            FAULTS[self._fault]()
        return self._allocator.allocate_slots(request, *args, **kwargs)


def _hostile(fault):
    def make(config):
        allocator = make_allocator(config)
        return Hostile(allocator, fault), AllocatorView(allocator)

    return make


exits, segfaults, interrupts = _hostile("exit"), _hostile("segfault"), _hostile("keyboard-interrupt")
raises_outcome, hangs, forks = _hostile("base-exception"), _hostile("hang"), _hostile("fork")
'''


@pytest.fixture
def project(tmp_path):
    """A user's project: its own pytest.ini, one plain test, and the targets above."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_plain.py").write_text("def test_plain():\n    assert True\n")
    (tmp_path / "my_targets.py").write_text(textwrap.dedent(TARGETS))
    return tmp_path


def pytest_in(where: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "KVPROP_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *args],
        cwd=where,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def kvprop_run(where: Path, target: str, *args: str) -> subprocess.CompletedProcess:
    return pytest_in(where, "--kvprop-target", target, "--kvprop-profile", "ci", *args)


def test_the_plugin_is_registered_through_the_pytest11_entry_point():
    assert [e.value for e in entry_points(group="pytest11") if e.name == "kvprop"] == ["kvprop.front.pytest_plugin"]


def test_the_plugin_imports_neither_kvprop_nor_hypothesis_nor_torch():
    code = (
        "import sys, kvprop.front.pytest_plugin; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'hypothesis', 'attrs')"
        " or m.startswith('kvprop.') and m not in ('kvprop.front', 'kvprop.front.pytest_plugin')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_without_a_target_nothing_is_added(project):
    run = pytest_in(project)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "PASSED test_plain.py::test_plain" in run.stdout and "1 passed" in run.stdout
    assert "kvprop[" not in run.stdout


def test_correct_target_passes_beside_the_tests_named(project):
    run = kvprop_run(project, CORRECT, "--kvprop-examples", "15", "test_plain.py")
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"PASSED kvprop[{CORRECT}]" in run.stdout and "2 passed" in run.stdout
    assert not (project / "counterexamples").exists()


def test_buggy_target_fails_with_the_violation_and_a_replayable_trace(project):
    run = kvprop_run(project, BUGGY, "--kvprop-examples", "150", "--kvprop-out", "found")
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"FAILED kvprop[{BUGGY}]" in run.stdout and "1 failed, 1 passed" in run.stdout
    assert f"kvprop: target {BUGGY!r} failed cache-map-stale (Hypothesis, profile ci" in run.stdout
    assert "Traceback" not in run.stdout and "During handling" not in run.stdout
    replay = next(line for line in run.stdout.splitlines() if line.startswith("replay: kvprop replay "))
    shown, named = replay.removeprefix("replay: kvprop replay ").split(" --target ")
    assert named == BUGGY  # a trace never chooses code: the replay line names the target
    path = project / shown
    assert path.parent == project / "found" and path.suffix == ".json"
    assert len(list(path.parent.glob("*.found.json"))) == 1  # the trace as found, beside the minimised one
    trace = tr.load(path)
    assert trace.target == BUGGY and trace.failure.kind == "cache-map-stale"
    assert execute(trace, target=BUGGY).kind == "cache-map-stale"  # what `kvprop replay` reruns
    assert execute(trace, target=CORRECT) is None


@pytest.mark.parametrize(
    ("target", "extra", "says"),
    [
        ("no_such_module:make_target", (), "target 'no_such_module:make_target': cannot import 'no_such_module'"),
        (
            "my_targets:refuse_all",
            (),
            "target 'my_targets:refuse_all' could not build any of 64 sampled configurations; "
            "first refusal: this allocator needs 4096 blocks, got ",
        ),
        (
            "my_targets:build_one_shape",
            ("--kvprop-examples", "5"),
            "target 'my_targets:build_one_shape' could build none of the configurations Hypothesis drew",
        ),
        ("my_targets:crash", (), "could not build an engine: target 'my_targets:crash': its factory raised KeyError"),
        (CORRECT, ("--kvprop-variant", "evict-keeps-hash"), "applies to --kvprop-target kvprop only"),
    ],
    ids=["unimportable", "refuses-all", "unsatisfiable", "factory-crashes", "variant-on-a-path-target"],
)
def test_a_target_that_cannot_run_fails_with_kvprops_message(project, target, extra, says):
    (project / "test_plain.py").unlink()  # the kvprop item is all the session collects
    run = kvprop_run(project, target, *extra)
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"FAILED kvprop[{target}]" in run.stdout and "1 failed in" in run.stdout
    message = next(line for line in run.stdout.splitlines() if line.startswith("kvprop: "))
    assert says in message, run.stdout
    assert "Unsatisfiable" not in run.stdout and "Traceback" not in run.stdout
    assert not (project / "counterexamples").exists()


# ---- a target that dies, hangs or forks never takes pytest with it ------------------------------


@pytest.mark.parametrize(
    ("target", "extra", "cause"),
    [
        ("my_targets:exits", (), "exit status 3"),
        ("my_targets:segfaults", (), "signal SIGSEGV"),
        ("my_targets:interrupts", (), "KeyboardInterrupt"),
        ("my_targets:raises_outcome", (), "Outcome"),
        ("my_targets:hangs", ("--kvprop-call-timeout", "3"), "target-hang"),
    ],
    ids=["exit", "segfault", "keyboard-interrupt", "base-exception", "hang"],
)
def test_a_target_that_dies_or_hangs_fails_its_item_with_a_saved_trace_and_pytest_goes_on(
    project, target, extra, cause
):
    run = kvprop_run(project, target, "--kvprop-examples", "50", "--kvprop-out", "found", *extra)
    saved = [p for p in (project / "found").glob("*.json") if not p.name.endswith(".found.json")]
    replay = {line for line in run.stdout.splitlines() if line.startswith("replay: kvprop replay ")}  # -rA repeats it
    assert (run.returncode, "1 failed, 1 passed" in run.stdout, len(saved), len(replay)) == (1, True, 1, 1), (
        run.stdout + run.stderr
    )
    assert cause in run.stdout, run.stdout


def test_no_process_a_target_forks_outlives_the_session(project):
    run = kvprop_run(project, "my_targets:forks", "--kvprop-examples", "10")
    forked = [int(pid) for pid in (project / "forked.pids").read_text().split()]
    assert (run.returncode, forked != [], [pid for pid in forked if alive(pid)]) == (0, True, []), run.stdout
