"""Placement benchmark: rayflex's topology-aware plan against Ray Train's naive placement.

For each cluster shape and mesh it measures, in one run, the modeled communication seconds
per step of

* rayflex: ``Planner.plan``;
* naive: what Ray Train does, one PACK placement group with ranks filling nodes in the order
  Ray lists them. Ray lists nodes in join order, which on a real cluster interleaves racks
  (nodes of every rack boot and join concurrently), so the generator lists nodes by a seeded
  shuffle and naive is measured over several seeds; the rack-sorted order, naive's best case,
  is reported too;
* the optimum by brute force where that is computable (<= 12 slots), else the planner's
  lower bound (a dynamic program over a relaxation that every real plan satisfies).

It also times planning, including a 16,384-GPU cluster. Prints one JSON object on stdout;
logs go to stderr. Usage: ``python benchmarks/placement.py [--seeds 5] [--repeats 5]``.
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
from importlib import metadata

from rayflex.planning.placement.planner import CommProfile, MeshShape, Planner, brute_force_plan, naive_plan
from rayflex.planning.topology import NodeInfo, Topology

log = logging.getLogger("benchmarks.placement")

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
    mesh = MeshShape(pp, dp)
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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5, help="node orders per case")
    parser.add_argument("--repeats", type=int, default=3, help="planning repetitions per order")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    results, ratios, goals = {}, {}, {}
    for name, nodes, gpus, racks, zones, pp, dp, model in CASES:
        results[name], ratios[name] = run_case(name, nodes, gpus, racks, zones, pp, dp, model,
                                               args.seeds, args.repeats)
        goals[name] = {"within_5pct_of_optimum": ratios[name]["rayflex_over_optimum"] <= 1.05}
        if racks > 1 and nodes * gpus > 12:  # the multi-rack cases
            goals[name]["at_most_half_of_naive"] = ratios[name]["rayflex_over_naive_mean"] <= 0.5
    big = CASES[-1][0]
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
    }, indent=2))


if __name__ == "__main__":
    main()
