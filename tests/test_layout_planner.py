"""The planners choose a pp x dp x tp layout (and HSDP shard groups) from the topology.

Pure Python: described clusters, no Ray, no torch processes.
"""

from __future__ import annotations

import itertools
import os
import random

import pytest

import rayflex as rf
from rayflex.errors import PlacementError
from rayflex.mesh.plan import MeshPlan, plan_mesh
from rayflex.planning.capacity.auto import resolve_parallel
from rayflex.planning.capacity.memory import estimate_memory, preset, schedule_peak, schedule_peak_linear
from rayflex.planning.capacity.search import ClusterDescription, DeviceSpec, group_tiers, search
from rayflex.planning.comm_profile import comm_profile, plan_for
from rayflex.planning.placement.planner import CommProfile, Planner, brute_force_plan, naive_plan
from rayflex.planning.topology import LinkTier, NodeInfo, Topology

from test_placement_planner import random_nodes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H100_8X8 = os.path.join(ROOT, "examples", "clusters", "h100_8x8.yaml")


def _racks(nodes, slots, per_rack):
    return Topology(tuple(NodeInfo(f"n{i:03d}", slots=slots, labels={"rack": f"r{i // per_rack}"})
                          for i in range(nodes)))


def _small_case(rng, tp, hsdp):
    """A small random cluster whose nodes hold whole tp groups, and a mesh that fits it."""
    while True:
        zones, racks = rng.choice([1, 1, 2]), rng.randint(1, 3)
        nodes, total = random_nodes(rng, slot_choices=[tp * k for k in (1, 1, 2, 2, 3, 4)],
                                    max_slots=8 if hsdp else 12, zones=zones, racks=racks)
        units = total // tp
        shapes = [(p, d, r) for p in range(1, units + 1) for d in range(1, units // p + 1)
                  for r in ([x for x in range(2, d + 1) if d % x == 0] if hsdp else [1])]
        if shapes:
            break
    pp, dp, reps = rng.choice(shapes)
    params = tuple(10 ** rng.uniform(8, 10) for _ in range(pp))
    tp_bytes = tuple(10 ** rng.uniform(8, 11) for _ in range(pp)) if tp > 1 else ()
    profile = CommProfile(params, 10 ** rng.uniform(3, 12), rng.randint(1, 16), rng.random() < 0.3, tp_bytes)
    return Topology(tuple(nodes)), MeshPlan(pp, dp, tp, reps), profile


def _assert_tp_groups_whole(plan):
    tp = plan.mesh.tp
    for u in range(plan.mesh.world_size // tp):
        assert len(set(plan.rank_to_node[u * tp:(u + 1) * tp])) == 1, plan.format(ranks=True)


# ------------------------------------------------------------------------------ rank layout
def test_the_rank_order_is_row_major_over_the_mesh_dims_with_tp_innermost():
    for pp, reps, shard, tp in itertools.product((1, 2, 3), (1, 2), (1, 3), (1, 2, 4)):
        mesh = MeshPlan(pp, reps * shard, tp, reps)
        assert mesh.world_size == pp * reps * shard * tp and mesh.dp_shard == shard
        # what init_device_mesh(shape, MESH_DIMS) numbers: the last dim varies fastest
        order = itertools.product(range(pp), range(reps), range(shard), range(tp))
        for rank, (p, r, s, t) in enumerate(order):
            c = mesh.mesh_coords(rank)
            assert (c.pp, c.dp_replicate, c.dp_shard, c.tp) == (p, r, s, t)
            assert mesh.coords(rank) == (p, r * shard + s) == (c.pp, c.dp)
            assert mesh.rank_of(c.pp, c.dp, c.tp) == rank
    assert MeshPlan(2, 3) == MeshPlan(pp=2, dp=3, tp=1, dp_replicate=1)  # the 2-D mesh as before
    with pytest.raises(rf.ConfigError, match="dp_replicate=4 does not divide dp=6"):
        MeshPlan(1, 6, dp_replicate=4)
    with pytest.raises(rf.ConfigError, match="MeshPlan.tp.*must be an integer >= 1"):
        MeshPlan(1, 2, tp=0)


# ------------------------------------------------------------------------------ placement
def test_tp_groups_always_land_on_one_node_and_the_unit_reduction_is_exact():
    rng = random.Random(19)
    for case in range(120):
        tp = rng.choice([2, 3, 4])
        topology, mesh, profile = _small_case(rng, tp, hsdp=False)
        plan = Planner(topology, time_budget_s=60).plan(mesh, profile)
        _assert_tp_groups_whole(plan)
        best = brute_force_plan(topology, mesh, profile)
        where = f"case {case}: {mesh}, nodes {[(n.slots, dict(n.labels)) for n in topology.nodes]}"
        assert plan.optimal and plan.modeled_comm_s == pytest.approx(best.modeled_comm_s, rel=1e-9, abs=1e-15), where
        # TP is priced at the tp group's link: on one node, the NVLink constant
        assert plan.tp_s == pytest.approx(max(2 * (tp - 1) / tp * b / 900e9 for b in profile.tp_allreduce_bytes))


def test_tp_groups_stay_whole_on_nodes_of_uneven_size():
    # 12- and 4-slot nodes in two racks; tp=4: 3 + 1 groups per pair of nodes
    nodes = [NodeInfo(f"n{i}", slots=12 if i % 2 else 4, labels={"rack": f"r{i // 4}"}) for i in range(8)]
    mesh = MeshPlan(pp=2, dp=4, tp=4)
    plan = Planner(Topology(tuple(nodes))).plan(mesh, CommProfile.uniform(2, 8e9, 1e8, 8, tp_allreduce_bytes=1e11))
    _assert_tp_groups_whole(plan)
    assert "each on one node: SAME_NODE" in plan.explanation


@pytest.mark.parametrize("nodes, slots, mesh, words", [
    (4, 8, MeshPlan(1, 1, 16), ["tp=16 needs 16 slots on one node", "largest usable node has 8 slots",
                                 "Fix: use a tp dividing the node size (at most 8)"]),
    # 16 ranks fit 18 slots, but 6-slot nodes hold one tp group of 4 each: 3 of the 4 needed
    (3, 6, MeshPlan(1, 4, 4), ["need 4 tensor-parallel groups of tp=4", "hold only 3 whole groups",
                                "Fix: use a tp dividing the node size"]),
])
def test_a_tp_the_nodes_cannot_hold_is_refused_with_the_fix(nodes, slots, mesh, words):
    topology = Topology(tuple(NodeInfo(f"n{i}", slots=slots) for i in range(nodes)))
    with pytest.raises(PlacementError) as err:
        Planner(topology).plan(mesh, CommProfile.uniform(1, 1e9, 0))
    for word in words:
        assert word in str(err.value), str(err.value)


def test_hsdp_plans_are_priced_truthfully_and_nearly_always_optimal():
    rng = random.Random(23)
    matched = cases = 0
    for case in range(120):
        topology, mesh, profile = _small_case(rng, rng.choice([1, 2]), hsdp=True)
        plan = Planner(topology, time_budget_s=60).plan(mesh, profile)
        best = brute_force_plan(topology, mesh, profile)
        where = f"case {case}: {mesh}, nodes {[(n.slots, dict(n.labels)) for n in topology.nodes]}"
        _assert_tp_groups_whole(plan)
        # the bound is a bound, the plan is what evaluate says, and "optimal" is never claimed wrongly
        assert plan.lower_bound_s <= best.modeled_comm_s * (1 + 1e-9) + 1e-15, where
        assert plan.modeled_comm_s >= best.modeled_comm_s * (1 - 1e-9) - 1e-15, where
        if plan.optimal:
            assert plan.modeled_comm_s == pytest.approx(best.modeled_comm_s, rel=1e-9, abs=1e-15), where
        cases += 1
        matched += plan.modeled_comm_s <= best.modeled_comm_s * (1 + 1e-9) + 1e-15
    assert matched >= 0.95 * cases


def test_hsdp_keeps_shard_groups_in_a_rack_when_the_dp_group_spans_racks():
    # 2 racks x 4 nodes x 8; dp=8 tp groups of 8: one stage's dp group needs both racks
    topology = _racks(8, 8, 4)
    profile = CommProfile.uniform(1, 14e9 / 8, 0, 1, True, tp_allreduce_bytes=5e10)
    plain = Planner(topology).plan(MeshPlan(1, 8, 8), profile)
    hsdp = Planner(topology).plan(MeshPlan(1, 8, 8, dp_replicate=2), profile)
    assert plain.optimal and hsdp.optimal
    for r in range(2):  # each shard group (4 consecutive tp groups) on one rack
        ranks = range(r * 32, (r + 1) * 32)
        assert len({topology.node(hsdp.rank_to_node[k]).rack for k in ranks}) == 1, hsdp.format(ranks=True)
    assert hsdp.modeled_comm_s < 0.5 * plain.modeled_comm_s
    assert "shard groups SAME_DOMAIN" in hsdp.explanation and "replicate groups SAME_ZONE" in hsdp.explanation
    assert "plain FSDP over these ranks would ring all 8 at SAME_ZONE" in hsdp.explanation


def test_the_search_picks_hsdp_for_the_modeled_reason():
    cluster = ClusterDescription.uniform(nodes=8, devices_per_node=8, device=DeviceSpec.h100_80gb(),
                                         nodes_per_rack=4)
    result = search(preset("7b"), cluster, global_batch=128, tp=[8])
    best = result.best.layout
    assert best.dp_replicate > 1 and best.dp_shard == 4  # a rack's worth of tp groups per shard group
    same = (best.pp, best.micro_batch, best.schedule)
    plain = next(c for c in result.candidates
                 if c.layout.dp_replicate == 1 and (c.layout.pp, c.layout.micro_batch, c.layout.schedule) == same)
    # the reason, as the model states it: plain FSDP's ring crosses racks, HSDP's shard rings do not
    assert group_tiers(plain.comm)["fsdp_shard"] == LinkTier.SAME_ZONE.name
    assert group_tiers(result.best.comm)["fsdp_shard"] == LinkTier.SAME_DOMAIN.name
    assert result.best.comm_s < plain.comm_s and result.best.step_s < plain.step_s
    assert "plain FSDP over dp=8 (shard groups SAME_ZONE)" in result.to_dict()["explanation"]


def test_naive_placement_pays_for_a_split_tp_group():
    # 6-slot nodes, tp=4: Ray's slot order puts ranks 4-7 on two nodes
    topology = Topology(tuple(NodeInfo(f"n{i}", slots=6, labels={"rack": "r"}) for i in range(4)))
    mesh, profile = MeshPlan(1, 4, 4), CommProfile.uniform(1, 1e9, 0, 1, True, tp_allreduce_bytes=1e11)
    naive = naive_plan(topology, mesh, profile)
    plan = Planner(topology).plan(mesh, profile)
    assert naive.tp_s == pytest.approx(2 * 3 / 4 * 1e11 / 50e9) and plan.tp_s == pytest.approx(2 * 3 / 4 * 1e11 / 900e9)
    _assert_tp_groups_whole(plan)


# ------------------------------------------------------------------------------ memory and search
def test_memory_model_splits_blocks_over_tp_and_shards_over_dp_shard():
    model = preset("70b")
    base = dict(schedule="1f1b", microbatches=16, micro_batch=1)
    one, four = (estimate_memory(model, MeshPlan(4, 4, t, **base)).ranks[1] for t in (1, 4))
    assert four.params_sharded == pytest.approx(one.params_sharded / 4, rel=0.01)
    # the residual stream and norms stay whole on every tp rank: activations shrink, but less than 4x
    assert one.activations / 4 < four.activations < one.activations / 2
    hsdp = estimate_memory(model, MeshPlan(4, 4, 4, dp_replicate=2, **base)).ranks[1]
    assert hsdp.params_sharded == pytest.approx(2 * four.params_sharded) and hsdp.peak_bytes > four.peak_bytes


def test_linear_schedule_peak_is_the_walk():
    rng = random.Random(7)
    for _ in range(3000):
        schedule, pp, m = rng.choice(["gpipe", "1f1b"]), rng.randint(1, 9), rng.randint(1, 24)
        i = rng.randrange(pp)
        acts, keep, in_grad, ws, grads = (rng.choice([0.0, rng.random() * 10]) for _ in range(5))
        first = grads + rng.random() * 5  # the first backward grows by at least the gradients
        walk = schedule_peak(schedule, i, pp, m, 1, [acts], [keep], [in_grad], [ws], [first], [grads])
        fast = schedule_peak_linear(schedule, i, pp, m, acts, keep, in_grad, ws, first, grads)
        assert fast[0] == pytest.approx(walk[0], rel=1e-9, abs=1e-12)


def test_70b_on_h100_8x8_picks_tensor_parallelism_inside_the_node_and_fits():
    cluster = ClusterDescription.from_file(H100_8X8)
    result = search(preset("70b"), cluster, global_batch=512)
    best = result.best
    assert best.layout.tp > 1 and 8 % best.layout.tp == 0 and best.fits
    assert estimate_memory(result.model, best.layout, cluster.runtime).peak_bytes <= cluster.usable_bytes
    assert group_tiers(best.comm)["tp"] == LinkTier.SAME_NODE.name
    flat = [c for c in result.fitting if c.layout.tp == 1]
    assert flat and best.step_s < flat[0].step_s  # faster than the best tp=1 mesh, by the model


# ------------------------------------------------------------------------------ the launcher
def _tiny_spec(num_workers=8, **parallel):
    from rayflex.models.gpt_blocks import gpt

    model = gpt(n_layers=4, d_model=64, n_heads=4, vocab_size=128, seq_len=32)
    return rf.Trainer(model=model, data=rf.DataConfig(uri="file:///nonexistent/rayflex-layout", seq_len=32,
                                                      global_batch=16),
                      run=rf.RunConfig(name="layout", storage="file:///tmp/rayflex-test", steps=1),
                      scaling=rf.ScalingConfig(num_workers=num_workers, min_workers=2),
                      parallel=rf.ParallelConfig(layout="auto", **parallel)).spec


def test_resolve_parallel_returns_a_layout_plan_mesh_builds():
    spec = _tiny_spec()
    has_tp = bool(spec.model.metadata.get("tp"))
    for world in (8, 4, 2):
        r = resolve_parallel(spec, world)
        assert not r.parallel.is_auto and isinstance(r.parallel.tp, int)
        mesh = plan_mesh(spec.model, r.parallel, r.data, world)
        lay = r.choice.candidate.layout
        assert (mesh.pp, mesh.dp, mesh.tp, mesh.dp_shard) == (lay.pp, lay.dp, lay.tp, lay.dp_shard)
        assert r.parallel.dp_shard is None if lay.dp_replicate == 1 else r.parallel.dp_shard == lay.dp_shard
    if not has_tp:
        pytest.skip("the tiny GPT has no metadata['tp'] yet (no TP plan): tp > 1 cannot be planned for it")
    # a tp the launch chose is kept at every other size (the elastic rule), and plan_mesh builds it
    r = resolve_parallel(spec, 4, launch_tp=2)
    assert r.parallel.tp == 2 and "Elastic rule: tp=2" in r.explanation
    mesh = plan_mesh(spec.model, r.parallel, r.data, 4)
    assert mesh.tp == 2 and mesh.pp * mesh.dp * mesh.tp == 4


def test_restarts_keep_the_launch_tp_while_it_fits():
    spec = _tiny_spec()
    launch = resolve_parallel(spec, 8)
    restart = resolve_parallel(spec, 4)
    assert restart.parallel.tp == launch.parallel.tp
    assert f"Elastic rule: tp={launch.parallel.tp}" in restart.explanation


def test_live_placement_uses_the_3d_shape():
    spec = _tiny_spec()
    parallel = rf.ParallelConfig(pp=2, tp=2, dp_shard=1) if spec.model.metadata.get("tp") else rf.ParallelConfig(pp=2)
    mesh = plan_mesh(spec.model, parallel, spec.data, 8)
    topology = _racks(4, 2, 2)
    plan = plan_for(spec, mesh, topology)
    assert (plan.mesh.pp, plan.mesh.dp, plan.mesh.tp, plan.mesh.dp_replicate) == (mesh.pp, mesh.dp, mesh.tp,
                                                                                   mesh.dp_replicate)
    _assert_tp_groups_whole(plan)


def test_comm_profile_prices_the_mesh_activation_checkpointing():
    spec = _tiny_spec()
    if not spec.model.metadata.get("tp"):
        pytest.skip("the tiny GPT has no metadata['tp'] (no TP plan): no TP all-reduces to price")
    parallel = rf.ParallelConfig(pp=2, tp=2)
    none = plan_mesh(spec.model, parallel, spec.data, 8)
    full = plan_mesh(spec.model, parallel, spec.data, 8, memory=rf.MemoryConfig(activation_checkpointing="full"))
    assert full.memory_config(spec.memory).activation_checkpointing == "full"
    a, b = comm_profile(spec, none).tp_allreduce_bytes, comm_profile(spec, full).tp_allreduce_bytes
    assert all(y > x for x, y in zip(a, b))  # a recomputed block replays its forward all-reduces


# ------------------------------------------------------------------------------ the CLI
def test_cli_plan_names_the_layout_and_why(capsys):
    from rayflex.cli.main import main

    assert main(["plan", "--model", "70b", "--cluster", H100_8X8]) == 0
    out = capsys.readouterr().out
    choice = next(line for line in out.splitlines() if line.startswith("choice:"))
    for word in ("pp=", "tp=", "dp="):
        assert word in choice, choice
    assert "why:" in out and "By tensor-parallel degree" in out
    assert "TP all-reduce over NVLink costs" in out and "tp=1: " in out
    assert "Placement priced" in out and "SAME_NODE" in out
    assert main(["plan", "--model", "70b", "--cluster", H100_8X8, "--tp", "1"]) == 0
    assert "tp=1" in capsys.readouterr().out


def test_cli_plan_ac_auto_says_what_it_chose_and_why(capsys):
    from rayflex.cli.main import main

    assert main(["plan", "--model", "70b", "--cluster", H100_8X8, "--seq-len", "4096", "--ac", "auto"]) == 0
    out = capsys.readouterr().out
    choice = next(line for line in out.splitlines() if line.startswith("choice:"))
    assert "activation checkpointing every 2nd block" in choice, choice
    why = next(line for line in out.splitlines() if line.startswith("Activation checkpointing (auto):"))
    assert "'none' does not fit this mesh" in why and "'full' fits" in why and "step time" in why
    assert "activation checkpointing auto (none, every 2nd block, full)" in out
    # a mode given is priced as is: --ac full fits at seq 4096 too, and says nothing of auto
    assert main(["plan", "--model", "70b", "--cluster", H100_8X8, "--seq-len", "4096", "--ac", "full"]) == 0
    out = capsys.readouterr().out
    assert "activation checkpointing full;" in out and "Activation checkpointing (auto)" not in out
