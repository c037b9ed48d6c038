"""A hit that ends inside a block keyed in the current step, and the copy it takes.

The trace (found by ``kvprop fuzz --seconds 240 --workers 2 --seed 23``, minimised to 8
operations): full attention and a state group, blocks of 3, hash unit 1. At drain step 9 r6
(5 tokens) is admitted without a hit and keys block 7 at its prompt's last boundary, 4 tokens,
which this step's forward pass computes; r7, the same prompt and one token more, is admitted
next in the same step and hits those 4 tokens, inside block 7. Its copy of block 7 runs before
the forward pass (vLLM's worker applies ``kv_cache_block_copies`` first) and copies what the
block held before. kvprop's full-attention manager refuses such a hit until the next step;
variant ``copy-before-compute`` is vLLM 0.33.0's rule, which admits it.
"""

from pathlib import Path

from kvprop.check import checker, data
from kvprop.search.execute import execute
from kvprop.search.trace import load

TRACE = load(Path(__file__).parent / "data" / "copy-before-compute.json")


def test_the_correct_allocator_waits_a_step_and_passes():
    assert execute(TRACE) is None


def test_the_copy_before_the_forward_pass_reads_back_wrong():
    failure = execute(TRACE, variant="copy-before-compute")
    assert (failure.step, failure.kind) == (8, "data-mismatch")


def test_the_positions_a_copy_filled_are_judged_as_the_requests_own():
    """The incremental data check expects of a copy's positions the request's own fingerprints,
    as a full sweep does, not what the copy happened to bring."""
    failure = execute(TRACE, variant="copy-before-compute")
    assert "r7 group 0 position 3 in block 2" in failure.message


def test_without_the_copied_positions_only_the_later_cached_block_shows_it(monkeypatch):
    every_position = data._expect_computed

    def without_copies(*args, only=None):
        if only is None:
            every_position(*args)

    monkeypatch.setattr(data, "_expect_computed", without_copies)
    failure = execute(TRACE, variant="copy-before-compute")
    assert failure.message.startswith("data-mismatch: cached(")


def test_the_bound_without_full_attention_in_the_same_step_groups_calls_the_wait_spurious(monkeypatch):
    monkeypatch.setattr(checker.Checker, "same_step_groups", staticmethod(lambda engine: engine.state_groups))
    failure = execute(TRACE)
    assert (failure.step, failure.kind) == (8, "spurious-refusal")


def test_a_full_sweep_at_every_check_reports_the_same_words():
    incremental = execute(TRACE, variant="copy-before-compute")
    full = execute(TRACE, variant="copy-before-compute", full_sweeps=True)
    assert (full.step, full.kind, full.message) == (incremental.step, incremental.kind, incremental.message)
