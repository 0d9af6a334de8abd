"""The run's placement-group reservation on a real two-node Ray cluster: every actor lands
on its planned node.

Both "nodes" run on this machine and share 127.0.0.1, so only a node-id label selector can
tell them apart; this is the one test that needs Ray.
"""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import pytest  # noqa: E402

import rayflex as rf  # noqa: E402
from rayflex.errors import PlacementError  # noqa: E402
from rayflex.group.reservation import RunPlacement  # noqa: E402
from rayflex.mesh.plan import MeshPlan  # noqa: E402
from rayflex.planning.placement.planner import CommProfile, Plan, Planner  # noqa: E402
from rayflex.planning.topology import Topology  # noqa: E402

from conftest import small_gpt  # noqa: E402


def _spec(num_workers: int) -> rf.TrainSpec:
    """A run asking for ``num_workers`` one-CPU workers (nothing here starts training)."""
    return rf.TrainSpec(model=small_gpt(), data=rf.DataConfig(uri="file:///nonexistent/rayflex-placement",
                                                               global_batch=8),
                        run=rf.RunConfig(name="placement", storage="file:///tmp/rayflex-test"),
                        scaling=rf.ScalingConfig(num_workers=num_workers, cpus_per_worker=1))


@pytest.mark.cluster
def test_actors_run_on_their_planned_nodes(two_node_cluster, monkeypatch):
    import ray

    topology = Topology.from_ray(cpus_per_worker=1)
    # Alive nodes: the shared cluster may remember one an earlier test removed (and replaced).
    assert sorted(n.rack for n in topology.nodes if n.alive) == ["r0", "r1"]
    mesh = MeshPlan(pp=2, dp=2)
    plan = Planner(topology).plan(mesh, CommProfile.uniform(2, 4e9, 16e6, 4))
    # each FSDP group inside one node (one "rack" each)
    assert plan.rank_to_node[0] == plan.rank_to_node[1] != plan.rank_to_node[2] == plan.rank_to_node[3]

    @ray.remote(num_cpus=1)
    class Probe:
        def node_id(self):
            return ray.get_runtime_context().get_node_id()

    # the plan as made, and with its two nodes swapped: both must be honoured exactly
    a, b = plan.rank_to_node[0], plan.rank_to_node[2]
    swapped = dataclasses.replace(plan, rank_to_node=tuple(b if n == a else a for n in plan.rank_to_node))
    for wanted in (plan, swapped):
        placement = RunPlacement(_spec(mesh.world_size))
        probes = []
        try:
            strategies, extra = placement.assign(wanted, survivors={})
            assert extra == []
            probes = [Probe.options(scheduling_strategy=s).remote() for s in strategies]
            assert ray.get([p.node_id.remote() for p in probes], timeout=60) == list(wanted.rank_to_node)
        finally:
            for p in probes:
                ray.kill(p)
            placement.remove()

    # a plan naming a node that does not exist times out, cleans up and says which node
    monkeypatch.setenv("RAYFLEX_PLACEMENT_TIMEOUT_S", "2")
    ghost = "f" * 56
    bogus = Plan(mesh=MeshPlan(1, 1), rank_to_node=(ghost,), rank_to_slot=(0,), modeled_comm_s=0.0,
                 naive_comm_s=0.0, explanation="")
    stuck = RunPlacement(_spec(1))
    try:
        with pytest.raises(PlacementError, match=f"on node {ghost}"):
            stuck.assign(bogus, survivors={})
    finally:
        stuck.remove()
    from ray.util import placement_group_table

    assert all(pg["state"] == "REMOVED" for pg in placement_group_table().values())


@pytest.mark.cluster
def test_loopback_cluster_takes_no_fixed_default_port(two_node_cluster):
    """Ray's head would put its dashboard agent on 52365 and let the GCS draw any port,
    52365 included (then Ray refuses to start); rayflex pins both to free non-defaults."""
    from rayflex.local_ray import RAY_DEFAULT_PORTS

    head = two_node_cluster.head_node
    gcs_port = int(head.gcs_address.rsplit(":", 1)[1])
    agent_port = head.dashboard_agent_listen_port
    assert gcs_port != agent_port
    assert not {gcs_port, agent_port} & RAY_DEFAULT_PORTS
