"""Topology-aware placement on a real 4-node loopback cluster in two racks."""

import json
import time

import pytest

import rayflex as rf
from rayflex.constants import knob

from conftest import loopback_cluster, small_gpt

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def racks():
    # Join order interleaves the racks, as a cloud autoscaler's does: naive node-order
    # placement would then split every dp group across racks. One slot per node, so a dp
    # group of two must span two nodes and the planner has to pick two in one rack.
    nodes = [{"num_cpus": 1, "labels": {"rack": r}} for r in ("r0", "r1", "r0", "r1")]
    with loopback_cluster(nodes) as c:
        yield c


def _trainer(dataset_uri, tmp_path, name, *, workers=4, pp=2, labels=None, global_batch=16):
    return rf.Trainer(model=small_gpt(n_layers=2),
                      data=rf.DataConfig(uri=dataset_uri, seq_len=32, global_batch=global_batch),
                      run=rf.RunConfig(name=name, storage=f"file://{tmp_path}/runs", steps=2),
                      scaling=rf.ScalingConfig(num_workers=workers, node_labels=labels or {}),
                      parallel=rf.ParallelConfig(pp=pp, microbatches=2),
                      checkpoint=rf.CheckpointConfig(resume=False))


def test_pp2_dp2_keeps_each_dp_group_inside_one_rack(racks, dataset_uri, tmp_path):
    import ray

    rack_of = {n["NodeID"]: n["Labels"]["rack"] for n in ray.nodes() if n["Alive"]}
    result = _trainer(dataset_uri, tmp_path, "racks").fit(progress=False)
    assert result.status == "finished"
    events = [json.loads(x) for x in (tmp_path / "runs" / "racks" / "events.jsonl").read_text().splitlines()]
    plan = next(e for e in events if e["kind"] == "plan_chosen")
    # Where the actors really ran (node ids reported from inside each actor) is the plan.
    assert plan["rank_to_node"] == plan["planned_rank_to_node"]
    for stage in range(2):
        group = plan["rank_to_node"][stage * 2:(stage + 1) * 2]
        assert len(set(group)) == 2, "one slot per node: the group spans two nodes"
        assert len({rack_of[n] for n in group}) == 1, f"dp group of stage {stage} spans racks"
    assert plan["modeled_comm_s"] <= plan["naive_comm_s"]
    assert "rack" in plan["explanation"]


@pytest.mark.parametrize("kwargs, needle", [
    ({"workers": 6, "global_batch": 24}, "need 6 worker slots"),
    ({"workers": 2, "labels": {"rack": "r9"}}, "rack='r9'"),
])
def test_infeasible_request_fails_fast_naming_what_is_missing(racks, dataset_uri, tmp_path, kwargs, needle):
    name = f"infeasible-{kwargs['workers']}"
    t0 = time.time()
    with pytest.raises(rf.PlacementError) as info:
        _trainer(dataset_uri, tmp_path, name, **kwargs).fit(progress=False)
    # Refused by the planner up front, not after waiting out the placement timeout.
    assert time.time() - t0 < knob("PLACEMENT_TIMEOUT_S")
    assert needle in str(info.value)
    kinds = [json.loads(x)["kind"] for x in (tmp_path / "runs" / name / "events.jsonl").read_text().splitlines()]
    assert "workers_started" not in kinds and kinds[-1] == "run_failed"
