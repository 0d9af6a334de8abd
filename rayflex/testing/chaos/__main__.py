"""python -m rayflex.chaos [--mode sequential|overlap] [--seed N ...] [--faults 12] [--steps-per-fault 40]
[--memory-replicas N] [--dp-shard N [--diloco H]]:
prints the JSON report (``python -m rayflex.testing.chaos`` is the same command)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys


def main(argv=None) -> int:
    from rayflex.testing.chaos.overlap import MODES

    ap = argparse.ArgumentParser(prog="python -m rayflex.chaos", description=__doc__)
    ap.add_argument("--seed", type=int, nargs="+", default=[0], help="one run per seed")
    ap.add_argument("--faults", type=int, default=12)
    # Only a cap (the run is stopped once every fault is in and recovered from): the waits
    # between faults are seconds (notices, returning nodes, an outage, a slow spell), so a
    # fast host spends more steps in them; 40 fit the long seeds on a slow host only.
    ap.add_argument("--steps-per-fault", type=int, default=100)
    ap.add_argument("--mode", choices=MODES, default="sequential",
                    help="overlap: every second fault lands while the run recovers from the one before")
    ap.add_argument("--memory-replicas", type=int, default=0,
                    help="CheckpointConfig.memory_replicas of the run (0: restores read storage)")
    ap.add_argument("--dp-shard", type=int, default=None,
                    help="ParallelConfig.dp_shard (e.g. 2 with 4 workers: HSDP 2 x 2, so a lost rank's shard has a "
                         "live replica and restarts recover from the survivors' memory)")
    ap.add_argument("--diloco", type=int, default=None, metavar="H",
                    help="CommConfig(replicate='diloco', inner_steps=H): the replicas (needs --dp-shard) train apart "
                         "and meet every H steps")
    ap.add_argument("--workers", type=int, default=None, help="ChaosConfig.workers (default: its own)")
    ap.add_argument("--slow-node", action="store_true",
                    help="one of the faults is a slow machine (a node held to a tenth of a core for a while): the "
                         "straggler signal must name it and nothing else (>= 3 workers, sequential mode)")
    ap.add_argument("--workdir", default="")
    ap.add_argument("--out", help="also write the JSON report here (Ray's log lines share stdout)")
    args = ap.parse_args(argv)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(message)s")
    import rayflex as rf
    from rayflex.testing.chaos import ChaosConfig, run_chaos

    reports = []
    for seed in args.seed:
        workdir = os.path.join(args.workdir, f"seed{seed}") if args.workdir else ""
        reports.append(run_chaos(ChaosConfig(seed=seed, faults=args.faults, steps_per_fault=args.steps_per_fault,
                                             workdir=workdir, mode=args.mode,
                                             parallel=rf.ParallelConfig(dp_shard=args.dp_shard),
                                             comm=(rf.CommConfig(replicate="diloco", inner_steps=args.diloco)
                                                   if args.diloco else None),
                                             memory_replicas=args.memory_replicas, slow_node=args.slow_node,
                                             **({"workers": args.workers} if args.workers else {}))))
        print(f"seed {seed}: {'PASSED' if reports[-1]['passed'] else 'FAILED'} in {reports[-1]['wall_s']:.0f}s",
              file=sys.stderr)
        text = json.dumps({"runs": reports, "passed": all(r["passed"] for r in reports)}, indent=2, default=str)
        if args.out:  # after every seed: a later one that crashes does not lose the earlier reports
            with open(args.out, "w") as f:
                f.write(text + "\n")
    print(text)
    return 0 if all(r["passed"] for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
