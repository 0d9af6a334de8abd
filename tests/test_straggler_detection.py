"""The straggler signal (rayflex.faults.detector): a rank the others keep waiting for is
named once, with its node and how much longer the others wait; a rank descheduled for a
few steps on a shared CPU, or one that costs the run next to nothing, is not."""

import random

import pytest

from rayflex.faults.detector import FaultDetector
from rayflex.telemetry import events as ev

NODES = {0: "a", 1: "a", 2: "b", 3: "b"}
STEP_S = 0.2


def _waits(last: int, wait_s: float = 0.05) -> dict[int, float]:
    """The end-of-step waits when rank ``last`` arrives last: it waits ~0, the others ``wait_s``."""
    return {r: (0.0005 if r == last else wait_s) for r in NODES}


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _detector():
    clock = _Clock()
    return FaultDetector(4, NODES, clock=clock), clock


def _feed(detector_and_clock, waits_per_step) -> list[ev.StragglerDetected]:
    detector, clock = detector_and_clock
    out = []
    for step, waits in enumerate(waits_per_step, start=1):
        clock.now += STEP_S
        out += detector.note_step(step, STEP_S, waits)
    return out


def test_a_rank_the_others_keep_waiting_for_is_named_once_with_its_node_and_ratio():
    # Named once it has been the last for most of a whole window (20 s: 100 steps of 0.2 s).
    named = _feed(_detector(), [_waits(2)] * 150)
    assert len(named) == 1, named
    assert (named[0].rank, named[0].node_id) == (2, "b") and 100 <= named[0].step <= 102, named[0]
    assert named[0].ratio > 50


def test_a_rank_descheduled_for_a_few_steps_in_a_row_on_a_shared_cpu_is_not_named():
    # 4 ranks sharing 2 cores: one of them arrives last, the same one up to 8 steps running
    # while the scheduler keeps it off a core (the demo's false positive: 5 in a row, ratio
    # 5.7), then any of them.
    rng = random.Random(7)
    steps = []
    while len(steps) < 400:
        steps += [_waits(rng.randrange(4))] * rng.randint(1, 8)
    assert _feed(_detector(), steps) == []


def test_a_rank_slow_for_less_than_most_of_the_window_is_not_named():
    # Slow for 15 s of every 20 s: three quarters, not most (0.8) of the window.
    steps = ([_waits(1)] * 75 + [_waits((0, 2, 3)[r % 3]) for r in range(25)]) * 4
    assert _feed(_detector(), steps) == []


def test_a_slow_step_run_is_judged_on_at_least_ten_steps():
    # 5 s steps: the window holds 4 of them, so it stretches to 10 before it names anyone.
    detector, clock = _detector()
    named = []
    for step in range(1, 16):
        clock.now += 5.0
        named += detector.note_step(step, 5.0, {r: (0.001 if r == 3 else 1.0) for r in NODES})
    assert [(e.rank, e.step) for e in named] == [(3, 10)], named


def test_a_rank_that_costs_the_run_less_than_a_twentieth_of_the_step_is_not_named():
    # The others wait 6 ms of a 200 ms step for it: 3% of the run, not worth an event.
    assert _feed(_detector(), [_waits(3, wait_s=0.006)] * 300) == []


# ----------------------------------------------------------------- acting on one
def _policy(workers=4, min_workers=2):
    import rayflex as rf
    from rayflex.faults.policy import StragglerPolicy
    from rayflex.models.summary import ModelSummary

    model = ModelSummary(name="m", num_blocks=4, hidden_size=8, init_seed=1, block_params=(10, 10, 10, 10))
    spec = rf.TrainSpec(model=model, data=rf.DataConfig(uri="file:///nowhere", seq_len=8, global_batch=8),
                        run=rf.RunConfig(name="r", storage="file:///tmp/nowhere", steps=100),
                        scaling=rf.ScalingConfig(num_workers=workers, min_workers=min_workers))
    return StragglerPolicy(spec)


def _decide(policy, **kw):
    args = dict(node_id="b", ranks=[2, 3], world=4, usable_slots=2, remaining_steps=1000, slow_step_s=0.6,
                wait_s=0.4, restart_s=30.0)
    return policy.decide(**{**args, **kw})


def test_leaving_a_slow_node_is_chosen_when_the_rest_of_the_run_pays_for_the_restart():
    # Kept: 1000 steps x 0.6 s = 600 s; without b: 30 s + 1000 x (0.2 s x 4/2 ranks) = 430 s.
    d = _decide(_policy())
    assert d.evict and d.to_world == 2 and d.healthy_step_s == pytest.approx(0.2)
    assert d.after_step_s == pytest.approx(0.4) and d.gain_s == pytest.approx(170.0)
    assert "saves 170.0s" in d.reason


def test_a_slow_node_is_kept_when_too_little_of_the_run_is_left_to_pay_for_a_restart():
    # 100 steps x (0.6 - 0.4) s = 20 s saved < the 30 s restart.
    d = _decide(_policy(), remaining_steps=100)
    assert d.action == "keep" and d.gain_s == pytest.approx(-10.0) and "not worth a restart" in d.reason


def test_a_node_that_is_no_longer_slow_is_kept():
    d = _decide(_policy(), slow_step_s=0.2, wait_s=0.0)  # the recent steps: healed
    assert d.action == "keep" and d.gain_s < 0


def test_a_node_no_longer_last_to_arrive_is_kept_whatever_the_others_wait():
    # Three ranks on two cores: somebody waits every step, so the others' wait (0.4 s of a
    # 0.6 s step) is not all for b once b arrives last in only a third of the steps.
    d = _decide(_policy(), last_share=0.3, named_share=0.8)
    assert d.action == "keep" and "no longer the straggler: its ranks arrived last in 30% of the last steps" in d.reason
    assert _decide(_policy(), last_share=0.9, named_share=0.8).evict


def test_the_share_of_recent_steps_a_node_arrived_last_in():
    from rayflex.faults.detector import FaultDetector

    det = FaultDetector(3, {0: "a", 1: "a", 2: "b"})
    for step in range(1, 11):  # rank 2 last (waits least) in the first 4 steps, then rank 0 or 1 in turn
        waits = {0: 0.05, 1: 0.05, 2: 0.0} if step <= 4 else {0: 0.0, 1: 0.05, 2: 0.05} if step % 2 else \
            {0: 0.05, 1: 0.0, 2: 0.05}
        det.note_step(step, 0.1, waits)
    assert det.last_share([2]) == pytest.approx(0.4) and det.last_share([0, 1]) == pytest.approx(0.6)
    assert det.share == 0.8


def test_the_only_node_or_one_whose_loss_leaves_no_valid_size_is_kept():
    d = _decide(_policy(min_workers=4), usable_slots=2)
    assert d.action == "keep" and d.to_world is None and "min_workers=4" in d.reason
    assert _decide(_policy(), usable_slots=0).action == "keep"  # the run's only node
