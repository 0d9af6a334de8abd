"""every_steps="auto": the Young/Daly interval from the run's measured save cost and the
failures it has seen, chosen by the controller, which asks the workers for the saves."""

import math

import pytest

from rayflex.faults.checkpoint_interval import CheckpointIntervalPolicy, daly_interval_s


def test_daly_is_young_with_corrections_and_never_past_the_mtbf():
    young = math.sqrt(2 * 10 * 3600)
    assert daly_interval_s(10, 3600) == pytest.approx(young * (1 + math.sqrt(10 / 7200) / 3 + 10 / 7200 / 9) - 10)
    assert abs(daly_interval_s(10, 3600) - young) < 0.05 * young, "a cheap save: Young's sqrt(2CM)"
    assert daly_interval_s(100, 40) == 40, "a save costing more than two MTBFs: once per MTBF"


def _choose(policy, **kw):
    args = dict(save_costs_s=[], save_total_s=[], step_time_s=1.0, elapsed_s=0.0, faults=0)
    return policy.choose(**{**args, **kw})


def test_the_interval_follows_the_measured_cost_and_the_failures_seen():
    policy = CheckpointIntervalPolicy(mtbf_prior_s=3600, cost_prior_s=5.0, max_steps=100_000)
    prior = _choose(policy)
    assert not prior.measured and prior.cost_s == 5.0 and prior.steps == round(daly_interval_s(5, 3600))
    cheap = _choose(policy, save_costs_s=[0.5, 0.4, 0.6])
    assert cheap.measured and cheap.cost_s == 0.5 and cheap.steps < prior.steps, "measured saves are cheaper"
    # Hours without a failure stretch the interval; failures shorten it.
    quiet = _choose(policy, save_costs_s=[0.5], elapsed_s=4 * 3600)
    stormy = _choose(policy, save_costs_s=[0.5], elapsed_s=4 * 3600, faults=9)
    assert quiet.mtbf_s == 5 * 3600 and stormy.mtbf_s == 5 * 3600 / 10
    assert stormy.steps < cheap.steps < quiet.steps


def test_an_upload_never_queues_behind_the_last_and_the_run_length_caps_it():
    policy = CheckpointIntervalPolicy(mtbf_prior_s=10, cost_prior_s=5.0, max_steps=50)
    slow_upload = _choose(policy, save_costs_s=[0.01], save_total_s=[30.0], step_time_s=0.5)
    assert slow_upload.steps == 50 or slow_upload.steps >= 60, slow_upload
    policy = CheckpointIntervalPolicy(mtbf_prior_s=10, cost_prior_s=5.0, max_steps=1000)
    assert _choose(policy, save_costs_s=[0.01], save_total_s=[30.0], step_time_s=0.5).steps == 60
    assert _choose(policy, save_costs_s=[0.01], step_time_s=100.0).steps == 1, "at least every step"
