"""Topology: labels, link tiers, bandwidths, described topologies and the Ray snapshot."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from rayflex.errors import ConfigError
from rayflex.planning.topology import Bandwidths, LinkTier, NodeInfo, Topology

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "topologies"


def test_labels_follow_ray_conventions_with_user_fallbacks():
    ray_labelled = NodeInfo("a", labels={"ray.io/availability-zone": "us-east-1a",
                                         "ray.io/gpu-domain": "nvl72-0", "ray.io/market-type": "spot"})
    got = (ray_labelled.zone, ray_labelled.rack, ray_labelled.market_type)
    assert got == ("us-east-1a", "nvl72-0", "spot")
    user = NodeInfo("b", labels={"zone": "z1", "rack": "r7", "ray.io/gpu-domain": "ignored"})
    assert (user.zone, user.rack, user.market_type) == ("z1", "r7", None)
    bare = NodeInfo("c")
    assert (bare.zone, bare.rack, bare.market_type) == (None, None, None)


def test_link_tiers_order_from_node_to_cross_zone():
    t = Topology((
        NodeInfo("a", labels={"zone": "z0", "rack": "r0"}),
        NodeInfo("b", labels={"zone": "z0", "rack": "r0"}),
        NodeInfo("c", labels={"zone": "z0", "rack": "r1"}),
        NodeInfo("d", labels={"zone": "z1", "rack": "r0"}),  # same rack name, other zone
    ))
    assert t.tier("a", "a") is LinkTier.SAME_NODE
    assert t.tier("a", "b") is LinkTier.SAME_DOMAIN
    assert t.tier("a", "c") is LinkTier.SAME_ZONE
    assert t.tier("a", "d") is LinkTier.CROSS_ZONE
    assert LinkTier.SAME_NODE < LinkTier.SAME_DOMAIN < LinkTier.SAME_ZONE < LinkTier.CROSS_ZONE


def test_missing_labels_mean_one_zone_and_no_shared_fabric():
    t = Topology((NodeInfo("a"), NodeInfo("b"), NodeInfo("c", labels={"rack": "r0"}),
                  NodeInfo("d", labels={"rack": "r0"})))
    assert t.tier("a", "b") is LinkTier.SAME_ZONE  # nobody said they share InfiniBand
    assert t.tier("c", "d") is LinkTier.SAME_DOMAIN
    assert t.tier("a", "c") is LinkTier.SAME_ZONE


def test_bandwidths_default_to_public_figures_and_can_be_overridden():
    bw = Bandwidths()
    assert [bw.of(t) for t in LinkTier] == [900e9, 50e9, 12.5e9, 2e9]
    assert Bandwidths.from_gbps({"same_zone": 200}).same_zone == 25e9
    with pytest.raises(ConfigError, match="same_domain"):
        Bandwidths(same_domain=0)
    with pytest.raises(ConfigError, match="order"):
        Bandwidths(same_zone=100e9)
    with pytest.raises(ConfigError, match="unknown tier"):
        Bandwidths.from_gbps({"nvlink": 1})


def test_usable_drops_dead_and_draining_nodes_and_counts_slots():
    t = Topology((NodeInfo("a", slots=8), NodeInfo("b", slots=8, alive=False),
                  NodeInfo("c", slots=4, draining=True), NodeInfo("d", slots=2)))
    assert t.total_slots == 22
    assert [n.node_id for n in t.usable().nodes] == ["a", "d"]
    assert t.usable().total_slots == 10


def test_from_dict_reads_nodes_labels_and_bandwidth_overrides():
    t = Topology.from_dict({
        "nodes": [{"id": "n0", "slots": 8, "labels": {"rack": "r0", "ray.io/availability-zone": "z"}},
                  {"id": "n1", "slots": 4, "draining": True}],
        "bandwidth_gbps": {"cross_zone": 8},
    })
    assert [(n.node_id, n.slots, n.rack, n.zone, n.draining) for n in t.nodes] == [
        ("n0", 8, "r0", "z", False), ("n1", 4, None, None, True)]
    assert t.bandwidths.cross_zone == 1e9
    assert Topology.from_dict(t.to_dict()) == t


@pytest.mark.parametrize("spec, field", [
    ({"nodes": [{"slots": 8}]}, "topology.nodes[0].id"),
    ({"nodes": [{"id": "a", "slots": -1}]}, "topology.nodes[0].slots"),
    ({"nodes": [{"id": "a", "slots": 1}, {"id": "a", "slots": 1}]}, "Topology.nodes"),
    ({"hosts": []}, "topology"),
])
def test_bad_descriptions_name_the_field(spec, field):
    with pytest.raises(ConfigError) as err:
        Topology.from_dict(spec)
    assert err.value.field == field


def test_from_file_reads_yaml_and_json(tmp_path):
    spec = {"nodes": [{"id": "a", "slots": 2, "labels": {"rack": "r0"}}]}
    (tmp_path / "t.json").write_text(json.dumps(spec))
    (tmp_path / "t.yaml").write_text("nodes:\n  - id: a\n    slots: 2\n    labels: {rack: r0}\n")
    assert Topology.from_file(tmp_path / "t.json") == Topology.from_file(tmp_path / "t.yaml")


def test_example_topologies_load():
    files = sorted(EXAMPLES.glob("*.yaml"))
    assert files, "examples/topologies/*.yaml missing"
    for path in files:
        t = Topology.from_file(path)
        assert t.usable().total_slots > 0, path


def _fake_ray(monkeypatch, nodes, draining=None):
    """Stand-in ``ray`` module: ``nodes()`` and, optionally, the private draining API."""
    ray = types.ModuleType("ray")
    ray.nodes = lambda: nodes
    monkeypatch.setitem(sys.modules, "ray", ray)
    private = types.ModuleType("ray._private")
    state_mod = types.ModuleType("ray._private.state")
    if draining is not None:
        state_mod.state = types.SimpleNamespace(get_draining_nodes=lambda: draining)
    monkeypatch.setitem(sys.modules, "ray._private", private)
    monkeypatch.setitem(sys.modules, "ray._private.state", state_mod)


RAY_NODES = [
    {"NodeID": "aa", "Alive": True, "NodeManagerAddress": "10.0.0.1",
     "Resources": {"CPU": 16.0, "GPU": 8.0}, "Labels": {"ray.io/node-id": "aa", "rack": "r0"}},
    {"NodeID": "bb", "Alive": True, "NodeManagerAddress": "10.0.0.2",
     "Resources": {"CPU": 7.0}, "Labels": {}},
    {"NodeID": "cc", "Alive": False, "NodeManagerAddress": "10.0.0.3",
     "Resources": {"CPU": 4.0}, "Labels": None},
]


def test_from_ray_turns_resources_into_slots_and_reads_draining(monkeypatch):
    _fake_ray(monkeypatch, RAY_NODES, draining={"bb": 1_700_000_000_000})
    t = Topology.from_ray(cpus_per_worker=2)
    assert [(n.node_id, n.slots, n.alive, n.draining, n.rack) for n in t.nodes] == [
        ("aa", 8, True, False, "r0"), ("bb", 3, True, True, None), ("cc", 2, False, False, None)]
    gpu = Topology.from_ray(use_gpu=True, gpus_per_worker=2)
    assert [n.slots for n in gpu.nodes] == [4, 0, 0]


def test_from_ray_survives_a_missing_draining_api(monkeypatch):
    _fake_ray(monkeypatch, RAY_NODES)  # ray._private.state has no ``state``
    assert not any(n.draining for n in Topology.from_ray().nodes)
