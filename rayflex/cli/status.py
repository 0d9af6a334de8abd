"""``rayflex status [NAME]``: live runs on the cluster and finished ones in a storage location."""

from __future__ import annotations

import json


def add_subcommand(subparsers) -> None:
    s = subparsers.add_parser("status", help="runs on the cluster and in a storage location")
    s.add_argument("name", nargs="?")
    s.add_argument("--storage", help="also list finished runs under this storage URI")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_status)


def cmd_status(args) -> int:
    from rayflex.telemetry.status import COLUMNS, run_statuses

    rows = run_statuses(name=args.name, storage=args.storage)
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    if not rows:
        print("no runs found" + (f" named {args.name!r}" if args.name else ""))
        return 1 if args.name else 0
    print("  ".join(f"{c:>14}" for c in COLUMNS))
    for r in rows:
        vals = []
        for c in COLUMNS:
            v = r.get(c)
            if isinstance(v, float):
                v = f"{v:.4g}"
            elif isinstance(v, dict):
                v = v.get("step")
            vals.append(f"{str(v):>14}")
        print("  ".join(vals))
    return 0
