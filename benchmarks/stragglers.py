"""A slow node on a 3-node loopback cluster: how soon it is named, weighed and left, and how
fast the run then trains against a run on the healthy nodes alone.

Three runs per round, alternating (A B C A B C ...) on one cluster of three 1-CPU nodes:

* ``slow_node``: 3 ranks; at step 5 the machine under rank 2 (its raylet and every process
  the raylet starts: the rank, a health check's worker) is held to ``--cores`` of a core (a
  CPU quota of its own, rayflex.testing.throttle) for the rest of the run: named, left, and
  kept out by its failing health checks;
* ``healthy``: the same run at 2 ranks on 2 nodes, nothing throttled: the pace the
  evicted run should return to;
* ``brief``: 3 ranks, rank 2's machine throttled for ``--brief-s`` seconds only (long
  enough to be named): it must be named and kept.

Production knobs (a 20 s window, 10 s of confirmation). Reported per round and as
medians with their spread: seconds from the throttle to ``straggler_detected``, from there
to ``straggler_decided``, from the decision to the first step after the restart, the
tokens/s after it against the healthy run's (goal >= 0.9), and the seconds from the decision
until 5 steps in a row ran at >= 90% of the healthy pace (goal <= 60 s).

    python benchmarks/stragglers.py --rounds 3 --cores 0.33 --out benchmarks/results/stragglers.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import emit, machine, setup_logging  # noqa: E402
from rounds import alternate  # noqa: E402

SYSTEMS = ("slow_node", "healthy", "brief")
SKIP_AFTER = 3  # steps after a (re)start left out of its pace (warm-up)


def _trainer(uri: str, storage: str, name: str, workers: int, steps: int):
    import rayflex as rf
    from rayflex.models import GPTConfig, gpt

    return rf.Trainer(model=gpt(GPTConfig(vocab_size=128, seq_len=32, d_model=32, n_layers=2, n_heads=2)),
                      data=rf.DataConfig(uri=uri, seq_len=32, global_batch=12),
                      run=rf.RunConfig(name=name, storage=storage, steps=steps),
                      scaling=rf.ScalingConfig(num_workers=workers, min_workers=2))


def _lines(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]


def _pace(metrics: list[dict], after: float) -> list[tuple[float, float]]:
    """(time, tokens/s) of the steps that finished after ``after``, warm-up left out."""
    later = [m for m in metrics if m["time"] > after]
    return [(m["time"], m["tokens_per_s"]) for m in later[SKIP_AFTER:]]


def one_run(system: str, round_: int, args, uri: str, root: str, cluster) -> dict:
    from rayflex.testing.throttle import cpu_throttled, node_processes

    name = f"{system}-{round_}"
    storage = f"file://{root}/runs"
    workers = 2 if system == "healthy" else 3
    handle = _trainer(uri, storage, name, workers, args.steps).submit()
    while handle.status()["step"] < 5 and not handle.done():
        time.sleep(0.1)
    victim = next(w for w in handle.status()["workers"] if w["rank"] == 2) if workers == 3 else None
    t_throttle = time.time()
    if victim is not None:
        # The whole machine: its raylet and what it starts (a health check's worker, a
        # standby) are slow too. The slow node stays slow for the rest of the run.
        with cpu_throttled(node_processes(cluster, victim["node_id"]), args.cores):
            limit = t_throttle + (args.brief_s if system == "brief" else 900)
            while not handle.done() and time.time() < limit:
                time.sleep(0.2)
    result = handle.wait(timeout_s=900)
    run_dir = f"{root}/runs/{name}"
    events, metrics = _lines(f"{run_dir}/events.jsonl"), _lines(f"{run_dir}/metrics.jsonl")
    out: dict = {"status": result.status, "steps": result.steps_completed}
    named = [e for e in events if e["kind"] == "straggler_detected"]
    decided = [e for e in events if e["kind"] == "straggler_decided"]
    restarts = [e for e in events if e["kind"] == "restarted"]
    checks = [e for e in events if e["kind"] == "node_health_checked"]
    if system == "healthy":
        out["tokens_per_s"] = statistics.median(t for _, t in _pace(metrics, 0.0))
        return out
    out.update(named_ranks=[e["rank"] for e in named], actions=[e["action"] for e in decided],
               restarts=len(restarts), health_checks=[e["action"] for e in checks],
               named_after_s=named[0]["time"] - t_throttle if named else None,
               decided_after_named_s=decided[0]["time"] - named[0]["time"] if named and decided else None,
               decision=decided[0] if decided else None)
    evicted = next((d for d in decided if d["action"] == "evict_node"), None)
    if system == "slow_node" and evicted is not None and restarts:
        after = _pace(metrics, restarts[0]["time"])
        first = next(m["time"] for m in metrics if m["time"] > restarts[0]["time"])
        out["first_step_after_decision_s"] = first - evicted["time"]
        out["tokens_per_s_after"] = statistics.median(t for _, t in after) if after else None
        out["pace_after_decision"] = [(t - evicted["time"], tps) for t, tps in after]
    return out


def against_healthy(slow: dict, healthy: dict) -> None:
    """The evicted run's pace against the same round's healthy run: the ratio of tokens/s,
    and the seconds from the decision until 5 steps in a row ran at >= 90% of it."""
    base, pace = healthy.get("tokens_per_s"), slow.get("pace_after_decision")
    if not base or not pace:
        return
    slow["after_vs_healthy"] = slow["tokens_per_s_after"] / base
    for i in range(len(pace) - 4):
        if all(tps >= 0.9 * base for _, tps in pace[i:i + 5]):
            slow["back_to_90pct_after_decision_s"] = pace[i][0]
            break


def _spread(xs: list) -> dict:
    xs = [x for x in xs if x is not None]
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)} if xs else {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--cores", type=float, default=0.1, help="the slow rank's share of one core")
    ap.add_argument("--brief-s", type=float, default=25.0, help="how long the brief slowdown lasts")
    ap.add_argument("--out")
    args = ap.parse_args()
    setup_logging()
    os.environ.setdefault("RAYFLEX_RUN_REPORT", "0")
    from rayflex.data.dataset import write_synthetic_dataset
    from rayflex.local_ray import loopback_cluster
    from rayflex.testing.throttle import throttle_problem

    problem = throttle_problem()
    if problem:
        raise SystemExit(f"cannot throttle a node here: {problem}")
    root = tempfile.mkdtemp(prefix="rayflex-stragglers-")
    uri = write_synthetic_dataset(f"file://{root}/tokens", num_samples=4096, seq_len=32, vocab_size=128,
                                  num_shards=3, seed=7)
    t0 = time.time()
    with loopback_cluster([{"num_cpus": 1}, {"num_cpus": 1}, {"num_cpus": 1}]) as cluster:
        runs = alternate(list(SYSTEMS), args.rounds, lambda s, r: one_run(s, r, args, uri, root, cluster))
    slow, brief = runs["slow_node"], runs["brief"]
    for s, h in zip(slow, runs["healthy"]):
        against_healthy(s, h)
    emit({"benchmark": "stragglers", "machine": machine(), "args": vars(args), "wall_s": time.time() - t0,
          "summary": {
              "slow_node_named_after_s": _spread([r.get("named_after_s") for r in slow]),
              "slow_node_decided_after_named_s": _spread([r.get("decided_after_named_s") for r in slow]),
              "slow_node_evicted": sum("evict_node" in r.get("actions", []) for r in slow),
              "first_step_after_decision_s": _spread([r.get("first_step_after_decision_s") for r in slow]),
              "after_vs_healthy_tokens_per_s": _spread([r.get("after_vs_healthy") for r in slow]),
              "back_to_90pct_after_decision_s": _spread([r.get("back_to_90pct_after_decision_s") for r in slow]),
              "healthy_tokens_per_s": _spread([r.get("tokens_per_s") for r in runs["healthy"]]),
              "brief_named": sum(bool(r.get("named_ranks")) for r in brief),
              "brief_evicted": sum("evict_node" in r.get("actions", []) for r in brief),
              "rounds": args.rounds},
          "runs": runs}, args.out)


if __name__ == "__main__":
    main()
