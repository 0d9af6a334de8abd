"""Capacity planner: the memory model against real CPU workers, and the search's promises.

The measured configurations run real TrainWorkers in plain processes (gloo on 127.0.0.1,
no Ray) and compare each rank's peak anonymous memory with the model's prediction.
"""

import json
import os
import random
import sys

import pytest

from rayflex.errors import PlacementError, RayflexError
from rayflex.mesh.plan import NO_PIPELINE, MeshPlan
from rayflex.mesh.stage_split import stage_split
from rayflex.planning.capacity.memory import (CapacityError, ModelDescription, estimate_memory, in_flight_peak,
                                       measure_activation_bytes, preset, transformer_activation_bytes_per_token)
from rayflex.planning.capacity.search import (ClusterDescription, DeviceSpec, ac_name, ac_options, best_parallel_config,
                                             evaluate_layout, explain, search)

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")

H100X64 = """\
device: {name: H100-80GB, memory_gb: 80, tflops: 989, mfu: 0.4}
memory_margin: 0.10
overhead_gb: 2
uniform: {nodes: 8, devices_per_node: 8, nodes_per_rack: 8}
"""


@pytest.fixture(scope="module")
def h100x64(tmp_path_factory):
    path = tmp_path_factory.mktemp("cluster") / "h100x64.yaml"
    path.write_text(H100X64)
    return path


# ------------------------------------------------------------------------------ real workers
def _measure(names=None):
    sys.path.insert(0, BENCH)
    import capacity_measure as cm

    configs = [c for c in cm.CORE if names is None or c.name in names]
    with cm.MeasurePool(4) as pool:
        return [row for cfg in configs for row in cm.compare(pool, cfg)]


@pytest.fixture(scope="module")
def measured():
    """Every core configuration (the slow memory-model check)."""
    return _measure()


@pytest.fixture(scope="module")
def measured_schedules():
    """The two pp=2 x dp=2 schedules only: what the CI checks need, in half the time."""
    return _measure({"pp2-dp2-gpipe", "pp2-dp2-1f1b"})


@pytest.mark.slow  # ~60 s of real workers and RSS-based, so load-sensitive: `make test-slow`
def test_memory_model_within_15_percent_of_real_workers(measured, capsys):
    with capsys.disabled():
        print()
        for r in measured:
            print(f"  {r['config']:<22} rank {r['rank']}: predicted {r['predicted_peak_bytes'] / 1e6:6.1f} MB, "
                  f"measured {r['measured_peak_bytes'] / 1e6:6.1f} MB, error {r['relative_error']:+.1%}, "
                  f"file pages +{r['file_growth_bytes'] / 1e6:.2f} MB")
    configs = {r["config"] for r in measured}
    assert len(configs) >= 4
    assert {r["pp"] for r in measured} >= {1, 2} and {r["dp"] for r in measured} >= {1, 2}
    assert {r["schedule"] for r in measured} >= {"fsdp", "1f1b", "gpipe", "interleaved"}
    worst = max(measured, key=lambda r: abs(r["relative_error"]))
    assert abs(worst["relative_error"]) <= 0.15, worst
    # file-backed pages that grew during the run bound the measurement's error: keep it small
    assert all(r["file_growth_bytes"] < 0.05 * r["measured_peak_bytes"] for r in measured)


@pytest.mark.multiproc
def test_sharded_state_is_exact(measured_schedules):
    """Parameter, gradient and AdamW shards after a step: the model's arithmetic, exactly
    (up to FSDP's uneven last shard)."""
    for r in measured_schedules:
        assert r["measured_state_bytes"] == pytest.approx(r["predicted_state_bytes"], rel=0.02), r


@pytest.mark.multiproc
def test_gpipe_holds_more_than_1f1b_on_stage_0(measured_schedules):
    """Measured by what autograd keeps for backward (the worker's probe, exact), not by the
    process's resident peak, which moves with whatever else the host runs."""
    stage0 = {r["config"]: r for r in measured_schedules if r["pp_index"] == 0}
    gpipe, one_f_one_b = stage0["pp2-dp2-gpipe"], stage0["pp2-dp2-1f1b"]
    assert gpipe["measured_activation_peak_bytes"] > one_f_one_b["measured_activation_peak_bytes"]
    assert gpipe["predicted_peak_bytes"] > one_f_one_b["predicted_peak_bytes"]


# ------------------------------------------------------------------------------ the model
def test_activation_formula_matches_measured_saved_bytes():
    from rayflex.models import GPTConfig, gpt

    cfg = GPTConfig(vocab_size=96, seq_len=32, d_model=64, n_layers=2, n_heads=4)
    per_token = measure_activation_bytes(gpt(cfg), seq_len=32, micro_batch=2, vocab_size=96)
    formula = transformer_activation_bytes_per_token(64, 256, 4, 4)
    assert per_token[1] == pytest.approx(formula, rel=1e-9)
    assert per_token[2] == pytest.approx(formula, rel=1e-9)
    # Korthikanti's fp16 figure (34 sbh, with dropout masks) is 2 bytes per h above ours
    assert transformer_activation_bytes_per_token(4096, 16384, 32, 2) == pytest.approx(32 * 4096 + 36 * 4)
    md = ModelDescription.from_gpt(cfg)
    spec = gpt(cfg)
    assert md.block_params == tuple(spec.param_counts())
    # a calibrated description (measured figures) predicts the same activations
    calibrated = ModelDescription.from_spec(spec, seq_len=32, activation_bytes_per_token=per_token)
    lay = MeshPlan(1, 1, schedule=NO_PIPELINE, micro_batch=2, stage_blocks=((0, 1, 2, 3),))
    a = estimate_memory(md, lay).ranks[0].activations
    b = estimate_memory(calibrated, lay).ranks[0].activations
    assert b == pytest.approx(a, rel=0.01)


def test_stage_split_matches_the_workers():
    from rayflex.mesh.stage_split import balanced_split

    rng = random.Random(3)
    for _ in range(30):
        costs = [rng.choice([1.0, 2.0, 3.0, rng.random() * 5]) for _ in range(rng.randint(2, 14))]
        k = rng.randint(1, len(costs))
        assert [list(s) for s in stage_split(costs, k)] == balanced_split(costs, k)


def test_schedule_in_flight_counts():
    pp, m = 4, 8
    assert [in_flight_peak("1f1b", i, pp, m) for i in range(pp)] == [4, 3, 2, 1]
    assert [in_flight_peak("gpipe", i, pp, m) for i in range(pp)] == [8] * 4
    # interleaved: (v-1)*pp + 2*(pp-1-i) warm-up chunk-forwards, plus one
    assert [in_flight_peak("interleaved", i, pp, m, 2) for i in range(pp)] == [11, 9, 7, 5]
    # torch's own op order agrees
    from torch.distributed.pipelining.schedules import _get_1f1b_rank_ops, _get_warmup_ops

    for i in range(pp):
        w = _get_warmup_ops(i, 2, pp, pp, m)
        ops = _get_1f1b_rank_ops(2, pp, w, 2 * m - w, w, i, lambda s: s, lambda s: s)
        live = peak = 0
        for op in ops:
            if op is not None:
                live += 1 if op.computation_type.name == "FORWARD" else -1
                peak = max(peak, live)
        assert peak == in_flight_peak("interleaved", i, pp, m, 2)


def test_presets_have_the_advertised_sizes():
    assert preset("7b").total_params == pytest.approx(6.7e9, rel=0.01)
    assert preset("70b").total_params == pytest.approx(70.3e9, rel=0.01)
    d = preset("7b").to_dict()
    assert d["total_params"] == preset("7b").total_params


# ------------------------------------------------------------------------------ the search
def test_70b_on_64_h100_dp_only_does_not_fit_and_the_choice_does(h100x64):
    cluster = ClusterDescription.from_file(h100x64)
    result = search(preset("70b"), cluster, global_batch=512)
    best = result.best
    assert best.fits and best.peak_bytes <= cluster.usable_bytes
    assert best.layout.pp > 1
    dp_only = [c for c in result.candidates if (c.layout.pp, c.layout.tp) == (1, 1)]
    assert dp_only and not any(c.fits for c in dp_only)
    # every candidate the search calls fitting fits by the model, recomputed independently
    for c in result.fitting:
        assert estimate_memory(result.model, c.layout, cluster.runtime).peak_bytes <= cluster.usable_bytes
    text = explain(result)
    assert "Data parallelism alone (pp=1 x dp=64) does not fit" in text
    assert f"pp={best.layout.pp} x dp={best.layout.dp}" in text


def test_7b_fits_and_every_fitting_candidate_fits(h100x64):
    cluster = ClusterDescription.from_file(h100x64)
    result = search(preset("7b"), cluster, global_batch=512)
    assert result.best.fits
    assert all(c.peak_bytes <= cluster.usable_bytes for c in result.fitting)
    assert all(not c.fits for c in result.candidates[len(result.fitting):])
    steps = [c.step_s for c in result.fitting]
    assert steps == sorted(steps)


def test_impossible_request_says_why_with_numbers():
    cluster = ClusterDescription.uniform(nodes=1, devices_per_node=8, device=DeviceSpec.h100_80gb())
    with pytest.raises(CapacityError) as info:
        search(preset("70b"), cluster, global_batch=64)
    msg = str(info.value)
    assert isinstance(info.value, PlacementError) and isinstance(info.value, RayflexError)
    # 70.3B params x 16 B = 1.1 TB > 8 x 72 GB = 576 GB
    assert "16 B" in msg and "1.1 TB" in msg and "576.0 GB" in msg and "at least 16 devices" in msg


def test_nothing_fits_names_the_smallest_peak(h100x64):
    cluster = ClusterDescription.from_file(h100x64)
    with pytest.raises(CapacityError, match=r"smallest peak is .* GB .*activations"):
        search(preset("70b").with_seq_len(8192), cluster, global_batch=512)


def test_search_of_a_1024_node_cluster_finds_a_layout_that_fits():
    # How fast (goal < 2 s) is benchmarks/capacity.py's to measure; a timed assertion here
    # would measure how busy the machine is.
    cluster = ClusterDescription.uniform(nodes=1024, devices_per_node=8, device=DeviceSpec.h100_80gb(),
                                         nodes_per_rack=32, racks_per_zone=16)
    result = search(preset("70b"), cluster, global_batch=16384)
    assert result.world_size == 8192 and result.best.fits


def test_best_parallel_config_for_the_launcher():
    from rayflex.models import GPTConfig, gpt

    spec = gpt(GPTConfig(vocab_size=128, seq_len=32, d_model=32, n_layers=4, n_heads=2))
    cluster = ClusterDescription.local_cpu(4)
    choice = best_parallel_config(spec, cluster, world_size=4, global_batch=16, seq_len=32)
    mesh = choice.mesh
    assert mesh.world_size == 4 and mesh.pp in (1, 2, 4) and choice.explanation.startswith("Chose")
    assert mesh.schedule in (("1f1b", "gpipe", "interleaved") if mesh.pp > 1 else (NO_PIPELINE,))
    assert mesh.per_rank_batch * mesh.dp == 16 and len(mesh.stage_blocks) == mesh.num_stages
    # a shrink from 16 to 12 nodes still gets a mesh that fits
    big = ClusterDescription.uniform(nodes=16, devices_per_node=8, device=DeviceSpec.h100_80gb())
    for world in (128, 96):
        c = best_parallel_config(preset("70b"), big, world_size=world, global_batch=384, seq_len=1024)
        assert c.candidate.fits and c.candidate.layout.world_size == world


# ------------------------------------------------------------------------------ activation checkpointing
def _auto_ac(**kw):
    from rayflex.config import MemoryConfig

    return ac_options(MemoryConfig(activation_checkpointing="auto", **kw))


def test_ac_options_and_recomputation_price():
    from rayflex.config import MemoryConfig

    assert [(m.activation_checkpointing, m.ac_every) for m in _auto_ac()] == [("none", 2), ("every_k", 2),
                                                                             ("full", 2)]
    assert [m.activation_checkpointing for m in _auto_ac(ac_every=1)] == ["none", "full"]  # every 1st = full
    assert [ac_name(m.activation_checkpointing, m.ac_every) for m in _auto_ac(ac_every=3)] == [
        "none", "every 3rd block", "full"]
    # the same layout: every recomputation costs memory less and time more, by its formula
    cluster = ClusterDescription.uniform(nodes=8, devices_per_node=8, device=DeviceSpec.h100_80gb())
    model = preset("70b")
    lay = search(model, cluster, global_batch=512).best.layout
    runs = [evaluate_layout(model.with_checkpointing(m), cluster, lay, 512, None) for m in _auto_ac()]
    peaks, steps = [c.peak_bytes for c in runs], [c.step_s for c in runs]
    assert peaks == sorted(peaks, reverse=True) and steps == sorted(steps) and len(set(steps)) == 3
    full = model.with_checkpointing(MemoryConfig(activation_checkpointing="full"))
    # 6 FLOPs per parameter and token, 2 more for each recomputed one (not the embedding's lookup),
    # on the pp rank that runs the most
    params = full.split_over_tp(lay.tp).block_params
    ranks = [[b for s in lay.local_stages(i) for b in lay.stage_blocks[s]] for i in range(lay.pp)]
    flops = [sum(params[b] * (6 + 2 * (full.blocks[b].kind != "embedding")) for b in blocks) for blocks in ranks]
    plain = [sum(params[b] * 6 for b in blocks) for blocks in ranks]
    assert runs[2].compute_s == pytest.approx(runs[0].compute_s * max(flops) / max(plain), rel=1e-9)


def test_auto_ac_turns_recomputation_on_only_when_needed(h100x64):
    cluster = ClusterDescription.from_file(h100x64)
    long = preset("70b").with_seq_len(4096)
    with pytest.raises(CapacityError):  # nothing fits without recomputation (docs/capacity.md)
        search(long, cluster, global_batch=512)
    result = search(long, cluster, global_batch=512, activation_checkpointing=_auto_ac())
    best = result.best
    assert best.fits and best.activation_checkpointing == "every_k" and best.ac_every == 2
    none, every, full = result.ac_at_best
    assert not none.fits and full.fits and full.step_s > best.step_s == every.step_s
    # it fits by the model, recomputed independently with the rule the workers follow
    from rayflex.config import MemoryConfig

    chosen = long.with_checkpointing(MemoryConfig(activation_checkpointing="every_k", ac_every=2))
    assert estimate_memory(chosen, best.layout, cluster.runtime).peak_bytes <= cluster.usable_bytes
    text = explain(result)
    assert "Activation checkpointing (auto): every 2nd block" in text
    assert "'none' does not fit this mesh" in text and "'full' fits" in text and "step time" in text
    assert "AC every 2nd" in best.label() and best.to_dict()["activation_checkpointing"] == "every_k"
    # where everything fits it recomputes nothing: the plain search's choice at its step time
    plain = search(preset("70b"), cluster, global_batch=512)
    auto = search(preset("70b"), cluster, global_batch=512, activation_checkpointing=_auto_ac())
    assert auto.best.activation_checkpointing == "none" and auto.best.layout == plain.best.layout
    assert auto.best.step_s == pytest.approx(plain.best.step_s, rel=1e-12)
    assert "Activation checkpointing (auto): none: this mesh fits without recomputation" in explain(auto)
    assert "Activation checkpointing" not in explain(plain)


def test_auto_ac_search_is_the_exhaustive_one():
    """Stopping at a layout's first option that fits (and skipping what cannot fit) keeps,
    for every layout, the fastest option that fits, exactly as trying all three would."""
    cluster = ClusterDescription.uniform(nodes=2, devices_per_node=8, device=DeviceSpec.h100_80gb())
    model = preset("7b").with_seq_len(16384)
    options = _auto_ac()
    result = search(model, cluster, global_batch=32, activation_checkpointing=options, require_fit=False)
    modes = {(c.activation_checkpointing, c.fits) for c in result.candidates}
    assert {("none", True), ("every_k", True), ("full", True), ("full", False)} <= modes  # a mixed case
    for c in result.candidates:
        each = [evaluate_layout(model.with_checkpointing(m), cluster, c.layout, 32, c.comm, m) for m in options]
        fit = [e for e in each if e.fits]
        assert c.fits == bool(fit)
        if fit:
            want = min(fit, key=lambda e: e.step_s)
            assert (c.activation_checkpointing, c.step_s) == (want.activation_checkpointing, want.step_s)


def test_best_parallel_config_passes_the_ac_through():
    from rayflex.config import MemoryConfig

    big = ClusterDescription.uniform(nodes=8, devices_per_node=8, device=DeviceSpec.h100_80gb())
    full = MemoryConfig(activation_checkpointing="full")
    c = best_parallel_config(preset("70b"), big, world_size=64, global_batch=512, seq_len=1024, memory_config=full)
    assert (c.activation_checkpointing, c.candidate.activation_checkpointing) == ("full", None)
    assert "Activation checkpointing (auto)" not in c.explanation
    assert best_parallel_config(preset("70b"), big, world_size=64, global_batch=512,
                                seq_len=1024).activation_checkpointing == "none"
    auto = best_parallel_config(preset("70b"), big, world_size=64, global_batch=512, seq_len=4096,
                                memory_config=MemoryConfig(activation_checkpointing="auto"))
    assert (auto.activation_checkpointing, auto.ac_every) == ("every_k", 2) and auto.candidate.fits
    assert "Activation checkpointing (auto): every 2nd block" in auto.explanation


def test_nothing_fits_with_auto_ac_says_what_was_tried(h100x64):
    cluster = ClusterDescription.from_file(h100x64)
    with pytest.raises(CapacityError) as info:
        search(preset("70b").with_seq_len(16384), cluster, global_batch=512, activation_checkpointing=_auto_ac())
    msg = str(info.value)
    assert "with activation checkpointing 'none', 'every 2nd block', 'full'" in msg
    assert "AC full" in msg and "activation_checkpointing='full'" not in msg


# ------------------------------------------------------------------------------ the CLI
def test_cli_plan_described_model(h100x64, capsys):
    from rayflex.cli.main import main

    assert main(["plan", "--model", "70b", "--cluster", str(h100x64), "--explain"]) == 0
    out = capsys.readouterr().out
    assert "->pp=" in out and "does not fit" in out and "placement of the chosen mesh" in out
    assert main(["plan", "--model", "70b", "--cluster", str(h100x64), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["best"]["fits"] and data["best"]["pp"] > 1
    assert main(["plan", "--model", "70b", "--cluster", str(h100x64), "--seq-len", "8192"]) == 2
    assert "smallest peak" in capsys.readouterr().err


def test_cli_plan_spec_file(tmp_path, capsys):
    from rayflex.cli.main import main

    spec = tmp_path / "job.py"
    spec.write_text(
        "import rayflex as rf\n"
        "from rayflex.models import GPTConfig, gpt\n"
        "trainer = rf.Trainer(model=gpt(GPTConfig(vocab_size=128, seq_len=32, d_model=32, n_layers=4, n_heads=2)),\n"
        f"    data=rf.DataConfig(uri='file://{tmp_path}/data', seq_len=32, global_batch=16),\n"
        f"    run=rf.RunConfig(name='plan-test', storage='file://{tmp_path}/runs', steps=2),\n"
        "    scaling=rf.ScalingConfig(num_workers=4))\n")
    assert main(["plan", str(spec)]) == 0
    out = capsys.readouterr().out
    assert "gpt-4x32" in out and "choice:" in out
