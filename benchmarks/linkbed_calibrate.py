"""The cost model against real bytes on real (emulated) links: alpha and beta per link tier.

    sudo python benchmarks/linkbed_calibrate.py [--scale 1e-4] [--rounds 3]
                                                [--out benchmarks/results/linkbed_calibrate.json]

On the link bed (``rayflex.testing.linkbed``) of ``examples/topologies/linkbed_tiers.yaml``
(one pair of ranks per tier: same node, one rack, two racks, two zones), two Ray actors
form a gloo group per pair and time the collectives rayflex issues — FSDP's all-gather and
reduce-scatter, HSDP's and TP's all-reduce, the pipeline's send/recv — at three sizes
chosen so each takes ~0.1-1 s on the pair's link. Per tier and collective:

* ``alpha_s``, ``beta_bytes_s``: the least-squares fit of ``time = alpha + sent / beta``,
  ``sent`` the bytes one rank sends by the ring formula the cost model uses (all-gather and
  reduce-scatter ``(n-1)/n`` of the full tensor, all-reduce twice that, send/recv all of it);
* ``model_beta_bytes_s``: the bandwidth the cost model gives the tier (the topology's
  figure x the bed's scale) and ``beta_over_model``;
* ``bytes_over_ring``: bytes the pair's links carried (tc's counters, both directions) over
  what the ring formula says both ranks send: how much more a backend moves than the model.

Rounds alternate over tiers and collectives; medians per size. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import emit, machine, on_linkbed, setup_logging  # noqa: E402

TOPOLOGY = os.path.join(os.path.dirname(__file__), "..", "examples", "topologies", "linkbed_tiers.yaml")
PAIRS = {"same_node": ("a0", "a0"), "same_domain": ("a0", "a1"), "same_zone": ("a0", "b0"), "cross_zone": ("a0", "c0")}
OPS = ("all_gather", "reduce_scatter", "all_reduce", "send_recv")
# Seconds the three sizes take at the modelled rate (the fit needs spread, the run needs to end).
TARGET_S = (0.1, 0.3, 0.9)


def ring_sent(op: str, nbytes: int, n: int = 2) -> float:
    """Bytes one rank sends for ``op`` on a tensor of ``nbytes`` (the full, gathered size)."""
    return {"all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_reduce": 2 * (n - 1) / n,
            "send_recv": 1.0}[op] * nbytes


class PairRank:
    """One rank of a two-rank gloo group (made a Ray actor on the bed)."""

    def ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def join(self, rank: int, addr: str, port: int, world: int = 2) -> None:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world)
        self.rank = rank

    def run(self, op: str, nbytes: int, repeats: int) -> float:
        """Median seconds of ``op`` on a float32 tensor of ``nbytes`` (between barriers)."""
        import torch
        import torch.distributed as dist

        n = nbytes // 4 // 2 * 2
        full, half = torch.ones(n), torch.ones(n // 2)
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            if op == "all_gather":
                dist.all_gather_single(full, half)
            elif op == "reduce_scatter":
                dist.reduce_scatter_single(half, full)
            elif op == "all_reduce":
                dist.all_reduce(full)
            elif self.rank == 0:
                dist.send(full, 1)
            else:
                dist.recv(full, 0)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)


def measure(bed) -> dict:
    """Runs in the bed (``--call``): every tier x op x size, rounds alternating."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from rayflex.local_ray import free_ports
    from rayflex.testing.linkbed.links import subtract

    rounds, repeats = int(os.environ["CALIBRATE_ROUNDS"]), int(os.environ["CALIBRATE_REPEATS"])
    actor = ray.remote(num_cpus=0)(PairRank)  # a0 holds a rank of every pair
    groups = {}
    for tier, (a, b) in PAIRS.items():
        ranks = [actor.options(scheduling_strategy=NodeAffinitySchedulingStrategy(bed.ray_node_id(n), soft=False)).remote()
                 for n in (a, b)]
        addr = ray.get(ranks[0].ip.remote())
        port = free_ports(1)[0]
        ray.get([r.join.remote(i, addr, port) for i, r in enumerate(ranks)])
        groups[tier] = ranks
    rows = []
    for rnd in range(rounds):
        for tier, (a, b) in PAIRS.items():
            rate = bed.plan.link(a, b).rate_bytes_s
            for op in OPS:
                for target in TARGET_S:
                    nbytes = int(rate * target / (ring_sent(op, 1) or 1))
                    before = bed.counters()
                    times = ray.get([r.run.remote(op, nbytes, repeats) for r in groups[tier]])
                    traffic = subtract(bed.counters(), before)
                    carried = traffic["by_pair"][f"{a}->{b}"] + (traffic["by_pair"][f"{b}->{a}"] if a != b else 0)
                    rows.append({"round": rnd, "tier": tier, "op": op, "bytes": nbytes, "seconds": max(times),
                                 "carried_per_op": carried / repeats, "model_rate": rate})
    return {"rows": rows}


def fit(rows: list[dict]) -> dict:
    """alpha/beta per tier and op from the medians per size."""
    out: dict = {}
    for tier in PAIRS:
        out[tier] = {}
        for op in OPS:
            sel = [r for r in rows if r["tier"] == tier and r["op"] == op]
            sizes = sorted({r["bytes"] for r in sel})
            xs = [ring_sent(op, s) for s in sizes]
            ys = [statistics.median(r["seconds"] for r in sel if r["bytes"] == s) for s in sizes]
            mx, my = statistics.fmean(xs), statistics.fmean(ys)
            slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
            alpha = my - slope * mx
            model = sel[0]["model_rate"]
            ring_both = [2 * ring_sent(op, s) if op != "send_recv" else ring_sent(op, s) for s in sizes]
            carried = [statistics.median(r["carried_per_op"] for r in sel if r["bytes"] == s) for s in sizes]
            out[tier][op] = {
                "alpha_s": round(alpha, 5), "beta_bytes_s": round(1 / slope) if slope > 0 else None,
                "model_beta_bytes_s": round(model), "beta_over_model": round(1 / slope / model, 3) if slope > 0 else None,
                "bytes_over_ring": round(statistics.median(c / r for c, r in zip(carried, ring_both)), 3),
                "sizes": sizes, "median_s": [round(y, 4) for y in ys],
                "spread_s": [[round(min(r["seconds"] for r in sel if r["bytes"] == s), 4),
                              round(max(r["seconds"] for r in sel if r["bytes"] == s), 4)] for s in sizes]}
    return out


def main() -> None:
    setup_logging()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", type=float, default=1e-4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="rayflex-calibrate-") as tmp:
        bed = on_linkbed(TOPOLOGY, args.scale, "linkbed_calibrate:measure",
                         {"CALIBRATE_ROUNDS": str(args.rounds), "CALIBRATE_REPEATS": str(args.repeats)}, tmp)
    emit({"benchmark": "linkbed_calibrate", "machine": machine(), "scale": args.scale, "rounds": args.rounds,
          "repeats": args.repeats, "wall_s": round(time.time() - t0, 1), "tiers": fit(bed["result"]["rows"]),
          "plan": bed["plan"]}, args.out)


if __name__ == "__main__":
    main()
