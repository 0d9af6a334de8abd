"""``ParallelConfig(pp="auto")``: validation, resolution to a runnable mesh, elastic sizes.

No Ray: the planner runs on described clusters or on this host's CPUs.
"""

import os

import pytest

import rayflex as rf
from rayflex.mesh.plan import NO_PIPELINE, MeshPlan, plan_mesh
from rayflex.planning.capacity.auto import resolve_parallel
from rayflex.planning.capacity.memory import CapacityError, describe_model, estimate_memory
from rayflex.planning.capacity.search import ClusterDescription
from rayflex.faults.policy import FailurePolicy, Restart, best_world_size, valid_world_sizes

from conftest import SEQ_LEN, small_gpt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H100_8X8 = os.path.join(ROOT, "examples", "clusters", "h100_8x8.yaml")
DATA = "file:///nonexistent/rayflex-auto"  # never read: nothing here starts a run


def _spec(model=None, *, global_batch=8, seq_len=SEQ_LEN, **over):
    kw = dict(model=model or small_gpt(), data=rf.DataConfig(uri=DATA, seq_len=seq_len, global_batch=global_batch),
              run=rf.RunConfig(name="auto", storage="file:///tmp/rayflex-test", steps=3),
              scaling=rf.ScalingConfig(num_workers=4), parallel=rf.ParallelConfig(pp="auto"))
    kw.update(over)
    return rf.Trainer(**kw).spec


# ------------------------------------------------------------------------------ validation
@pytest.mark.parametrize("make, field, hint", [
    (lambda: rf.ParallelConfig(pp="Auto"), "ParallelConfig.pp", "'auto'"),
    (lambda: rf.ParallelConfig(pp="2"), "ParallelConfig.pp", "'auto'"),
    (lambda: rf.ParallelConfig(pp="auto", schedule="gpipe"), "ParallelConfig.schedule", "capacity planner"),
    (lambda: rf.ParallelConfig(pp="auto", microbatches=8), "ParallelConfig.microbatches", "capacity planner"),
    (lambda: rf.ParallelConfig(pp="auto", stages_per_rank=2), "ParallelConfig.stages_per_rank", "capacity planner"),
    (lambda: rf.ParallelConfig(pp="auto", cluster=3), "ParallelConfig.cluster", "docs/capacity.md"),
    (lambda: _spec(data=rf.DataConfig(uri=DATA, seq_len=SEQ_LEN, global_batch=8, micro_batch=2)),
     "DataConfig.micro_batch", "micro_batch=None"),
    (lambda: _spec(scaling=rf.ScalingConfig(num_workers=4, use_gpu=True)), "ParallelConfig.cluster", "cluster="),
    # 8 ranks, batch 4, 4 blocks: dp=8 does not divide 4; pp=2/4 leave 1/2 samples per rank
    (lambda: _spec(global_batch=4, scaling=rf.ScalingConfig(num_workers=8)), "ParallelConfig.pp",
     "multiple of 8"),
])
def test_invalid_auto_configs_name_the_field(make, field, hint):
    with pytest.raises(rf.ConfigError) as info:
        make()
    assert info.value.field == field
    assert hint in str(info.value) and "Fix:" in str(info.value)


def test_auto_config_is_valid_and_integer_pp_is_unchanged():
    spec = _spec(global_batch=6)  # dp=4 does not divide 6, but pp=2 x dp=2 does
    assert spec.parallel.is_auto and spec.parallel.num_stages is None
    p = rf.ParallelConfig(pp=2, schedule="interleaved", stages_per_rank=2)
    assert not p.is_auto and p.num_stages == 4
    with pytest.raises(rf.ConfigError, match="not divisible by ParallelConfig.pp=3"):
        _spec(parallel=rf.ParallelConfig(pp=3))
    # the cluster path is made absolute: the controller reads it from another directory
    rel = os.path.relpath(H100_8X8)
    assert rf.ParallelConfig(pp="auto", cluster=rel).cluster == H100_8X8


def test_overrides_accept_auto():
    t = rf.Trainer.from_spec(_spec(parallel=rf.ParallelConfig(pp=2)))
    t2 = t.with_overrides({"parallel.pp": "auto", "parallel.cluster": H100_8X8})
    assert t2.spec.parallel.is_auto and t2.spec.parallel.cluster == H100_8X8
    assert t2.with_overrides({"parallel.pp": "2"}).spec.parallel.pp == 2
    # a value the planner would override is refused, not dropped
    t3 = rf.Trainer.from_spec(_spec(parallel=rf.ParallelConfig(pp=2, microbatches=4)))
    with pytest.raises(rf.ConfigError) as info:
        t3.with_overrides({"parallel.pp": "auto"})
    assert info.value.field == "ParallelConfig.microbatches"


# ------------------------------------------------------------------------------ resolution
def test_integer_pp_passes_through():
    spec = _spec(parallel=rf.ParallelConfig(pp=2, microbatches=2))
    r = resolve_parallel(spec, 4)
    assert r.parallel is spec.parallel and r.data is spec.data and r.explanation == "" and r.choice is None


def test_small_gpt_resolves_to_a_mesh_the_workers_can_build():
    spec = _spec(global_batch=8, scaling=rf.ScalingConfig(num_workers=4, min_workers=2))
    with pytest.raises(rf.ConfigError) as info:  # unresolved: a clear error, not a TypeError
        plan_mesh(spec.model, spec.parallel, spec.data, 4)
    assert info.value.field == "ParallelConfig.pp"
    for world in (4, 2):
        r = resolve_parallel(spec, world)
        assert isinstance(r.parallel.pp, int) and not r.parallel.is_auto
        dp = world // (r.parallel.pp * r.parallel.tp)
        assert r.explanation.startswith(f"Chose pp={r.parallel.pp} x dp={dp}")
        mesh = plan_mesh(spec.model, r.parallel, r.data, world)
        assert mesh.pp * mesh.dp * mesh.tp == world and mesh.pp == r.choice.candidate.layout.pp
        assert mesh.per_rank_batch * mesh.dp == 8
        if mesh.pp == 1:  # the planner's accumulation micro-batch reaches the mesh
            assert r.data.micro_batch == r.choice.mesh.micro_batch == mesh.micro_batch
        else:
            assert mesh.microbatches == r.choice.mesh.microbatches


def test_planner_micro_batch_reaches_the_mesh(tmp_path):
    # 1.5 MB devices: the whole per-rank batch of 8 (1.96 MB modeled) does not fit, 4 x 2
    # accumulation passes (1.26 MB) does and is the fastest that fits
    tiny = tmp_path / "tiny.yaml"
    tiny.write_text("device: {memory_gb: 0.0015, tflops: 1}\nmemory_margin: 0\noverhead_gb: 0\n"
                    "uniform: {nodes: 1, devices_per_node: 2}\n")
    spec = _spec(global_batch=16, scaling=rf.ScalingConfig(num_workers=2),
                 parallel=rf.ParallelConfig(pp="auto", cluster=str(tiny)))
    r = resolve_parallel(spec, 2)
    assert (r.parallel.pp, r.data.micro_batch) == (1, 4) and spec.data.micro_batch is None
    mesh = plan_mesh(spec.model, r.parallel, r.data, 2)
    assert (mesh.micro_batch, mesh.accum_steps) == (4, 2)


def test_resolve_on_a_live_style_topology():
    from rayflex.planning.topology import Topology

    topo = Topology.from_dict({"nodes": [{"id": "a", "slots": 2, "labels": {"rack": "r0"}},
                                         {"id": "b", "slots": 2, "labels": {"rack": "r0"}}]})
    spec = _spec()
    r = resolve_parallel(spec, 4, topo)
    assert plan_mesh(spec.model, r.parallel, r.data, 4).world_size == 4
    with pytest.raises(CapacityError, match="usable slots"):  # more ranks than the nodes hold
        resolve_parallel(spec, 8, topo)


def test_missing_cluster_file_names_the_field(tmp_path):
    spec = _spec(parallel=rf.ParallelConfig(pp="auto", cluster=str(tmp_path / "nope.yaml")))
    with pytest.raises(rf.ConfigError) as info:
        resolve_parallel(spec, 4)
    assert info.value.field == "ParallelConfig.cluster" and "nope.yaml" in str(info.value)


def _big_spec(**scaling):
    # rayflex's GPT at the 70B preset's widths (mlp 4x: 65B params), in fp32 like the
    # workers run today; seq 512 and batch 384 so that it fits on 64 and on 48 H100s
    from rayflex.models import GPTConfig, gpt

    model = gpt(GPTConfig(vocab_size=32000, seq_len=512, d_model=8192, n_layers=80, n_heads=64))
    return _spec(model, global_batch=384, seq_len=512, scaling=rf.ScalingConfig(use_gpu=True, **scaling),
                 parallel=rf.ParallelConfig(pp="auto", cluster=H100_8X8))


def test_70b_on_64_h100_picks_a_pipeline_that_fits_and_still_fits_after_a_shrink():
    spec = _big_spec(num_workers=64, min_workers=40)
    cluster = ClusterDescription.from_file(H100_8X8)
    model = describe_model(spec.model, 512)
    # data parallelism alone cannot hold it: the planner must pipeline
    dp_only = MeshPlan(1, 64, schedule=NO_PIPELINE, micro_batch=1, accum_steps=6,
                       stage_blocks=(tuple(range(model.num_blocks)),))
    assert estimate_memory(model, dp_only, cluster.runtime).peak_bytes > cluster.usable_bytes
    policy = FailurePolicy(spec)
    tps = []
    for usable in (64, 48):  # launch, then a restart after losing two nodes
        decision = policy.resize(usable_slots=usable)
        assert isinstance(decision, Restart) and decision.world_size == usable
        r = resolve_parallel(spec, usable)
        assert r.parallel.pp * r.parallel.tp > 1 and r.data is spec.data
        mesh = plan_mesh(spec.model, r.parallel, r.data, usable)
        assert mesh.pp * mesh.dp * mesh.tp == usable and mesh.tp == r.parallel.tp
        # the stages the workers build are the ones the planner modeled, and they fit
        assert mesh.stage_blocks == r.choice.candidate.layout.stage_blocks
        peak = estimate_memory(model, mesh, cluster.runtime).peak_bytes
        assert peak <= cluster.usable_bytes
        assert f"pp={mesh.pp} x dp={mesh.dp}" in r.explanation
        tps.append(mesh.tp)
    # the elastic rule: the node shape fixes tp, the restart keeps the launch's
    assert tps[0] == tps[1] and "Elastic rule: tp=" in r.explanation


def test_70b_that_fits_nowhere_fails_before_ray(tmp_path):
    import ray

    # seq 2048: even tp=8 inside the nodes leaves every mesh above 72 GB (seq 1024 fits with it)
    t = rf.Trainer.from_spec(_big_spec(num_workers=64)).with_overrides(
        {"data.global_batch": "512", "data.seq_len": "2048", "run.storage": f"file://{tmp_path}/runs"})
    with pytest.raises(CapacityError, match=r"no mesh of 64 ranks fits .* smallest peak"):
        t.submit()
    assert not ray.is_initialized()


# ------------------------------------------------------------------------------ activation checkpointing
def test_auto_ac_recomputes_where_nothing_fits_without_it():
    # rayflex's GPT at the 70B widths in fp32, seq 2048: no mesh of 64 H100s fits without
    # recomputation (test_70b_that_fits_nowhere_fails_before_ray); with "auto" one does
    from rayflex.models import GPTConfig, gpt

    model = gpt(GPTConfig(vocab_size=32000, seq_len=2048, d_model=8192, n_layers=80, n_heads=64))
    spec = _spec(model, global_batch=512, seq_len=2048, scaling=rf.ScalingConfig(num_workers=64, use_gpu=True),
                 parallel=rf.ParallelConfig(layout="auto", cluster=H100_8X8),
                 memory=rf.MemoryConfig(activation_checkpointing="auto", compile=True))
    r = resolve_parallel(spec, 64)
    assert r.memory.activation_checkpointing in ("every_k", "full") and r.memory.compile  # the rest is the spec's
    assert (r.memory.activation_checkpointing, r.memory.ac_every) == (r.choice.activation_checkpointing,
                                                                      r.choice.ac_every)
    assert spec.memory.activation_checkpointing == "auto"  # the spec itself is not touched
    mesh = plan_mesh(spec.model, r.parallel, r.data, 64, memory=r.memory)
    assert mesh.memory_config(spec.memory) == r.memory
    # what the workers will run fits, by the memory model with the rule they follow
    cluster = ClusterDescription.from_file(H100_8X8)
    described = describe_model(spec.model, 2048).for_run(memory_config=r.memory)
    peak = estimate_memory(described, mesh, cluster.runtime).peak_bytes
    assert peak <= cluster.usable_bytes
    assert "Activation checkpointing (auto): " in r.explanation and "'none' does not fit this mesh" in r.explanation


def test_auto_ac_is_none_when_everything_fits_and_other_modes_pass_through():
    auto = _spec(memory=rf.MemoryConfig(activation_checkpointing="auto"))
    r = resolve_parallel(auto, 4)
    assert r.memory == rf.MemoryConfig() and r.choice.activation_checkpointing == "none"
    assert "Activation checkpointing (auto): none: this mesh fits without recomputation" in r.explanation
    plain = resolve_parallel(_spec(), 4)  # the same mesh as without any recomputation
    assert (r.parallel, r.data) == (plain.parallel, plain.data)
    for memory in (rf.MemoryConfig(activation_checkpointing="full"),
                   rf.MemoryConfig(activation_checkpointing="every_k", ac_every=3)):
        spec = _spec(memory=memory)
        r = resolve_parallel(spec, 4)
        assert r.memory is spec.memory and "Activation checkpointing (auto)" not in r.explanation
        assert (r.choice.activation_checkpointing, r.choice.ac_every) == (memory.activation_checkpointing,
                                                                          memory.ac_every)
    fixed = _spec(parallel=rf.ParallelConfig(pp=2, microbatches=2),
                  memory=rf.MemoryConfig(activation_checkpointing="full"))
    assert resolve_parallel(fixed, 4).memory is fixed.memory
    with pytest.raises(rf.ConfigError) as info:  # "auto" needs the planner
        _spec(parallel=rf.ParallelConfig(pp=2), memory=rf.MemoryConfig(activation_checkpointing="auto"))
    assert info.value.field == "MemoryConfig.activation_checkpointing"


# ------------------------------------------------------------------------------ elastic
def test_valid_world_sizes_for_auto():
    spec = _spec(global_batch=8, scaling=rf.ScalingConfig(num_workers=8, min_workers=1))
    # 4 blocks: 7 and 5 need pp=7/5 stages (or dp=7/5 of batch 8); 6 runs as pp=3 x dp=2
    assert valid_world_sizes(spec) == [8, 6, 4, 3, 2, 1]
    assert best_world_size(spec, 7) == 6 and best_world_size(spec, 5) == 4
    # every size called valid really resolves to a mesh; the others really have none
    for n in range(1, 9):
        if n in valid_world_sizes(spec):
            r = resolve_parallel(spec, n)
            assert plan_mesh(spec.model, r.parallel, r.data, n).world_size == n
        else:
            with pytest.raises(CapacityError, match=f"no mesh of {n} ranks can take global batch 8"):
                resolve_parallel(spec, n)
    # integer pp: as before
    fixed = _spec(global_batch=8, scaling=rf.ScalingConfig(num_workers=8, min_workers=1),
                  parallel=rf.ParallelConfig(pp=1))
    assert valid_world_sizes(fixed) == [8, 4, 2, 1]


# ------------------------------------------------------------------------------ dry runs
def test_trainer_plan_and_cli_show_the_auto_choice(tmp_path, capsys):
    t = rf.Trainer.from_spec(_spec(global_batch=16, scaling=rf.ScalingConfig(num_workers=16)))
    plan = t.plan(os.path.join(ROOT, "examples", "topologies", "two_racks_64gpu.yaml"), world_size=16)
    assert plan.mesh.world_size == 16 and plan.explanation.startswith(f"Chose pp={plan.mesh.pp}")

    from rayflex.cli.main import main

    job = tmp_path / "job.py"
    job.write_text(
        "import rayflex as rf\n"
        "from rayflex.models import GPTConfig, gpt\n"
        "trainer = rf.Trainer(model=gpt(GPTConfig(vocab_size=128, seq_len=32, d_model=32, n_layers=4, n_heads=2)),\n"
        f"    data=rf.DataConfig(uri='{DATA}', seq_len=32, global_batch=64),\n"
        "    run=rf.RunConfig(name='auto-plan', steps=2), scaling=rf.ScalingConfig(num_workers=8, use_gpu=True),\n"
        f"    parallel=rf.ParallelConfig(pp='auto', cluster='{H100_8X8}'))\n")
    assert main(["plan", str(job)]) == 0
    out = capsys.readouterr().out
    assert "64 x H100-80GB" in out and "world size 8" in out and "choice:" in out


# ------------------------------------------------------------------------------ replicate tier
TWO_ZONES = os.path.join(ROOT, "examples", "clusters", "h100_8x8_two_zones.yaml")  # 5 Gb/s between them


def test_replicate_auto_takes_the_planners_pick_at_launch_and_keeps_it_at_every_size(tmp_path):
    """CommConfig(replicate="auto"): the planner's advice for the launch mesh reaches the
    workers through the mesh, and a restart at another size keeps it (how replicas meet
    never changes mid-run: a DiLoCo checkpoint is always read by DiLoCo)."""
    from rayflex.models import GPTConfig, gpt

    model = gpt(GPTConfig(vocab_size=32000, seq_len=2048, d_model=1024, n_layers=16, n_heads=16))

    one_zone = tmp_path / "one_zone.yaml"  # the same nodes, both racks in one zone
    one_zone.write_text(open(TWO_ZONES).read().replace("racks_per_zone: 1", "racks_per_zone: 2"))

    def spec(cluster, comm=rf.CommConfig(replicate="auto")):
        return _spec(model, global_batch=128, seq_len=2048,
                     scaling=rf.ScalingConfig(num_workers=64, min_workers=8, use_gpu=True),
                     parallel=rf.ParallelConfig(layout="auto", cluster=str(cluster)), comm=comm)

    apart = spec(TWO_ZONES)  # two zones 5 Gb/s apart: only DiLoCo keeps the step compute-bound
    launch = resolve_parallel(apart, 64)
    assert launch.parallel.dp_shard is not None, "HSDP: shard groups inside a zone"
    choice = dict(launch.replicate_choice)
    assert choice["replicate"] == "diloco" and choice["inner_steps"] >= 8, choice
    assert "Replicate tier (auto, kept at every world size): CommConfig(replicate='diloco'" in launch.explanation
    mesh = plan_mesh(apart.model, launch.parallel, launch.data, 64, memory=launch.memory,
                     replicate_choice=launch.replicate_choice)
    comm = mesh.comm_config(apart.comm)
    assert (comm.replicate, comm.inner_steps) == ("diloco", choice["inner_steps"]) and comm.custom
    assert mesh.precision_config(apart.precision) == apart.precision
    # A restart at 32 ranks: the launch pick, whether the controller passes it or not.
    for kept in (resolve_parallel(apart, 32, launch_replicate=mesh.replicate_choice), resolve_parallel(apart, 32)):
        assert kept.replicate_choice == launch.replicate_choice, kept.explanation

    together = spec(one_zone)  # one zone: a bf16 all-reduce is cheap enough
    r = resolve_parallel(together, 64)
    assert r.replicate_choice == (("replicate", "allreduce"), ("reduce_dtype", "bf16")), r.explanation
    mesh = plan_mesh(together.model, r.parallel, r.data, 64, replicate_choice=r.replicate_choice)
    assert not mesh.comm_config(together.comm).custom
    assert mesh.precision_config(together.precision).reduce_dtype == "bf16"
    # A spec that names its mode is left alone.
    assert resolve_parallel(spec(TWO_ZONES, rf.CommConfig()), 64).replicate_choice == ()


def test_replicate_auto_needs_the_planner_and_picks_no_diloco_setting_itself():
    with pytest.raises(rf.ConfigError) as err:
        _spec(parallel=rf.ParallelConfig(pp=1, dp_shard=2), comm=rf.CommConfig(replicate="auto"))
    assert err.value.field == "CommConfig.replicate" and "layout='auto'" in str(err.value)
    with pytest.raises(rf.ConfigError) as err:  # the planner picks H
        rf.CommConfig(replicate="auto", inner_steps=8)
    assert err.value.field == "CommConfig.inner_steps"
