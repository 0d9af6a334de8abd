"""The exposed-communication step model (rayflex.planning.step_model): pure, no cluster."""

import pytest

from rayflex.mesh.plan import MeshPlan
from rayflex.planning.cost_model import CommProfile, CostBreakdown
from rayflex.planning.step_model import (exposed_comm, hidden_reduction, pipeline_p2p, pipeline_reduction,
                                         step_seconds)


def breakdown(fsdp=(0.0,), p2p=(), replica=None, tp=()):
    return CostBreakdown(total=sum(fsdp) + sum(p2p) + sum(replica or ()), fsdp_s=tuple(fsdp), p2p_s=tuple(p2p),
                         row_levels=(0,) * len(fsdp), boundary_levels=(0,) * len(p2p),
                         replica_s=tuple(replica or (0.0,) * len(fsdp)), tp_s=tuple(tp))


def test_a_transfer_shorter_than_a_microbatch_exposes_only_fill_and_drain():
    # 4 stages, 8 microbatches, 10 ms of compute per microbatch, 2 ms per crossing
    assert pipeline_p2p([0.002] * 3, microbatch_s=0.010, microbatches=8) == pytest.approx(2 * 3 * 0.002)


def test_a_transfer_longer_than_a_microbatch_runs_the_pipeline_at_the_links_pace():
    fill_drain = 2 * (0.001 + 0.030 + 0.001)
    assert pipeline_p2p([0.001, 0.030, 0.001], microbatch_s=0.010, microbatches=8) == pytest.approx(
        fill_drain + 7 * (0.030 - 0.010))


def test_an_allreduce_shorter_than_the_backward_hides_all_but_the_last_units_share():
    assert hidden_reduction(0.060, backward_s=1.0, units=6) == pytest.approx(0.010)


def test_an_allreduce_longer_than_the_backward_exposes_what_does_not_fit():
    assert hidden_reduction(1.0, backward_s=0.6, units=6) == pytest.approx(1.0 - 0.6 * 5 / 6)
    assert hidden_reduction(0.5, backward_s=0.6, units=1) == pytest.approx(0.5)  # one unit: nothing to hide behind


def test_pipeline_reductions_run_concurrently_and_later_stages_start_early():
    # stage 1 ends its last backward one backward (2/3 of 30 ms) + one transfer before stage 0
    assert pipeline_reduction([0.010, 0.040], [0.005], microbatch_s=0.030) == pytest.approx(0.040 - 0.020 - 0.005)
    assert pipeline_reduction([0.010, 0.010], [0.005], microbatch_s=0.030) == pytest.approx(0.010)


def test_without_a_pipeline_gathers_and_the_shard_groups_reduce_scatter_stay_charged_in_full():
    mesh, profile = MeshPlan(1, 4), CommProfile((1e6,), 0.0, reshard_after_forward=True)
    out = exposed_comm(mesh, profile, breakdown(fsdp=(0.3,)), compute_s=0.1, units=6)
    assert (out.all_gather_s, out.reduction_s, out.p2p_s) == pytest.approx((0.2, 0.1, 0.0))


def test_a_pipeline_charges_each_stages_gather_and_a_fraction_of_its_sends():
    mesh, profile = MeshPlan(2, 2), CommProfile((1e6, 1e6), 1e3, microbatches=4)
    full = breakdown(fsdp=(0.02, 0.02), p2p=(0.016,))  # 2 A M / bw: 2 ms per crossing
    out = exposed_comm(mesh, profile, full, compute_s=0.1)  # 20 ms per microbatch slot
    assert out.all_gather_s == pytest.approx(0.02)
    assert out.p2p_s == pytest.approx(2 * 0.002)
    assert out.reduction_s == pytest.approx(0.01)  # stage 0's reduce-scatter; stage 1's hid in stage 0's backward
    assert out.total < full.total


@pytest.mark.parametrize("layout", ["ddp", "hsdp", "pp"])
def test_the_step_never_gets_faster_on_slower_links(layout):
    if layout == "pp":
        mesh, profile = MeshPlan(4, 1), CommProfile((1e6,) * 4, 1e4, microbatches=4)
    else:
        mesh = MeshPlan(1, 4, dp_replicate=4 if layout == "ddp" else 2)
        profile = CommProfile((1e6,), 0.0, reshard_after_forward=True)
    steps = []
    for slow in (1, 2, 4, 8, 16, 64, 256):  # bandwidth divided by `slow`: every term's seconds times it
        if layout == "pp":
            b = breakdown(fsdp=(0.0,) * 4, p2p=(0.001 * slow, 0.004 * slow, 0.001 * slow))
        else:
            b = breakdown(fsdp=(0.01 * slow if layout == "hsdp" else 0.0,), replica=(0.02 * slow,))
        steps.append(step_seconds(mesh, profile, b, compute_s=0.1, units=6))
    assert steps == sorted(steps) and steps[-1] > steps[0]
