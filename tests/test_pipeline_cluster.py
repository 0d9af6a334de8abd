"""Pipeline meshes on Ray actors compute what one process computes; 1F1B holds fewer
activations than GPipe."""

import json

import pytest

import rayflex as rf
from rayflex.testing.reference import single_process_losses

from conftest import small_gpt

pytestmark = pytest.mark.cluster


def _fit(dataset_uri, tmp_path, name, *, workers, parallel, global_batch=8, steps=3, n_layers=2):
    trainer = rf.Trainer(model=small_gpt(n_layers), data=rf.DataConfig(uri=dataset_uri, seq_len=32,
                                                                         global_batch=global_batch),
                         run=rf.RunConfig(name=name, storage=f"file://{tmp_path}/runs", steps=steps,
                                          optimizer=rf.OptimizerConfig(lr=1e-2)),
                         scaling=rf.ScalingConfig(num_workers=workers), parallel=parallel,
                         checkpoint=rf.CheckpointConfig(resume=False))
    result = trainer.fit(progress=False)
    assert result.status == "finished"
    events = [json.loads(x) for x in (tmp_path / "runs" / name / "events.jsonl").read_text().splitlines()]
    return trainer, result, events


def _assert_matches_single_process(trainer, result, steps=3):
    reference = single_process_losses(trainer.spec, steps)
    got = [m["loss"] for m in result.metrics[:steps]]
    assert got == pytest.approx(reference, rel=1e-5), (got, reference)


@pytest.fixture(scope="module")
def schedule_runs(two_node_cluster, dataset_uri, tmp_path_factory):
    """GPipe and 1F1B at pp=2 with microbatches = 4 x pp (dp=1: two processes each; pp=2
    x dp=2 trains in tests/test_checkpoint_cluster.py and matches one process there too)."""
    runs = {}
    for schedule in ("gpipe", "1f1b"):
        tmp = tmp_path_factory.mktemp(schedule)
        runs[schedule] = (_fit(dataset_uri, tmp, f"pp2-{schedule}", workers=2, global_batch=16,
                               parallel=rf.ParallelConfig(pp=2, schedule=schedule, microbatches=8),
                               n_layers=4))
    return runs


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pp2_matches_single_process(schedule_runs, schedule):
    trainer, result, events = schedule_runs[schedule]
    _assert_matches_single_process(trainer, result)
    plan = next(e for e in events if e["kind"] == "plan_chosen")
    assert (plan["pp"], plan["dp"], plan["schedule"], plan["microbatches"]) == (2, 1, schedule, 8)
    # The split is recorded and balanced by parameter count, covering every block once.
    assert sorted(i for stage in plan["stage_blocks"] for i in stage) == list(range(6))
    assert plan["balance"] == "params" and len(plan["stage_costs"]) == 2


def test_1f1b_holds_fewer_activations_on_stage0_than_gpipe(schedule_runs, capsys):
    peak = {s: max(m["activation_peak_bytes"][0] for m in schedule_runs[s][1].metrics) for s in schedule_runs}
    with capsys.disabled():
        print(f"\nstage-0 peak activation bytes, pp=2 m=8: gpipe={peak['gpipe']} 1f1b={peak['1f1b']}")
    assert 0 < peak["1f1b"] < peak["gpipe"]
    # GPipe keeps all 8 microbatches alive, 1F1B at most pp=2 on stage 0: expect a clear gap.
    assert peak["1f1b"] <= 0.6 * peak["gpipe"]


def test_interleaved_pp2_dp1_two_stages_per_rank(two_node_cluster, dataset_uri, tmp_path):
    trainer, result, events = _fit(dataset_uri, tmp_path, "interleaved", workers=2,
                                   parallel=rf.ParallelConfig(pp=2, schedule="interleaved", stages_per_rank=2))
    _assert_matches_single_process(trainer, result)
    plan = next(e for e in events if e["kind"] == "plan_chosen")
    assert len(plan["stage_blocks"]) == 4 and plan["microbatches"] == 4


def test_auto_parallel_runs_the_planners_choice(two_node_cluster, dataset_uri, tmp_path):
    """pp="auto": at launch the controller asks the capacity planner for the fastest mesh
    that fits the live cluster, runs exactly that mesh, and says why in plan_chosen."""
    from rayflex.planning.capacity.auto import resolve_parallel
    from rayflex.planning.topology import Topology

    trainer, result, events = _fit(dataset_uri, tmp_path, "auto", workers=2, global_batch=16,
                                   parallel=rf.ParallelConfig(pp="auto"), n_layers=4)
    _assert_matches_single_process(trainer, result)
    plan = next(e for e in events if e["kind"] == "plan_chosen")
    spec = trainer.spec
    expected = resolve_parallel(spec, 2, Topology.from_ray(cpus_per_worker=spec.scaling.cpus_per_worker,
                                                           use_gpu=False))
    assert (plan["pp"], plan["dp"], plan["schedule"]) == (expected.parallel.pp, 2 // expected.parallel.pp,
                                                          expected.parallel.schedule)
    first_line = expected.explanation.strip().splitlines()[0]
    assert first_line and first_line in plan["explanation"], plan["explanation"]
