"""Placement benchmark: rayflex's topology-aware plan against Ray Train's naive placement.

For each cluster shape and mesh it measures, in one run, the modeled communication seconds
per step of

* rayflex: ``Planner.plan``;
* naive: what Ray Train does, one PACK placement group with ranks filling nodes in node
  order (``naive_plan``: by address, which on a real cluster follows the join order and
  interleaves racks, as nodes of every rack boot and join concurrently), so the generator
  lists nodes by a seeded shuffle and naive is measured over several seeds; the rack-sorted
  order, naive's best case, is reported too;
* the optimum by brute force where that is computable (<= 12 slots), else the planner's
  lower bound (a dynamic program over a relaxation that every real plan satisfies).

It also times planning, including a 16,384-GPU cluster.

3-D cases (``three_d`` in the JSON): a 70B-class model (the ``70b`` preset: 80 layers x 8192,
bf16 with fp32 master weights, seq 1024) on 64 nodes x 8 H100 in 2 racks
(``examples/clusters/h100_64x8_2racks.yaml``) and on ``examples/clusters/h100_8x8.yaml``. For
each, the modeled *step* time (compute + TP all-reduces + bubble + placed communication, the
capacity planner's model) and memory per rank of

* rayflex: the capacity search's layout (pp x dp x tp, FSDP or HSDP), placed by the Planner;
* best_pp_x_dp: the best layout without tensor parallelism or HSDP (rayflex's planner before
  this work), placed by the Planner;
* megatron: Megatron-LM's hand rule for this size, tp = 8 (the node), pp = 4 across nodes,
  dp = the rest, 1F1B, micro-batch 1 (Narayanan et al. 2021, Table 1, the 76.1B row), run
  with FSDP over dp and placed by the Planner; ``nemo_llama3_70b`` adds NVIDIA NeMo's
  llama3_70b recipe (tp 4, pp 4, interleaved v=5; its context parallelism 2 folded into dp,
  rayflex has none);
* ray_train_pack: rayflex's layout with Ray Train's placement (one PACK group, ranks in the
  node order Ray lists: a seeded shuffle of join order, mean over seeds).

The goal: rayflex's layout is the fastest of them by the model and fits in memory.

Prints one JSON object on stdout; logs go to stderr.
Usage: ``python benchmarks/placement.py [--seeds 5] [--repeats 5] [--only-3d]``; ``--measured`` on the link
bed (``placement_measured.py``); ``--remodel [JSON]`` recomputes a measured JSON's model columns.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from importlib import metadata

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rayflex.mesh.plan import MeshPlan
from rayflex.planning.capacity.memory import preset
from rayflex.planning.capacity.search import ClusterDescription, evaluate_layout, search
from rayflex.planning.capacity.step_time import layout_profile, placed_breakdown
from rayflex.planning.placement.planner import CommProfile, Planner, brute_force_plan, naive_plan
from rayflex.planning.topology import NodeInfo, Topology

log = logging.getLogger("benchmarks.placement")
RESULTS = Path(__file__).resolve().parent / "results"

# name, nodes, GPUs per node, racks, zones, pp, dp, model
CASES = [
    ("small_12gpu_brute_force", 6, 2, 3, 2, 3, 4, "8b"),
    ("64gpu_8nodes_2racks", 8, 8, 2, 1, 4, 16, "8b"),
    ("512gpu_64nodes_8racks_2zones", 64, 8, 8, 2, 8, 64, "70b"),
    ("16384gpu_2048nodes_32racks_2zones", 2048, 8, 32, 2, 8, 2048, "70b"),
]

# Llama-style models in bf16: parameters, hidden size; sequence 8192, micro-batch 1 sequence.
MODELS = {"8b": (8.0e9, 4096), "70b": (70.6e9, 8192)}
SEQ_LEN, BYTES = 8192, 2


def transformer_profile(model: str, pp: int, microbatches: int) -> CommProfile:
    """Parameters split evenly over stages; one micro-batch's hidden states cross a boundary."""
    params, hidden = MODELS[model]
    return CommProfile.uniform(pp, params * BYTES, SEQ_LEN * hidden * BYTES, microbatches)


def cluster(nodes: int, gpus: int, racks: int, zones: int, order_seed=None) -> Topology:
    """Equal nodes in equal racks and zones, listed in a seeded join order (None: rack order)."""
    per_rack, racks_per_zone = nodes // racks, racks // zones
    out = [NodeInfo(f"gpu-{i:05d}", slots=gpus,
                    labels={"rack": f"r{i // per_rack:02d}",
                            "ray.io/availability-zone": f"zone-{i // per_rack // racks_per_zone}"})
           for i in range(nodes)]
    if order_seed is not None:
        random.Random(order_seed).shuffle(out)
    return Topology(tuple(out))


def timed(fn, repeats):
    times, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - started)
    return result, times


def run_case(name, nodes, gpus, racks, zones, pp, dp, model, seeds, repeats):
    mesh = MeshPlan(pp, dp)
    profile = transformer_profile(model, pp, microbatches=4 * pp)
    log.info("%s: pp=%d x dp=%d on %d nodes", name, pp, dp, nodes)
    rayflex, naive, plan_times = [], [], []
    for seed in range(seeds):
        topology = cluster(nodes, gpus, racks, zones, order_seed=seed)
        plan, times = timed(lambda: Planner(topology).plan(mesh, profile), repeats)
        plan_times += times
        rayflex.append(plan)
        naive.append(naive_plan(topology, mesh, profile).modeled_comm_s)
    sorted_naive = naive_plan(cluster(nodes, gpus, racks, zones), mesh, profile).modeled_comm_s
    best = rayflex[0]
    row = {
        "gpus": nodes * gpus, "nodes": nodes, "racks": racks, "zones": zones, "pp": pp, "dp": dp,
        "model": model, "param_bytes_per_stage": profile.stage_param_bytes[0],
        "activation_bytes_per_microbatch": profile.activation_bytes, "microbatches": profile.microbatches,
        "node_order": f"seeded shuffle of join order, seeds 0..{seeds - 1}",
        "rayflex_comm_s_per_step": statistics.mean(p.modeled_comm_s for p in rayflex),
        "rayflex_proven_optimal": all(p.optimal for p in rayflex),
        "rayflex_method": best.method,
        "naive_comm_s_per_step_mean": statistics.mean(naive),
        "naive_comm_s_per_step_min": min(naive),
        "naive_comm_s_per_step_max": max(naive),
        "naive_rack_sorted_order_comm_s_per_step": sorted_naive,
        "planning_s_median": statistics.median(plan_times),
        "planning_s_max": max(plan_times),
    }
    if nodes * gpus <= 12:
        reference = brute_force_plan(cluster(nodes, gpus, racks, zones, order_seed=0), mesh, profile)
        row["optimum_kind"] = "brute_force"
        row["optimum_comm_s_per_step"] = reference.modeled_comm_s
    else:
        row["optimum_kind"] = "lower_bound"
        row["optimum_comm_s_per_step"] = max(p.lower_bound_s for p in rayflex)
    ratios = {
        "rayflex_over_naive_mean": row["rayflex_comm_s_per_step"] / row["naive_comm_s_per_step_mean"],
        "rayflex_over_naive_worst_seed": max(p.modeled_comm_s / n for p, n in zip(rayflex, naive)),
        "rayflex_over_naive_rack_sorted": row["rayflex_comm_s_per_step"] / sorted_naive,
        "rayflex_over_optimum": row["rayflex_comm_s_per_step"] / row["optimum_comm_s_per_step"],
    }
    log.info("%s: rayflex %.4g s, naive %.4g s (mean), optimum %.4g s, planning %.3f s",
             name, row["rayflex_comm_s_per_step"], row["naive_comm_s_per_step_mean"],
             row["optimum_comm_s_per_step"], row["planning_s_max"])
    log.info("%s plan:\n%s", name, best.explanation)
    return row, ratios


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# name, cluster description, global batch
CASES_3D = [
    ("70b_512gpu_64nodes_2racks", os.path.join(ROOT, "examples", "clusters", "h100_64x8_2racks.yaml"), 1024),
    ("70b_64gpu_h100_8x8", os.path.join(ROOT, "examples", "clusters", "h100_8x8.yaml"), 512),
]


def shuffled(cluster: ClusterDescription, seed: int) -> ClusterDescription:
    """The same cluster with its nodes listed in a seeded join order (what Ray reports)."""
    nodes = list(cluster.topology.nodes)
    random.Random(seed).shuffle(nodes)
    return ClusterDescription(topology=Topology(tuple(nodes), cluster.topology.bandwidths), device=cluster.device,
                              memory_margin=cluster.memory_margin, runtime=cluster.runtime)


def placed(model, cluster, candidate, global_batch, plan):
    """A candidate's memory and step time with its communication at ``plan``'s placement."""
    comm = placed_breakdown(model, candidate.layout, global_batch, cluster.topology, plan.rank_to_node)
    return evaluate_layout(model, cluster, candidate.layout, global_batch, comm)


def layout_row(c, plan=None, **extra) -> dict:
    lay = c.layout
    row = {"layout": c.label(), "pp": lay.pp, "dp": lay.dp, "tp": lay.tp, "dp_shard": lay.dp_shard,
           "dp_replicate": lay.dp_replicate, "schedule": lay.schedule, "stages_per_rank": lay.stages_per_rank,
           "microbatches": lay.microbatches, "micro_batch": lay.micro_batch,
           "fits": c.fits, "peak_gb_per_rank": round(c.peak_bytes / 1e9, 2),
           "usable_gb_per_rank": round(c.usable_bytes / 1e9, 2),
           "step_s": c.step_s, "compute_s": c.compute_s, "tp_s": c.tp_s, "bubble_s": c.bubble_s,
           "comm_s": c.comm_s}
    if plan is not None:
        row["placement"] = {"method": plan.method, "optimal": plan.optimal,
                            "modeled_comm_s": plan.modeled_comm_s, "lower_bound_s": plan.lower_bound_s}
    row.update(extra)
    return row


def pick(result, *, pp, tp, schedule, stages_per_rank=1):
    """The micro-batch-1 candidate of a hand layout (the most microbatches, plain FSDP)."""
    rows = [c for c in result.candidates if (c.layout.pp, c.layout.tp, c.layout.schedule, c.layout.stages_per_rank,
                                             c.layout.micro_batch, c.layout.dp_replicate)
            == (pp, tp, schedule, stages_per_rank, 1, 1)]
    if not rows:
        raise ValueError(f"no candidate pp={pp} tp={tp} {schedule} v={stages_per_rank} micro-batch 1")
    return rows[0]


def run_3d_case(name, path, global_batch, seeds):
    model = preset("70b")
    base = ClusterDescription.from_file(path)
    cluster = shuffled(base, 0)
    log.info("%s: %s, global batch %d", name, base.describe(), global_batch)
    started = time.perf_counter()
    result = search(model, cluster, global_batch=global_batch)
    search_s = time.perf_counter() - started
    planner = Planner(cluster.topology)

    def placed_by_planner(c):
        plan = planner.plan(c.layout, layout_profile(model, c.layout, global_batch))
        return placed(model, cluster, c, global_batch, plan), plan

    chosen, chosen_plan = placed_by_planner(result.best)
    flat = search(model, cluster, global_batch=global_batch, tp=[1], hsdp=False).best  # pp x dp only
    flat_placed, flat_plan = placed_by_planner(flat)
    hand = search(model, cluster, global_batch=global_batch, tp=[4, 8], hsdp=False, require_fit=False,
                  max_stages_per_rank=5)
    megatron, megatron_plan = placed_by_planner(pick(hand, pp=4, tp=8, schedule="1f1b"))
    nemo, nemo_plan = placed_by_planner(pick(hand, pp=4, tp=4, schedule="interleaved", stages_per_rank=5))
    pack = []
    for seed in range(seeds):  # Ray Train: the chosen layout, ranks in Ray's node order
        order = shuffled(base, seed)
        plan = naive_plan(order.topology, chosen.layout, layout_profile(model, chosen.layout,
                                                                                     global_batch))
        pack.append(placed(model, order, chosen, global_batch, plan))
    pack_mean = statistics.mean(c.step_s for c in pack)
    rows = {
        "rayflex": layout_row(chosen, chosen_plan, search_s=search_s),
        "best_pp_x_dp": layout_row(flat_placed, flat_plan),
        "megatron": layout_row(megatron, megatron_plan,
                               rule="Megatron-LM (Narayanan et al. 2021, Table 1, 76.1B row): tp=8 inside the "
                                    "node, pp=4 across nodes, dp = the rest, 1F1B, micro-batch 1; FSDP over dp"),
        "nemo_llama3_70b": layout_row(nemo, nemo_plan,
                                      rule="NeMo llama3_70b recipe: tp=4, pp=4, interleaved v=5, micro-batch 1; "
                                           "its context parallelism 2 folded into dp (rayflex has none)"),
        "ray_train_pack": layout_row(pack[0], None, step_s=pack_mean, step_s_min=min(c.step_s for c in pack),
                                     step_s_max=max(c.step_s for c in pack),
                                     node_order=f"seeded shuffle of join order, seeds 0..{seeds - 1}"),
    }
    step = {k: v["step_s"] for k, v in rows.items()}
    fitting_peers = {k: s for k, s in step.items() if k != "rayflex" and rows[k]["fits"]}
    goals = {"rayflex_fits": chosen.fits,
             "rayflex_fastest_by_the_model": all(step["rayflex"] <= s * (1 + 1e-9) for s in fitting_peers.values()),
             "rayflex_has_tp": chosen.layout.tp > 1}
    log.info("%s: rayflex %s %.3f s; pp x dp %.3f s; megatron %.3f s; ray train pack %.3f s", name,
             chosen.label(), step["rayflex"], step["best_pp_x_dp"], step["megatron"], step["ray_train_pack"])
    return {"cluster": os.path.relpath(path, ROOT), "global_batch": global_batch, "model": model.name,
            "total_params": model.total_params, "step_s": step,
            "speedup_vs": {k: s / step["rayflex"] for k, s in step.items() if k != "rayflex"},
            "layouts": rows, "goals": goals}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5, help="node orders per case")
    parser.add_argument("--repeats", type=int, default=3, help="planning repetitions per order")
    parser.add_argument("--only-3d", action="store_true", help="only the 3-D layout cases")
    parser.add_argument("--measured", action="store_true",
                        help="measure placements on the link bed (root; benchmarks/placement_measured.py)")
    parser.add_argument("--rounds", type=int, default=3, help="--measured: alternating rounds")
    parser.add_argument("--steps", type=int, default=16, help="--measured: steps per run")
    parser.add_argument("--scale", type=float, default=1e-3, help="--measured: the bed's link scale")
    parser.add_argument("--topologies", default=None, help="--measured: comma-separated topology files")
    parser.add_argument("--out", default=None, help="--measured / --remodel: also write the JSON here")
    parser.add_argument("--remodel", nargs="?", const=str(RESULTS / "placement_measured.json"), default=None,
                        metavar="JSON", help="recompute every model column of a --measured JSON from its measured "
                        "step times (unchanged) and write it back (default: the committed results); no bed, no Ray")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    if args.remodel:
        import placement_measured as pm

        path = Path(args.remodel)
        data = pm.remodel(path)
        text = json.dumps(data, indent=2, default=float) + "\n"
        Path(args.out or path).write_text(text)
        print(text, end="")
        return
    if args.measured:
        import placement_measured as pm
        from common import emit, machine

        topologies = [Path(p).resolve() for p in args.topologies.split(",")] if args.topologies else pm.TOPOLOGIES
        emit({"benchmark": "placement_measured", "machine": machine(), "command": " ".join(["python", *sys.argv]),
              "rounds": args.rounds, "steps": args.steps, "measure_window_s": pm.MEASURE_WINDOW_S,
              "results": pm.run(topologies, args.rounds, args.steps, args.scale)}, args.out)
        return
    results, ratios, goals = {}, {}, {}
    three_d = {name: run_3d_case(name, path, batch, args.seeds) for name, path, batch in CASES_3D}
    for name, nodes, gpus, racks, zones, pp, dp, model in CASES if not args.only_3d else ():
        results[name], ratios[name] = run_case(name, nodes, gpus, racks, zones, pp, dp, model,
                                               args.seeds, args.repeats)
        goals[name] = {"within_5pct_of_optimum": ratios[name]["rayflex_over_optimum"] <= 1.05}
        if racks > 1 and nodes * gpus > 12:  # the multi-rack cases
            goals[name]["at_most_half_of_naive"] = ratios[name]["rayflex_over_naive_mean"] <= 0.5
    big = CASES[-1][0]
    if big in results:
        goals[big]["planning_under_1s"] = results[big]["planning_s_max"] < 1.0

    def version(pkg):
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    print(json.dumps({
        "benchmark": "placement",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": version("torch"), "ray": version("ray")},
        "workload": {"models": {k: {"params": p, "hidden": h, "seq_len": SEQ_LEN, "bytes_per_value": BYTES}
                                for k, (p, h) in MODELS.items()},
                     "seeds": args.seeds, "repeats": args.repeats,
                     "cost_model": "sum over stages of FSDP ring time at the group's worst link + "
                                   "sum over boundaries of the slowest pipeline's activation time"},
        "results": results,
        "ratios": ratios,
        "goals": goals,
        "three_d": three_d,
    }, indent=2))


if __name__ == "__main__":
    main()
