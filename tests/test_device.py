"""Paged memory on the device: cpu always, cuda where torch sees one (skipped cleanly otherwise)."""

import pytest
import torch
from helpers import BUGGY, motivating_trace

from kvprop.errors import ConfigError
from kvprop.search.execute import execute
from kvprop.search.walk import plan
from kvprop.sim.memory import UNWRITTEN, PagedMemory, pick_device

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
]


def test_default_device_is_cuda_when_present_else_cpu():
    assert pick_device().type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_asking_for_cuda_without_one_is_a_clear_error():
    with pytest.raises(ConfigError, match="requested but torch sees no CUDA device"):
        pick_device("cuda")


def test_unknown_device_is_a_clear_error():
    with pytest.raises(ConfigError, match="device must be 'cpu', 'cuda' or 'cuda:N'"):
        pick_device("tpu")


@pytest.mark.parametrize("device", DEVICES)
def test_scatter_gather_compare_round_trip(device):
    memory = PagedMemory(num_blocks=8, block_size=4, device=device)
    assert memory.data.device.type == device
    slots, values = [5, 6, 30], [11, 12, 13]
    memory.write(slots, values)
    assert memory.read(slots) == values
    assert memory.mismatches(slots, values) == []
    assert memory.mismatches(slots, [11, 99, 13]) == [1]
    assert memory.row(0) == [UNWRITTEN] * 4


@pytest.mark.parametrize("device", DEVICES)
def test_walks_run_clean_and_find_the_motivating_bug_on_the_device(device):
    for seed in range(5):
        assert execute(plan(seed), device=device) is None
    assert execute(motivating_trace(), variant=BUGGY, device=device).kind == "block-in-two-groups"
