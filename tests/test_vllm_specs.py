"""Every KV cache spec the installed vLLM release registers is driven by kvprop or refused with a
reason (``kvprop.targets.vllm.specs``); skipped where vLLM is absent (never in ``make test-vllm``)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
vllm = __import__("vllm") if os.environ.get("KVPROP_REQUIRE_VLLM") else pytest.importorskip("vllm")

from kvprop.targets.vllm.specs import DRIVEN, census  # noqa: E402

pytestmark = pytest.mark.vllm


def test_every_registered_spec_is_driven_or_refused_with_a_reason():
    assert [row.spec for row in census() if not row.driven and row.reason is None] == []


def test_the_specs_kvprop_drives_are_registered_by_the_release():
    assert sorted(set(DRIVEN) - {row.spec for row in census()}) == []
