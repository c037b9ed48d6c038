"""What a stalled request waits for (``kvprop.check.stall``): the cause a liveness find's
signature carries, so a campaign triages one liveness mechanism apart from the others."""

from __future__ import annotations

import attrs

from kvprop.check.stall import StallWatch
from kvprop.sim.request import Status
from kvprop.sim.step_report import StepReport


@attrs.frozen
class Live:
    request_id: str
    status: Status = Status.WAITING


def watched(*steps: tuple[StepReport, tuple[str, ...]], span: int = 10) -> StallWatch:
    watch = StallWatch(span)
    for report, loading in steps:
        watch.record(report, dict.fromkeys(loading))
    return watch


def test_a_request_loading_after_two_steps_waits_for_a_load():
    watch = watched((StepReport(), ("r0",)), (StepReport(scheduled={"r0": 1}), ()), (StepReport(), ("r0",)))
    assert watch.cause([Live("r0")]) == "load"


def test_a_request_preempted_twice_waits_for_preemption():
    watch = watched((StepReport(preempted=["r0"]), ()), (StepReport(scheduled={"r0": 2}, preempted=["r0"]), ()))
    assert watch.cause([Live("r0")]) == "preemption"


def test_a_waiting_request_never_scheduled_waits_for_admission():
    watch = watched((StepReport(scheduled={"r1": 1}), ()), (StepReport(scheduled={"r1": 1}), ()))
    assert watch.cause([Live("r0")]) == "admission"


def test_a_running_request_never_scheduled_waits_for_a_schedule():
    watch = watched((StepReport(), ()), (StepReport(), ()))
    assert watch.cause([Live("r0", Status.RUNNING)]) == "schedule"


def test_a_request_scheduled_yet_unfinished_waits_for_progress():
    watch = watched((StepReport(scheduled={"r0": 1}), ()), (StepReport(scheduled={"r0": 1}), ()))
    assert watch.cause([Live("r0", Status.RUNNING)]) == "progress"


def test_a_step_scheduling_no_tokens_is_no_progress():
    watch = watched((StepReport(scheduled={"r0": 0}), ()))
    assert watch.cause([Live("r0", Status.RUNNING)]) == "schedule"


def test_the_causes_of_several_requests_are_sorted_and_joined():
    watch = watched((StepReport(scheduled={"r1": 1}), ("r0",)), (StepReport(), ("r0",)))
    assert watch.cause([Live("r1", Status.RUNNING), Live("r0")]) == "load+progress"


def test_steps_older_than_two_windows_are_forgotten():
    early = [(StepReport(), ("r0",))] * 2
    late = [(StepReport(scheduled={"r0": 1}), ())] * 4
    assert watched(*early, *late, span=2).cause([Live("r0", Status.RUNNING)]) == "progress"


def test_the_last_window_and_the_one_before_are_both_judged():
    steps = [(StepReport(), ("r0",)), (StepReport(), ("r0",)), (StepReport(), ())]
    assert watched(*steps, span=2).cause([Live("r0")]) == "load"


def test_a_window_is_a_quarter_of_the_drains_bound():
    assert (StallWatch.for_bound(400).span, StallWatch.for_bound(3).span) == (100, 2)
