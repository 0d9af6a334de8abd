"""The hang timeout of an attempt's first step: the first step does the attempt's one-off
work (FSDP's lazy init, first allocations, compile) that nothing has measured yet. Judged
by the floor alone, a first step that took 4.1 s on a slow host (floor 4 s) was named a
hang outside communication and failed the run (seen in tests/test_hang_diagnosis.py inside
the slow-host CPU quota)."""

import pytest

from rayflex.faults.detector import FaultDetector
from rayflex.group.worker_group import PollResult
from rayflex.worker.status import WorkerState, WorkerStatus

FLOOR = 4.0


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _poll(step: int, phase: str = "forward_backward") -> PollResult:
    return PollResult({r: WorkerStatus(rank=r, node_id="n", state=WorkerState.RUNNING, step=step, phase=phase)
                       for r in range(2)}, {}, [])


def test_the_first_step_gets_its_warmup_then_the_floor_applies(monkeypatch):
    monkeypatch.setenv("RAYFLEX_HANG_TIMEOUT_FLOOR_S", str(FLOOR))
    clock = _Clock()
    detector = FaultDetector(2, {0: "n", 1: "n"}, clock=clock)
    assert detector.hang_timeout_s() == 3 * FLOOR
    assert not detector.check(_poll(0), now=clock.now)  # the attempt's start (its restored step)
    clock.now += FLOOR + 1  # a slow first step: past the floor, within the warm-up
    assert not detector.check(_poll(0), now=clock.now)
    clock.now += 2 * FLOOR  # past three floors: nobody progresses, a hang
    fault = detector.check(_poll(0), now=clock.now)
    assert fault and fault.hang == "collective" and fault.events[0].timeout_s == 3 * FLOOR

    measured = FaultDetector(2, {0: "n", 1: "n"}, clock=clock)
    measured.check(_poll(0), now=clock.now)
    measured.note_step(1, 0.1, {})
    assert measured.hang_timeout_s() == FLOOR, "once a step is measured: the floor (or 10 x the median)"
    clock.now += FLOOR + 1
    assert measured.check(_poll(1, "collective"), now=clock.now), "a later step gets no warm-up"


def test_a_frozen_rank_is_named_at_the_first_check_past_the_heartbeat(monkeypatch):
    # The event says when the previous check ran (poll_gap_s): with it a test bounds the
    # detection by this host's own controller cycle, not by a fixed number of seconds.
    monkeypatch.setenv("RAYFLEX_HEARTBEAT_TIMEOUT_S", "3")
    clock = _Clock()
    detector = FaultDetector(2, {0: "n", 1: "n"}, clock=clock)
    answered = PollResult({0: _poll(1).statuses[0]}, {}, [1])  # rank 1 silent from here on
    assert not detector.check(_poll(1), now=clock.now)
    silent_from = clock.now
    for gap in (0.2, 1.7, 0.9):  # uneven cycles, as on a busy host: 2.8 s of silence
        clock.now += gap
        assert not detector.check(answered, now=clock.now)
    clock.now += 1.3
    fault = detector.check(answered, now=clock.now)
    (hang,) = fault.events
    assert fault.hang == "frozen" and hang.ranks == [1]
    assert hang.stalled_s == pytest.approx(clock.now - silent_from) and hang.poll_gap_s == pytest.approx(1.3)
    assert hang.stalled_s - hang.poll_gap_s <= hang.timeout_s < hang.stalled_s
