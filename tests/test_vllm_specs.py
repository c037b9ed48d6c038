"""Every KV cache spec the installed vLLM release registers is driven by kvprop or refused with a
reason (``kvprop.targets.vllm.specs``); skipped where vLLM is absent (never in ``make test-vllm``)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
vllm = __import__("vllm") if os.environ.get("KVPROP_REQUIRE_VLLM") else pytest.importorskip("vllm")

import attrs  # noqa: E402

from kvprop.allocator.specs import (  # noqa: E402
    AllocatorConfig,
    ChunkedLocal,
    EngineConfig,
    FullAttention,
    Mamba,
    SlidingWindow,
)
from kvprop.search.alphabet import RandomChooser, sample_config  # noqa: E402
from kvprop.search.execute import run  # noqa: E402
from kvprop.search.harness import Harness  # noqa: E402
from kvprop.search.walk import operations, start  # noqa: E402
from kvprop.targets import shapes_of  # noqa: E402
from kvprop.targets.vllm.spec_classes import spec_class_name  # noqa: E402
from kvprop.targets.vllm.specs import FILED, census, drawn, registered  # noqa: E402

pytestmark = pytest.mark.vllm
FINDINGS = Path(__file__).parent.parent / "findings"
DRAWN = drawn()
GROUP = {  # one group of each kind, as the sampler draws them
    "full": FullAttention(4),
    "sliding_window": SlidingWindow(4, 8),
    "chunked_local": ChunkedLocal(4, 8),
    "mamba": Mamba(4),
}
WALK_STEPS = 300


def test_every_registered_spec_is_driven_or_refused_with_a_reason():
    assert [row.spec for row in census() if not row.driven and row.reason is None] == []


def test_the_specs_kvprop_drives_are_registered_by_the_release():
    names = {spec.__name__ for spec in registered()[0]}
    assert sorted(set(DRAWN) - names) == []


def test_the_sampler_draws_every_spec_it_counts_as_driven():
    shapes = shapes_of("vllm")
    seen = set()
    for seed in range(400):
        allocator = sample_config(RandomChooser(random.Random(seed)), shapes).allocator
        seen |= {spec_class_name(group.kind, allocator.page_layout) for group in allocator.groups}
    assert sorted(set(DRAWN) - seen) == []


@pytest.mark.parametrize("spec", sorted(DRAWN))
def test_a_walk_over_each_driven_spec_builds_the_manager_its_registry_names_and_stays_clean(spec):
    kind, layout = DRAWN[spec]
    config = EngineConfig(AllocatorConfig((GROUP[kind],), 24, page_layout=layout), token_budget=16)
    harness = Harness(config, target="vllm")
    manager = harness.engine.allocator.manager
    groups = manager.kv_cache_config.kv_cache_groups
    managers = registered()[0]
    built = [type(m) for m in manager.coordinator.single_type_managers]
    assert ([type(g.kv_cache_spec).__name__ for g in groups], built) == (
        [spec],
        [managers[type(g.kv_cache_spec)] for g in groups],
    )
    begun = attrs.evolve(start(seed=7, max_ops=WALK_STEPS), config=config, length=WALK_STEPS)
    taken: list = []
    assert (run(harness, operations(begun, harness, taken), drain=True), len(taken)) == (None, WALK_STEPS)


def test_the_specs_that_fail_to_construct_are_the_filed_findings_recorded_for_this_release():
    def affected(finding: str) -> bool:
        record = json.loads((FINDINGS / finding / "finding.json").read_text())
        return record["releases"].get(vllm.__version__) == "affected"

    crashed = {row.spec: row.finding for row in census() if row.crash is not None}
    assert crashed == {spec: finding for spec, finding in FILED.items() if affected(finding)}
