"""Goodput under spot preemptions, measured in one run on a local 4-node cluster:

* rayflex with preemption notices (notice 20 s before the node goes; the node is removed
  at the deadline; a replacement node joins 30 s later), one every ``--period`` seconds;
* the same run without preemptions (the peer: what the hardware gives);
* the same preemptions with a policy that only restores the last periodic checkpoint
  (emergency checkpoints disabled by an impossible safety margin).

    python benchmarks/goodput.py [--minutes 5] [--period 60]

``--interval-sweep``: ``CheckpointConfig(every_steps="auto")`` against fixed intervals
(``--fixed 5,10,20,40``), each for ``--minutes`` under the same seeded schedule of node
losses *without* notice (so the work since the last checkpoint is lost), one every
``--period`` s, in ``--rounds`` alternating rounds; goal: auto's median steps per second
within 5% of the best fixed interval's.

Goodput = useful committed step time / wall time (rayflex.telemetry.goodput); throughput =
committed steps per wall second. Goal: rayflex with preemptions >= 0.85 x no preemptions.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import emit, machine, setup_logging  # noqa: E402

WORKERS, GB, EVERY = 4, 12, 20
FOUR_NODES = [{"num_cpus": 2}] * 4  # loopback "nodes"; the head is never removed


def trainer(data: str, storage: str, name: str, steps: int, *, margin: float, every: int | str = EVERY,
            mtbf_prior_s: float = 3600.0):
    import rayflex as rf
    from rayflex.models import GPTConfig, gpt

    return rf.Trainer(model=gpt(GPTConfig(vocab_size=256, seq_len=64, d_model=64, n_layers=2, n_heads=4)),
                      data=rf.DataConfig(uri=data, seq_len=64, global_batch=GB),
                      run=rf.RunConfig(name=name, storage=storage, steps=steps),
                      scaling=rf.ScalingConfig(num_workers=WORKERS, min_workers=2),
                      checkpoint=rf.CheckpointConfig(every_steps=every, keep=2, mtbf_prior_s=mtbf_prior_s),
                      elastic=rf.ElasticConfig(max_preemptions=100, max_failures=100, emergency_margin_s=margin))


def run_with_node_losses(cluster, data: str, storage: str, name: str, minutes: float, period: float,
                         every: int | str, mtbf_prior_s: float) -> dict:
    """Train for ``minutes``; every ``period`` s the non-head node hosting the most ranks
    vanishes with no notice (the work since the last checkpoint is lost) and a replacement
    joins 10 s later. Every interval under test meets the same losses, each of which costs
    a restart (a node without ranks is never the one lost: node ids are random per cluster,
    so a seeded pick among all nodes hit ranks in one run and nothing in the next)."""
    import ray

    handle = trainer(data, storage, name, steps=100_000, margin=2.0, every=every, mtbf_prior_s=mtbf_prior_s).submit()
    t0 = time.time()
    head = ray.get_runtime_context().get_node_id()
    next_loss, add_at, losses = t0 + period, [], 0
    while time.time() - t0 < minutes * 60:
        now = time.time()
        for when in [w for w in add_at if w <= now]:
            add_at.remove(when)
            cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1")
        if now >= next_loss:
            next_loss += period
            ranks_on: dict[str, int] = {}
            for w in handle.status().get("workers") or []:
                if w.get("node_id") and w["node_id"] != head:
                    ranks_on[w["node_id"]] = ranks_on.get(w["node_id"], 0) + 1
            victim = next((n for n in cluster.list_all_nodes()
                           if ranks_on and n.node_id == max(ranks_on, key=ranks_on.get)), None)
            if victim is not None:
                cluster.remove_node(victim)
                losses += 1
                add_at.append(now + 10)
        time.sleep(0.25)
    result = handle.stop(timeout_s=300)
    wall = time.time() - t0
    raw = result.raw
    import json

    events_file = os.path.join(storage.removeprefix("file://"), name, "events.jsonl")
    with open(events_file) as f:
        events = [json.loads(line) for line in f]
    chosen = [e for e in events if e.get("kind") == "checkpoint_interval_chosen"]
    commits = [e for e in events if e.get("kind") == "checkpoint_committed"]
    return {"every_steps": every, "wall_s": wall, "steps_completed": raw["steps_completed"],
            "steps_per_s": raw["steps_completed"] / wall, "goodput": raw.get("goodput"), "losses": losses,
            "restarts": raw.get("restarts"), "lost_steps": raw.get("lost_steps"),
            "checkpoints": len(commits), "checkpoint_steps": [e.get("step") for e in commits],
            "checkpoint_blocked_s": [round(e.get("blocked_s") or 0.0, 4) for e in commits],
            "checkpoint_total_s": [round(e.get("total_s") or 0.0, 3) for e in commits],
            "auto_choices": [{k: e.get(k) for k in ("step", "every_steps", "interval_s", "cost_s", "mtbf_s", "faults")}
                             for e in chosen]}


def interval_sweep(args, data: str, tmp: str) -> None:
    """every_steps="auto" against fixed intervals under the same node losses, in alternating
    rounds (A B C ... then reversed), each run on a fresh cluster; medians and spreads."""
    import statistics

    from rayflex.local_ray import loopback_cluster

    candidates: list = [int(x) for x in args.fixed.split(",")] + ["auto"]
    runs: dict[str, list] = {str(c): [] for c in candidates}
    loads = []
    for r in range(args.rounds):
        for every in (candidates if r % 2 == 0 else list(reversed(candidates))):
            loads.append(os.getloadavg()[0])
            with loopback_cluster(FOUR_NODES) as cluster:
                got = run_with_node_losses(cluster, data, f"file://{tmp}/runs", f"interval-{every}-{r}",
                                           args.minutes, args.period, every, args.mtbf_prior_s)
            runs[str(every)].append(got)
            print(f"round {r} every_steps={every}: {got['steps_per_s']:.3f} steps/s, "
                  f"{got['losses']} losses, {got['restarts']} restarts", file=sys.stderr)
    summary = {k: {"median_steps_per_s": statistics.median(x["steps_per_s"] for x in v),
                   "spread_steps_per_s": [min(x["steps_per_s"] for x in v), max(x["steps_per_s"] for x in v)]}
               for k, v in runs.items()}
    fixed = {k: v for k, v in summary.items() if k != "auto"}
    best = max(fixed, key=lambda k: fixed[k]["median_steps_per_s"])
    ratio = summary["auto"]["median_steps_per_s"] / fixed[best]["median_steps_per_s"]
    per_round = [a["steps_per_s"] / b["steps_per_s"] for a, b in zip(runs["auto"], runs[best])]
    emit({"benchmark": "goodput_interval", "machine": machine(),
          "workload": {"model": "gpt-2x64", "workers": WORKERS, "nodes": 4, "minutes_per_run": args.minutes,
                       "node_loss_period_s": args.period, "replacement_after_s": 10, "notice": None,
                       "mtbf_prior_s": args.mtbf_prior_s, "rounds": args.rounds,
                       "order": "alternating: the candidates in order, then reversed",
                       "load_avg_1m_before_runs": loads},
          "summary": summary, "runs": runs, "best_fixed_every_steps": int(best),
          "ratios": {"auto_over_best_fixed_median_steps_per_s": ratio,
                     "auto_over_best_fixed_per_round": per_round,
                     "per_round_spread": [min(per_round), max(per_round)]},
          "goals": {"auto_within_5pct_of_best_fixed": ratio >= 0.95}},
         out=args.out)


def run_for(cluster, data: str, storage: str, name: str, minutes: float, period: float | None,
            margin: float = 2.0) -> dict:
    """Train for ``minutes`` of wall time (then stop), preempting a node every ``period`` s."""
    import ray
    from ray.core.generated import autoscaler_pb2

    handle = trainer(data, storage, name, steps=100_000, margin=margin).submit()
    t0 = time.time()
    rng = random.Random(0)
    # (when, what, node): removals at the deadline, replacements 30 s later. Done on this
    # (the main) thread: Cluster.add_node installs signal handlers, which only works here.
    scheduled: list[tuple[float, str, object]] = []
    next_preemption = t0 + (period or 1e9)
    preemptions = 0
    gcs = ray._raylet.GcsClient(address=cluster.address)
    head = ray.get_runtime_context().get_node_id()
    while time.time() - t0 < minutes * 60:
        now = time.time()
        for item in [x for x in scheduled if x[0] <= now]:
            scheduled.remove(item)
            _, what, node = item
            if what == "remove":
                cluster.remove_node(node)
            else:
                cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1")
        if now >= next_preemption:
            next_preemption += period
            gone = {n for _, what, n in scheduled if what == "remove"}
            nodes = [n for n in cluster.list_all_nodes() if n.node_id != head and n not in gone]
            if nodes:
                victim = rng.choice(nodes)
                gcs.drain_node(victim.node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                               "benchmark spot termination", int((now + 20) * 1000))
                preemptions += 1
                scheduled += [(now + 20, "remove", victim), (now + 50, "add", None)]
        time.sleep(0.25)
    result = handle.stop(timeout_s=300)
    wall = time.time() - t0
    raw = result.raw
    return {"wall_s": wall, "steps_committed": (raw.get("last_checkpoint") or {}).get("step", 0),
            "steps_completed": raw["steps_completed"], "goodput": raw.get("goodput"),
            "committed_steps_per_s": (raw.get("last_checkpoint") or {}).get("step", 0) / wall,
            "preemptions": preemptions, "restarts": raw.get("restarts"), "lost_steps": raw.get("lost_steps")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--period", type=float, default=60.0)
    ap.add_argument("--interval-sweep", action="store_true",
                    help='every_steps="auto" vs the fixed intervals in --fixed, under node losses without notice')
    ap.add_argument("--fixed", default="5,10,20,40", help="the fixed intervals the sweep tries")
    ap.add_argument("--mtbf-prior-s", type=float, default=3600.0, help='the prior every_steps="auto" starts from')
    ap.add_argument("--rounds", type=int, default=3, help="--interval-sweep: rounds over every candidate")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    setup_logging()
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from rayflex.data.dataset import write_synthetic_dataset

    tmp = tempfile.mkdtemp(prefix="rayflex-bench-")
    try:
        data = write_synthetic_dataset(f"file://{tmp}/data", num_samples=4096, seq_len=64)
        if args.interval_sweep:
            return interval_sweep(args, data, tmp)
        preemptions(args, data, tmp)
    finally:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


def preemptions(args, data: str, tmp: str) -> None:
    """rayflex with notices vs no preemptions vs restoring the last periodic checkpoint."""
    from rayflex.local_ray import loopback_cluster

    results = {}
    for label, period, margin in (("no_preemptions", None, 2.0), ("rayflex", args.period, 2.0),
                                  ("restore_last_periodic", args.period, 1e9)):
        with loopback_cluster(FOUR_NODES) as cluster:
            results[label] = run_for(cluster, data, f"file://{tmp}/runs", f"goodput-{label}", args.minutes,
                                     period, margin)
            print(f"{label}: {results[label]}", file=sys.stderr)
    base = results["no_preemptions"]["committed_steps_per_s"]
    emit({"benchmark": "goodput", "machine": machine(),
          "workload": {"model": "gpt-2x64", "workers": WORKERS, "nodes": 4, "minutes": args.minutes,
                       "preemption_period_s": args.period, "notice_s": 20, "replacement_after_s": 30,
                       "checkpoint_every_steps": EVERY},
          "results": results,
          "ratios": {"rayflex_over_no_preemptions_throughput": results["rayflex"]["committed_steps_per_s"] / base,
                     "restore_last_periodic_over_no_preemptions_throughput":
                         results["restore_last_periodic"]["committed_steps_per_s"] / base},
          "goals": {"rayflex_ge_0.85_of_no_preemptions": results["rayflex"]["committed_steps_per_s"] / base >= 0.85}})


if __name__ == "__main__":
    main()
