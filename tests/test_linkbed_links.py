"""The link bed's plan (addresses, per-pair rates, tc rules, counters) and the bytes the cost
model's collectives put on each tier: pure, no namespace."""

import pytest

from rayflex.errors import ConfigError
from rayflex.mesh.plan import MeshPlan
from rayflex.planning.cost_model import CommProfile
from rayflex.planning.topology import Topology
from rayflex.planning.traffic import GLOO, RING, link_bytes
from rayflex.testing.linkbed.links import bytes_by_link, plan_links, scale_for, tc_commands

TWO_RACKS = Topology.from_dict({"nodes": [{"id": "n0", "slots": 2, "labels": {"rack": "r0"}},
                                          {"id": "n1", "slots": 2, "labels": {"rack": "r1"}}]})


def test_each_node_gets_an_address_and_each_pair_its_tiers_rate_times_slots_times_scale():
    plan = plan_links(TWO_RACKS, 1e-4)
    assert plan.addresses == {"n0": "127.0.1.1", "n1": "127.0.2.1"}
    assert plan.link("n0", "n1").tier_name == "same_zone"
    assert plan.link("n0", "n1").rate_bytes_s == pytest.approx(12.5e9 * 2 * 1e-4)
    assert plan.link("n1", "n1").rate_bytes_s == pytest.approx(900e9 * 2 * 1e-4)
    assert len(plan.links) == 4


def test_tc_rules_match_each_pair_by_source_and_destination():
    plan = plan_links(TWO_RACKS, 1e-4)
    text = [" ".join(c) for c in tc_commands(plan)]
    assert "tc qdisc add dev lo root handle 1: htb default 0" in text
    link = plan.link("n0", "n1")
    rule = next(t for t in text if f"flowid 1:{link.classid:x}" in t)
    assert "match ip src 127.0.1.1/32 match ip dst 127.0.2.1/32" in rule
    assert any(f"classid 1:{link.classid:x} htb rate {int(link.rate_bytes_s * 8)}bit" in t for t in text)


def test_counters_are_read_per_link_and_summed_per_tier():
    plan = plan_links(TWO_RACKS, 1e-4)
    ids = {(l.src, l.dst): l.classid for l in plan.links}
    stats = "".join(f"class htb 1:{ids[p]:x} root prio 0 rate 1Mbit ceil 1Mbit burst 18000b cburst 18000b \n"
                    f" Sent {n} bytes 7 pkt (dropped 0, overlimits 0 requeues 0) \n backlog 0b 0p requeues 0\n\n"
                    for p, n in {("n0", "n0"): 100, ("n0", "n1"): 20, ("n1", "n0"): 3, ("n1", "n1"): 5}.items())
    counted = bytes_by_link(plan, stats)
    assert counted["by_tier"] == {"same_node": 105, "same_zone": 23}
    assert counted["by_pair"]["n0->n1"] == 20


def test_a_scale_that_would_slow_a_link_below_the_shaper_is_refused_naming_the_link():
    with pytest.raises(ConfigError, match="n0 -> n1 .same_zone.*raise the scale"):
        plan_links(TWO_RACKS, 5e-7)
    with pytest.raises(ConfigError, match="scale"):
        plan_links(TWO_RACKS, 2.0)
    assert scale_for(989e8) == pytest.approx(1e-4)


def test_fsdp_bytes_land_on_the_tier_of_the_nodes_its_groups_span():
    mesh, profile = MeshPlan(pp=2, dp=2), CommProfile((4e5, 4e5), activation_bytes=8192, microbatches=4)
    packed = link_bytes(TWO_RACKS, mesh, profile, ["n0", "n0", "n1", "n1"])
    # 2 stages x 2 ranks x (one all-gather + one reduce-scatter) x half the stage's bytes
    assert packed["same_node"] == pytest.approx(2 * 2 * 2 * 0.5 * 4e5)
    assert packed["same_zone"] == pytest.approx(2 * 2 * 8192 * 4)  # 2 lanes, forward and backward
    split = link_bytes(TWO_RACKS, mesh, profile, ["n0", "n1", "n0", "n1"])
    assert split["same_zone"] == pytest.approx(packed["same_node"])  # the FSDP rings now cross the racks
    assert split["same_node"] == pytest.approx(packed["same_zone"])  # and the pipeline lanes stay home
    # gloo's reduce-scatter moves an all-reduce's bytes
    assert link_bytes(TWO_RACKS, mesh, profile, ["n0", "n0", "n1", "n1"], GLOO)["same_node"] == pytest.approx(
        2 * 2 * 3 * 0.5 * 4e5)
    assert RING.reduce_scatter == 1.0


def _trainer(placement: str, **parallel):
    import rayflex as rf
    from rayflex.models import GPTConfig, gpt

    return rf.Trainer(model=gpt(GPTConfig(vocab_size=128, seq_len=32, d_model=32, n_layers=4, n_heads=2)),
                      data=rf.DataConfig(uri="file:///nowhere", seq_len=32, global_batch=16),
                      run=rf.RunConfig(name="order", steps=2),
                      scaling=rf.ScalingConfig(num_workers=8, placement=placement),
                      parallel=rf.ParallelConfig(**parallel))


INTERLEAVED = Topology.from_dict({"nodes": [{"id": f"n{i}", "slots": 2, "labels": {"rack": f"r{i % 2}"}}
                                            for i in range(4)]})


def test_the_placement_can_be_ray_trains_node_order_or_a_seeded_shuffle_to_measure_the_planner():
    planned = _trainer("planned", pp=2).plan(INTERLEAVED)
    node_order = _trainer("node_order", pp=2).plan(INTERLEAVED)
    assert node_order.rank_to_node == ("n0", "n0", "n1", "n1", "n2", "n2", "n3", "n3")
    assert planned.modeled_comm_s < node_order.modeled_comm_s  # racks interleave in join order
    shuffled = [_trainer(f"shuffled:{seed}", pp=2, tp=2).plan(INTERLEAVED) for seed in (1, 1, 2)]
    assert shuffled[0].rank_to_node == shuffled[1].rank_to_node != shuffled[2].rank_to_node
    for plan in shuffled:  # every tp group (2 consecutive ranks) on one node
        assert all(plan.rank_to_node[r] == plan.rank_to_node[r + 1] for r in range(0, 8, 2))
        assert sorted(plan.rank_to_node) == sorted(node_order.rank_to_node)


def test_an_unknown_placement_names_the_choices():
    import rayflex as rf

    with pytest.raises(ConfigError, match="'planned'.*'node_order'.*'shuffled:SEED'"):
        rf.ScalingConfig(placement="pack")


def test_rescaling_changes_the_same_classes_to_the_new_rates():
    from rayflex.testing.linkbed.links import tc_change_commands

    slow, fast = plan_links(TWO_RACKS, 1e-4), plan_links(TWO_RACKS, 1.0)
    changes = [" ".join(c) for c in tc_change_commands(fast)]
    assert [l.classid for l in slow.links] == [l.classid for l in fast.links]
    link = fast.link("n0", "n1")
    assert f"tc class change dev lo parent 1: classid 1:{link.classid:x} htb rate {int(link.rate_bytes_s * 8)}bit" \
        in " ".join(changes)
