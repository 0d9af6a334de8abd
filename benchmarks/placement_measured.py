"""``benchmarks/placement.py --measured``: placements measured on the link bed, the model beside them.

    sudo python benchmarks/placement.py --measured [--rounds 3] [--steps 16] [--scale 1e-3]
        [--topologies examples/topologies/bed_two_racks.yaml,examples/topologies/bed_two_zones_spot.yaml]

For each topology, on one link bed (``rayflex.testing.linkbed``; every pair of nodes shaped to
its tier x the scale), each of six 4-rank layouts (FSDP, HSDP 2x2, DDP, pp2 x FSDP2,
pp2 x DDP2, pp4) trains ``--steps`` steps with the ranks placed three ways
(``ScalingConfig.placement``): the planner's layout, Ray Train's node order (``naive_plan``:
the nodes by address, the order they joined the bed, so the racks and zones interleave) and
a seeded shuffle. Layouts and orders
alternate within each of ``--rounds`` rounds. Per run: the median step time after the first
4 steps (``--steps`` steps at least, and enough to measure ``MEASURE_WINDOW_S`` seconds of
the layout's unshaped step) and the bytes per step over each link tier (tc's counters).

Modelled beside each: the step's compute and everything but the links, measured per round
and layout with every link at the topology's own speed (which loopback cannot reach:
effectively free), plus the cost model's communication seconds for the assignment that
actually ran, at the bed's bandwidths. Three model figures: ``model`` (only what the step
cannot hide behind that compute, ``rayflex.planning.step_model``), ``model_full_charge``
(the cost model as the planner uses it: rings at the link's full rate, no overlap) and ``model_gloo2``
(the same terms times the time factors ``benchmarks/results/linkbed_calibrate.json``
measured for gloo in two-rank groups, where its all-gather and all-reduce ran at ~half the
link's rate and its reduce-scatter moved twice the bytes, applied to the full charge). Summary
per topology: error of each figure per run, the Spearman
rank correlation of modelled and measured step times over all runs, and the planner's
measured margin over node order against the modelled one. ``placement.py --remodel [JSON]``
recomputes all of it from a JSON's measured step times and baselines (:func:`remodel`).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOPOLOGIES = [ROOT / "examples" / "topologies" / "bed_two_racks.yaml",
              ROOT / "examples" / "topologies" / "bed_two_zones_spot.yaml"]
CALIBRATION = ROOT / "benchmarks" / "results" / "linkbed_calibrate.json"
LAYOUTS = {"fsdp4": {}, "hsdp2x2": {"dp_shard": 2}, "ddp4": {"dp_shard": 1},
           "pp2_fsdp2": {"pp": 2, "microbatches": 4}, "pp2_ddp2": {"pp": 2, "microbatches": 4, "dp_shard": 1},
           "pp4": {"pp": 4, "microbatches": 4}}
ORDERS = ("planned", "node_order", "shuffled")
WARM_STEPS = 4
# A run measures at least this many seconds of steps after its warm-up (``--steps`` is the
# floor): a 60 ms pipeline step moves +-20% from one step to the next on a shared 2-core
# host, so short steps need more of them for a median that holds still.
MEASURE_WINDOW_S = 2.0
SEQ_LEN = 32


def _trainer(root: str, name: str, layout: str, placement: str, steps: int):
    import rayflex as rf
    from rayflex.models import GPTConfig, gpt

    return rf.Trainer(model=gpt(GPTConfig(vocab_size=128, seq_len=SEQ_LEN, d_model=64, n_layers=4, n_heads=2)),
                      data=rf.DataConfig(uri=f"file://{root}/tokens", seq_len=SEQ_LEN, global_batch=8),
                      run=rf.RunConfig(name=name, storage=f"file://{root}/runs", steps=steps,
                                       optimizer=rf.OptimizerConfig(lr=1e-2, warmup_steps=2)),
                      scaling=rf.ScalingConfig(num_workers=4, placement=placement),
                      parallel=rf.ParallelConfig(**LAYOUTS[layout]),
                      checkpoint=rf.CheckpointConfig(every_steps=10_000))


def _run(bed, root: str, layout: str, placement: str, steps: int, tag: str) -> dict:
    from rayflex.testing.linkbed.links import subtract

    name = f"{layout}-{placement.replace(':', '')}-{tag}"
    handle = _trainer(root, name, layout, placement, steps).submit()
    deadline = time.time() + 600
    while not handle.done() and handle.status()["step"] < WARM_STEPS:
        assert time.time() < deadline, handle.status()
        time.sleep(0.05)
    first, before = handle.status()["step"], bed.counters()
    result = handle.wait(timeout_s=600)
    traffic = subtract(bed.counters(), before)
    counted = max(1, result.steps_completed - first)
    times = [m["step_time_s"] for m in handle.metrics() if m["step"] > WARM_STEPS]
    ray_to_bed = {bed.ray_node_id(n.node_id): n.node_id for n in bed.topology.nodes}
    events = [json.loads(line) for line in (Path(root) / "runs" / name / "events.jsonl").read_text().splitlines()]
    chosen = next(e for e in events if e["kind"] == "plan_chosen")
    return {"layout": layout, "placement": placement, "step_s": statistics.median(times),
            "bytes_per_step": {k: v / counted for k, v in traffic["by_tier"].items()},
            "rank_to_node": [ray_to_bed[n] for n in chosen["rank_to_node"]], "status": result.status}


def measure_on_bed(bed) -> dict:
    """Runs in the bed's process (``--call``)."""
    from rayflex.data.dataset import write_synthetic_dataset

    root, steps, rounds = os.environ["MEASURE_DIR"], int(os.environ["MEASURE_STEPS"]), int(os.environ["MEASURE_ROUNDS"])
    write_synthetic_dataset(f"file://{root}/tokens", num_samples=512, seq_len=SEQ_LEN, vocab_size=128,
                            num_shards=2, seed=7)
    shaped = bed.plan.scale
    baseline, rows, layouts = [], [], list(LAYOUTS)
    step_s: dict = {}  # layout -> its latest unshaped step time

    def steps_for(layout: str) -> int:
        if layout not in step_s:
            return steps
        return max(steps, WARM_STEPS + 1 + math.ceil(MEASURE_WINDOW_S / step_s[layout]))

    for rnd in range(rounds):
        bed.rescale(1.0)  # the baseline: links at the topology's own speed
        for layout in layouts:
            baseline.append({"round": rnd, **_run(bed, root, layout, "planned", steps_for(layout), f"free{rnd}")})
            step_s[layout] = baseline[-1]["step_s"]
        bed.rescale(shaped)
        for i in range(len(layouts)):
            layout = layouts[(i + rnd) % len(layouts)]
            for j in range(len(ORDERS)):
                order = ORDERS[(j + rnd) % len(ORDERS)]
                placement = "shuffled:7" if order == "shuffled" else order
                rows.append({"round": rnd, **_run(bed, root, layout, placement, steps_for(layout), f"r{rnd}")})
    return {"baseline": baseline, "rows": rows, "scale": shaped, "measure_window_s": MEASURE_WINDOW_S}


# ------------------------------------------------------------------------------ the model
def time_factors() -> dict:
    """Per collective, measured time over the cost model's (median over the tiers)."""
    tiers = json.loads(CALIBRATION.read_text())["tiers"]
    return {op: statistics.median(1 / t[op]["beta_over_model"] for t in tiers.values())
            for op in ("all_gather", "reduce_scatter", "all_reduce", "send_recv")}


def layout_plan(topology, layout: str):
    """The plan (mesh, profile) of ``layout`` on ``topology`` and its FSDP units per stage."""
    trainer = _trainer("/nowhere", "model", layout, "planned", 1)
    plan = trainer.plan(topology)
    return plan, max(1, trainer.spec.model.num_blocks // plan.mesh.pp)


def modelled_comm(topology, layout: str, rank_to_node: list, scale: float, factors: dict,
                  baseline_s: float = 0.0) -> dict:
    """The cost model's seconds for an assignment at the bed's bandwidths: raw (every
    collective charged in full), with gloo's measured time per collective, and the part a
    step cannot hide behind the layout's compute (``rayflex.planning.step_model``, the
    compute being ``baseline_s``, the same layout's step on unshaped links)."""
    from dataclasses import fields

    from rayflex.planning.cost_model import modeled_comm
    from rayflex.planning.step_model import exposed_comm
    from rayflex.planning.topology import Bandwidths

    plan, units = layout_plan(topology, layout)
    bw = topology.bandwidths
    scaled = Bandwidths(**{f.name: getattr(bw, f.name) * scale for f in fields(Bandwidths)})
    b = modeled_comm(topology, plan.mesh, plan.profile, rank_to_node, scaled)
    n = plan.profile.fsdp_collectives
    fsdp = ((n - 1) * factors["all_gather"] + factors["reduce_scatter"]) / n
    calibrated = (sum(b.fsdp_s) * fsdp + sum(b.replica_s) * factors["all_reduce"]
                  + sum(b.p2p_s) * factors["send_recv"] + b.tp_total * factors["all_reduce"])
    exposed = exposed_comm(plan.mesh, plan.profile, b, baseline_s, units=units)
    return {"raw_s": b.total, "calibrated_s": calibrated, "exposed_s": exposed.total, "exposed": exposed.to_dict()}


def spearman(xs: list, ys: list) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


MODEL = ("model_s: the layout's step on unshaped links (baseline_s, same run) + the communication the step "
         "cannot hide (rayflex.planning.step_model: pipeline sends only in fill and drain, reductions behind "
         "the backward left or staggered across stages); model_full_charge_s: baseline + every collective "
         "charged in full (the cost model's seconds); model_gloo2_s: the full charge x gloo's two-rank time factors")


def summarise(topology_path: Path, bed: dict) -> dict:
    base = {layout: statistics.median(b["step_s"] for b in bed["result"]["baseline"] if b["layout"] == layout)
            for layout in LAYOUTS}
    cells: dict = {}
    for row in bed["result"]["rows"]:
        key = (row["layout"], row["placement"])
        cell = cells.setdefault(key, {"layout": row["layout"], "placement": row["placement"], "step_s": [],
                                      "rank_to_node": row["rank_to_node"], "bytes_per_step": row["bytes_per_step"]})
        cell["step_s"].append(row["step_s"])
        assert cell["rank_to_node"] == row["rank_to_node"], "an order placed the ranks differently across rounds"
    runs = [{**cell, "measured_s": statistics.median(cell["step_s"]),
             "spread_s": [min(cell["step_s"]), max(cell["step_s"])], "baseline_s": base[cell["layout"]]}
            for cell in cells.values()]
    return model_columns(topology_path, bed["result"]["scale"], runs)


def model_columns(topology_path: Path, scale: float, runs: list) -> dict:
    """Every model column, error, margin and rank correlation of ``runs`` (each with its
    layout, placement, rank_to_node, measured_s and baseline_s), from those fields alone:
    what ``--measured`` reports and ``--remodel`` recomputes."""
    from rayflex.planning.topology import Topology

    topology = Topology.from_file(topology_path if topology_path.is_absolute() else ROOT / topology_path)
    factors = time_factors()
    out = []
    for run in runs:
        measured, baseline = run["measured_s"], run["baseline_s"]
        comm = modelled_comm(topology, run["layout"], run["rank_to_node"], scale, factors, baseline)
        model, full, gloo = baseline + comm["exposed_s"], baseline + comm["raw_s"], baseline + comm["calibrated_s"]
        kept = {k: v for k, v in run.items() if not k.startswith("model")}
        out.append({**kept, "model_s": model, "model_full_charge_s": full, "model_gloo2_s": gloo,
                    "model_error": model / measured - 1, "model_full_charge_error": full / measured - 1,
                    "model_gloo2_error": gloo / measured - 1, "model_exposed": comm["exposed"]})
    by = {(c["layout"], c["placement"]): c for c in out}
    margins = {}
    for layout in dict.fromkeys(c["layout"] for c in out):
        p, n = by[(layout, "planned")], by[(layout, "node_order")]
        measured = n["measured_s"] - p["measured_s"]
        margins[layout] = {"measured_s": measured}
        for name, key in (("", "model_s"), ("_full_charge", "model_full_charge_s")):
            modelled = n[key] - p[key]
            margins[layout].update({f"modelled{name}_s": modelled,
                                    f"measured_over_modelled{name}": measured / modelled if modelled > 1e-9 else None})
    measured = [c["measured_s"] for c in out]
    summary = {"topology": str(topology_path.relative_to(ROOT)) if topology_path.is_absolute() else str(topology_path),
               "scale": scale, "time_factors": factors, "model": MODEL, "runs": out,
               "planner_margin_over_node_order": margins}
    for name in ("model", "model_full_charge", "model_gloo2"):
        errors = [abs(c[f"{name}_error"]) for c in out]
        summary.update({f"spearman_{name}": spearman([c[f"{name}_s"] for c in out], measured),
                        f"max_abs_{name}_error": max(errors),
                        f"{name}_runs_within_20pct": sum(e <= 0.2 for e in errors)})
    return summary


def remodel(path: Path) -> dict:
    """``path``'s committed results with every model column recomputed from its measured
    step times and baselines (unchanged): the model changes, the measurements do not."""
    data = json.loads(path.read_text())
    keep = ("wall_s", "traffic_total")
    data["results"] = [{**model_columns(Path(r["topology"]), r["scale"], r["runs"]),
                        **{k: r[k] for k in keep if k in r}} for r in data["results"]]
    return data


def run(topologies: list, rounds: int, steps: int, scale: float) -> list:
    from common import on_linkbed

    results = []
    for path in topologies:
        with tempfile.TemporaryDirectory(prefix="rayflex-placement-") as tmp:
            t0 = time.time()
            bed = on_linkbed(path, scale, "placement_measured:measure_on_bed",
                             {"MEASURE_DIR": tmp, "MEASURE_STEPS": str(steps), "MEASURE_ROUNDS": str(rounds)}, tmp)
        results.append({**summarise(Path(path), bed), "wall_s": round(time.time() - t0, 1),
                        "traffic_total": bed["traffic"]["by_tier"]})
    return results
