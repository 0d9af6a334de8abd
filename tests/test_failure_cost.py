"""The planner prices failures: on a cluster that fails often, a mesh with replicas (live
recovery, nothing trained again) can beat a faster one that rolls back to its checkpoint."""

import pytest

from rayflex.errors import ConfigError
from rayflex.mesh.plan import MeshPlan
from rayflex.planning.capacity.failures import FailureCost, for_run
from rayflex.planning.capacity.memory import preset
from rayflex.planning.capacity.search import ClusterDescription, search

CLUSTER = "examples/clusters/h100_8x8.yaml"


def test_frequent_failures_turn_the_choice_to_a_mesh_with_replicas():
    cluster, model = ClusterDescription.from_file(CLUSTER), preset("7b")
    calm = search(model, cluster, global_batch=512, world_size=16)
    assert calm.best.layout.dp_replicate == 1 and calm.failures is None
    spot = search(model, cluster, global_batch=512, world_size=16,
                  failures=FailureCost(6, restart_s=30, rollback_steps=50))
    best = spot.best
    assert best.layout.dp_replicate >= 2, best.label()
    assert best.step_s > calm.best.step_s, "slower per step, faster once failures are counted"
    f = spot.failures
    assert f.effective_step_s(best.layout, best.step_s) < f.effective_step_s(calm.best.layout, calm.best.step_s)
    line = next(x for x in spot.explanation.splitlines() if x.startswith("Failures:"))
    assert "6 failures/h expected" in line and "50 steps trained again" in line
    assert f"Chose {best.label()}" in line and "the fastest mesh without replicas: " + calm.best.label() in line


def test_what_one_failure_costs_each_kind_of_mesh():
    hsdp, fsdp = MeshPlan(pp=1, dp=4, dp_replicate=2), MeshPlan(pp=1, dp=4)
    f = FailureCost(2, restart_s=20, rollback_steps=10, rollback_s=5)
    assert f.lost_s(hsdp, 1.0) == 20 and f.lost_s(fsdp, 1.0) == 20 + 10 + 5
    assert f.effective_step_s(fsdp, 1.0) == pytest.approx(1 / (1 - 2 / 3600 * 35))
    assert FailureCost(10_000, rollback_s=3600).lost_fraction(fsdp, 1.0) == 0.95, "capped: a ratio, never infinite"
    with pytest.raises(ConfigError, match="FailureCost.failures_per_hour"):
        FailureCost(-1)


def test_a_runs_checkpoint_config_sets_what_a_failure_rolls_back():
    assert for_run(None, 100) is None
    assert for_run(4, 100).rollback_steps == 50
    auto = for_run(4, "auto", save_cost_s=2.0)  # interval ~ sqrt(2 x 2 s x 900 s) = 60 s: half of it lost
    assert auto.rollback_steps == 0 and auto.rollback_s == pytest.approx(30.0)
    assert for_run(4, 0).rollback_s == 450.0, "no periodic checkpoint: half the time between failures"


def test_rayflex_plan_prices_failures_when_asked(capsys):
    from rayflex.cli.main import main

    base = ["plan", "--model", "7b", "--cluster", CLUSTER, "--world-size", "16", "--global-batch", "512"]
    assert main(base) == 0
    calm = capsys.readouterr().out
    assert main(base + ["--failures-per-hour", "6", "--checkpoint-every", "100"]) == 0
    spot = capsys.readouterr().out
    assert "Failures:" not in calm and "Failures: 6 failures/h expected" in spot
    assert "dp_replicate=1" not in calm.split("choice:")[1].splitlines()[0]
    assert "HSDP" in spot.split("choice:")[1].splitlines()[0], "the choice moved to a mesh with replicas"
    assert main(base + ["--checkpoint-every", "100"]) == 2, "an interval alone prices nothing: refused, said why"
    assert "add --failures-per-hour" in capsys.readouterr().err


def test_the_config_takes_a_failure_rate_or_none():
    import rayflex as rf

    assert rf.ElasticConfig(failures_per_hour=2).failures_per_hour == 2
    with pytest.raises(ConfigError, match="ElasticConfig.failures_per_hour"):
        rf.ElasticConfig(failures_per_hour=-1)
