"""``kvprop report`` takes only finds on vLLM's targets: anything else is exit 2 with a message
naming what it takes, and no traceback (the reproducers themselves are tested with vLLM
installed, in tests/test_vllm_target.py and tests/test_vllm_scheduler.py)."""

from __future__ import annotations

import importlib.util

import attrs
import pytest
from helpers import motivating_trace

from kvprop.front.cli import main
from kvprop.search import trace as tr


def report(tmp_path, capsys, trace, *extra) -> tuple[int, str]:
    path = tmp_path / "find.json"
    tr.save(trace, path)
    code = main(["report", str(path), *extra])
    return code, capsys.readouterr().err


def test_a_find_on_kvprops_own_allocator_is_refused_naming_the_vllm_target(tmp_path, capsys):
    code, err = report(tmp_path, capsys, motivating_trace())
    assert (code, "is a find on kvprop's own allocator" in err, "'vllm-scheduler'" in err) == (2, True, True)


def test_a_target_other_than_vllms_is_refused_by_name(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        report(tmp_path, capsys, motivating_trace(), "--target", "kvprop")
    err = capsys.readouterr().err
    assert (exited.value.code, "invalid choice: 'kvprop'" in err, "'vllm-scheduler'" in err) == (2, True, True)


def test_a_scheduler_find_naming_a_variant_is_refused(tmp_path, capsys):
    code, err = report(tmp_path, capsys, motivating_trace(), "--target", "vllm-scheduler")
    assert (code, "names variant 'interleaved-external-alloc'" in err) == (2, True)


def test_a_find_on_a_users_target_is_refused(tmp_path, capsys):
    code, err = report(tmp_path, capsys, attrs.evolve(motivating_trace(), target="mypkg.alloc:make", variant=None))
    assert (code, "target 'mypkg.alloc:make'" in err, "targets 'vllm'" in err) == (2, True, True)


def test_a_vllm_find_naming_a_variant_is_refused(tmp_path, capsys):
    code, err = report(tmp_path, capsys, attrs.evolve(motivating_trace(), target="vllm"))
    assert (code, "names variant 'interleaved-external-alloc'" in err) == (2, True)


def test_an_out_path_that_is_a_file_is_refused(tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.write_text("")
    trace = attrs.evolve(motivating_trace(), target="vllm", variant=None)
    code, err = report(tmp_path, capsys, trace, "--out", str(taken))
    assert (code, "is a file; give a folder" in err) == (2, True)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_a_vllm_find_without_vllm_installed_says_how_to_install_it(tmp_path, capsys):
    code, err = report(tmp_path, capsys, attrs.evolve(motivating_trace(), target="vllm", variant=None))
    assert (code, "needs vLLM importable" in err, "make vllm-env" in err, "Traceback" in err) == (2, True, True, False)
