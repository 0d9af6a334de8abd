"""Capacity planner: search time on a 1,024-node cluster description, and the memory model
against the measured peak memory of real rayflex workers on CPU.

    python benchmarks/capacity.py            # every CPU configuration (a few minutes)
    python benchmarks/capacity.py --quick    # the four the test suite runs

Prints one JSON object on stdout; logs go to stderr.

* search: ``rayflex.planning.capacity.search.search`` for a 7B and a 70B model on 1,024
  nodes x 8 H100-80GB (racks of 32 nodes, zones of 16 racks), global batch 16,384 samples,
  over every pp x dp x tp layout (tp in 1, 2, 4, 8; FSDP or node/rack/zone-local HSDP):
  the first call (cold caches) and the median of five more. Goal: < 2 s.
* memory_model: for each configuration, every rank's predicted peak (the model) and
  measured peak (anonymous RSS high-water mark of a real TrainWorker process minus its
  baseline; see benchmarks/capacity_measure.py) and the relative error.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import emit, machine, setup_logging  # noqa: E402

log = logging.getLogger("benchmarks.capacity")


def search_timing(repeats: int = 5) -> dict:
    from rayflex.planning.capacity.memory import preset
    from rayflex.planning.capacity.search import ClusterDescription, DeviceSpec, search

    cluster = ClusterDescription.uniform(nodes=1024, devices_per_node=8, device=DeviceSpec.h100_80gb(),
                                         nodes_per_rack=32, racks_per_zone=16)
    out = {"cluster": {"nodes": 1024, "devices_per_node": 8, "device": "H100-80GB", "nodes_per_rack": 32,
                       "racks_per_zone": 16, "world_size": cluster.slots}, "global_batch": 16384, "models": {}}
    for name in ("7b", "70b"):
        model = preset(name)
        t0 = time.perf_counter()
        result = search(model, cluster, global_batch=16384)
        first = time.perf_counter() - t0
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            search(model, cluster, global_batch=16384)
            times.append(time.perf_counter() - t0)
        best = result.best
        out["models"][name] = {"params": model.total_params, "seq_len": model.seq_len,
                               "candidates": len(result.candidates), "fitting": len(result.fitting),
                               "first_search_s": first, "search_s_median": statistics.median(times),
                               "search_s_max": max(times), "choice": best.label(),
                               "choice_pp": best.layout.pp, "choice_tp": best.layout.tp, "choice_dp": best.layout.dp,
                               "choice_dp_shard": best.layout.dp_shard,
                               "tp_degrees_searched": sorted({c.layout.tp for c in result.candidates}),
                               "choice_peak_bytes": best.peak_bytes, "choice_step_s": best.step_s}
        log.warning("search %s: first %.3f s, median %.3f s, %d candidates -> %s", name, first,
                    statistics.median(times), len(result.candidates), best.label())
    out["search_s_max_over_models"] = max(m["search_s_max"] for m in out["models"].values())
    out["goal_s"] = 2.0
    return out


def memory_validation(quick: bool) -> dict:
    import capacity_measure as cm

    configs = cm.CORE if quick else cm.ALL
    rows = []
    t0 = time.perf_counter()
    with cm.MeasurePool(4) as pool:
        for cfg in configs:
            got = cm.compare(pool, cfg)
            for r in got:
                log.warning("%-24s rank %d: predicted %7.1f MB measured %7.1f MB error %+6.1f%%", r["config"],
                            r["rank"], r["predicted_peak_bytes"] / 1e6, r["measured_peak_bytes"] / 1e6,
                            100 * r["relative_error"])
            rows.extend(got)
    per_config = {}
    for r in rows:
        c = per_config.setdefault(r["config"], {"pp": r["pp"], "dp": r["dp"], "schedule": r["schedule"],
                                                "microbatches": r["microbatches"], "micro_batch": r["micro_batch"],
                                                "accum_steps": r["accum_steps"],
                                                "stages_per_rank": r["stages_per_rank"], "ranks": []})
        c["ranks"].append({k: r[k] for k in ("rank", "pp_index", "predicted_peak_bytes", "measured_peak_bytes",
                                             "relative_error", "predicted_phase", "predicted_setup_bytes",
                                             "measured_setup_bytes", "predicted_state_bytes",
                                             "measured_state_bytes", "file_growth_bytes")})
    for c in per_config.values():
        c["max_abs_relative_error"] = max(abs(r["relative_error"]) for r in c["ranks"])
    errors = [abs(r["relative_error"]) for r in rows]
    return {"workload": {"model": "gpt d_model=256 n_layers=4 (6 for pp=4) vocab=256", "seq_len": 128,
                         "global_batch": 16, "steps": 2, "processes": "torch.multiprocessing spawn, gloo, 1 thread"},
            "configs": per_config, "ranks_measured": len(rows),
            "ranks_within_15_percent": sum(e <= 0.15 for e in errors),
            "max_abs_relative_error": max(errors), "mean_abs_relative_error": statistics.mean(errors),
            "wall_s": time.perf_counter() - t0}


def main() -> None:
    setup_logging()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the four configurations the tests run")
    parser.add_argument("--skip-measure", action="store_true", help="search timing only")
    args = parser.parse_args()
    import rayflex.planning.capacity.search  # noqa: F401 - imports outside the timed region

    results = {"search": search_timing()}
    if not args.skip_measure:
        results["memory_model"] = memory_validation(args.quick)
    ratios = {"search_s_over_goal": results["search"]["search_s_max_over_models"] / 2.0}
    if "memory_model" in results:
        ratios["predicted_over_measured_peak_max_abs_error"] = results["memory_model"]["max_abs_relative_error"]
    emit({"benchmark": "capacity", "machine": machine(),
          "workload": {"search": "7B and 70B on 1,024 x 8 H100-80GB, global batch 16,384",
                       "memory": "real TrainWorkers on CPU, predicted vs measured peak per rank"},
          "results": results, "ratios": ratios})


if __name__ == "__main__":
    main()
