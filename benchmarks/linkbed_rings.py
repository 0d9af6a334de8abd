"""How a ring of four ranks on two nodes uses the link between them: ranks in node order
(one crossing each way) against interleaved (two crossings each way, over the same link).

    sudo python benchmarks/linkbed_rings.py [--topology examples/topologies/two_racks_small.yaml]
                                            [--orders "contiguous=n0,n0,n1,n1;interleaved=n0,n1,n0,n1"]
                                            [--scale 4e-3] [--mb-per-rank 16] [--rounds 3]
                                            [--out benchmarks/results/linkbed_rings.json]

On the link bed of ``examples/topologies/two_racks_small.yaml`` (two nodes of two slots in
two racks), four Ray actors (two per node) form a gloo group whose rank order is either
``n0 n0 n1 n1`` (contiguous: the ring crosses the racks once in each direction) or
``n0 n1 n0 n1`` (interleaved: twice in each direction), and time an all-gather and an
all-reduce of ``--mb-per-rank`` MB a rank, rounds alternating. ``--topology`` and ``--orders``
compare other rings (a rank per node of ``bed_two_racks.yaml``: the planner's order against
node order). Beside each median, two
predictions of the same ring:

* ``per_rank_link_s``: the cost model's (``planning.cost_model``): what one rank sends
  over one rank's share of the slowest pair its ring crosses (the topology's per-rank
  bandwidth x the scale), the same for any order of the ranks over the same pairs' tier;
* ``shared_link_s``: the bytes every crossing hop sends one way, summed over the hops that
  share a node pair's link, over that link's rate (the bed gives a node pair
  ``slots`` x the per-rank rate, one class for all its flows), the slowest pair's.

and the bytes each directed node pair carried (tc's counters). gloo's rings follow rank
order; NCCL builds its rings from the topology (and uses one channel per NIC), so on GPUs
an interleaved order is not what the ring runs: what this measures is what the link bed
does with a ring, the ground the placement model is checked on.
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
from linkbed_calibrate import PairRank  # noqa: E402

TOPOLOGY = os.path.join(os.path.dirname(__file__), "..", "examples", "topologies", "two_racks_small.yaml")
ORDERS = {"contiguous": ("n0", "n0", "n1", "n1"), "interleaved": ("n0", "n1", "n0", "n1")}
OPS = ("all_gather", "all_reduce")


def orders_from(env: str) -> dict:
    """``NAME=n0,n1,...;NAME=...`` (RINGS_ORDERS) -> {name: nodes in rank order}."""
    out = {}
    for item in filter(None, env.split(";")):
        name, nodes = item.split("=")
        out[name] = tuple(nodes.split(","))
    return out


class RingRank(PairRank):
    """One rank of a four-rank gloo group (made a Ray actor on the bed)."""

    def run(self, op: str, mb: int, repeats: int) -> list[float]:
        import torch
        import torch.distributed as dist

        n = mb * 2**20 // 4
        mine = torch.ones(n)
        full = torch.empty(n * dist.get_world_size())
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            if op == "all_gather":
                dist.all_gather_into_tensor(full, mine)
            else:
                dist.all_reduce(mine)
            times.append(time.perf_counter() - t0)
        return times


def crossings(order) -> dict[str, int]:
    """Hops of the rank-order ring (r -> r+1) per directed pair of distinct nodes."""
    out: dict[str, int] = {}
    for r, node in enumerate(order):
        nxt = order[(r + 1) % len(order)]
        if nxt != node:
            out[f"{node}->{nxt}"] = out.get(f"{node}->{nxt}", 0) + 1
    return out


def hop_bytes(op: str, mb: int, world: int) -> float:
    """Bytes one hop of the ring carries for ``op`` (gloo's rings: every hop alike)."""
    full = mb * 2**20 * (world if op == "all_gather" else 1)
    return (world - 1) / world * full * (1 if op == "all_gather" else 2)


def measure(bed) -> dict:
    """Runs in the bed (``--call``): both orders x both ops, rounds alternating."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from rayflex.local_ray import free_ports
    from rayflex.testing.linkbed.links import subtract

    rounds, repeats, mb = (int(os.environ[k]) for k in ("RINGS_ROUNDS", "RINGS_REPEATS", "RINGS_MB"))
    orders = orders_from(os.environ["RINGS_ORDERS"])
    actor = ray.remote(num_cpus=0)(RingRank)
    groups = {}
    for name, order in orders.items():
        ranks = [actor.options(scheduling_strategy=NodeAffinitySchedulingStrategy(bed.ray_node_id(n), soft=False)).remote()
                 for n in order]
        addr, port = ray.get(ranks[0].ip.remote()), free_ports(1)[0]
        ray.get([r.join.remote(i, addr, port, len(order)) for i, r in enumerate(ranks)])
        ray.get([r.run.remote("all_gather", 1, 1) for r in ranks])  # connections made, buffers touched
        groups[name] = ranks
    rows = []
    for rnd in range(rounds):
        for op in OPS:
            for name in orders:
                before = bed.counters()
                times = ray.get([r.run.remote(op, mb, repeats) for r in groups[name]])
                traffic = subtract(bed.counters(), before)
                rows.append({"round": rnd, "op": op, "order": name,
                             "seconds": statistics.median(max(t[i] for t in times) for i in range(repeats)),
                             "by_pair_per_op": {k: v / repeats for k, v in traffic["by_pair"].items()}})
    return {"rows": rows, "orders": {k: list(v) for k, v in orders.items()},
            "rates_bytes_s": {f"{l.src}->{l.dst}": l.rate_bytes_s for l in bed.plan.links},
            "slots": {n.node_id: n.slots for n in bed.topology.nodes}}


def summarize(raw: dict, mb: int) -> dict:
    rates, slots = raw["rates_bytes_s"], raw["slots"]
    out: dict = {}
    for op in OPS:
        for name, order in raw["orders"].items():
            sel = [r for r in raw["rows"] if r["op"] == op and r["order"] == name]
            hop = hop_bytes(op, mb, len(order))
            pairs = crossings(order)
            # The hops that share a pair's class, over its rate; and one rank's bytes over
            # one rank's share of the slowest pair it sends over (the cost model's).
            shared = max(hop * k / rates[p] for p, k in pairs.items())
            per_rank = max(hop / (rates[p] / max(1, slots[p.split("->")[0]])) for p in pairs)
            seconds = [r["seconds"] for r in sel]
            measured = statistics.median(seconds)
            out[f"{op}/{name}"] = {
                "order": list(order), "crossings": pairs, "measured_s": round(measured, 4),
                "spread_s": [round(min(seconds), 4), round(max(seconds), 4)],
                "per_rank_link_s": round(per_rank, 4), "shared_link_s": round(shared, 4),
                "measured_over_per_rank_link": round(measured / per_rank, 3),
                "measured_over_shared_link": round(measured / shared, 3),
                "bytes_per_op": {k: round(statistics.median(r["by_pair_per_op"].get(k, 0) for r in sel))
                                 for k in sel[0]["by_pair_per_op"]},
                "hop_bytes": round(hop)}
    return out


def main() -> None:
    setup_logging()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--topology", default=TOPOLOGY)
    p.add_argument("--orders", default=";".join(f"{k}={','.join(v)}" for k, v in ORDERS.items()),
                   help="NAME=NODE,NODE,...;... : the rank orders to compare (default: contiguous and interleaved)")
    p.add_argument("--scale", type=float, default=4e-3)
    p.add_argument("--mb-per-rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="rayflex-rings-") as tmp:
        bed = on_linkbed(args.topology, args.scale, "linkbed_rings:measure", {
            "RINGS_ROUNDS": str(args.rounds), "RINGS_REPEATS": str(args.repeats), "RINGS_MB": str(args.mb_per_rank),
            "RINGS_ORDERS": args.orders}, tmp)
    emit({"benchmark": "linkbed_rings", "machine": machine(), "command": " ".join(["python", *sys.argv]),
          "topology": os.path.relpath(args.topology, os.path.join(os.path.dirname(__file__), "..")),
          "scale": args.scale, "mb_per_rank": args.mb_per_rank,
          "rounds": args.rounds, "repeats": args.repeats, "wall_s": round(time.time() - t0, 1),
          "results": summarize(bed["result"], args.mb_per_rank), "plan": bed["plan"]}, args.out)


if __name__ == "__main__":
    main()
