"""``rayflex report NAME``: plot a run (loss, throughput, world size, events, goodput)."""

from __future__ import annotations

from rayflex.telemetry.report import resolve_run_dir, write_report


def add_subcommand(subparsers) -> None:
    p = subparsers.add_parser("report", help="plot a run: loss, throughput, world size, events, goodput")
    p.add_argument("name", help="run name (under --storage), or a run directory path/URI")
    p.add_argument("--storage", help="storage URI holding the run directory (default $RAYFLEX_DEMO_STORAGE "
                                     "or ./runs)")
    p.add_argument("--out", help="directory (path or URI) for report.png/.html/.json (default: the run "
                                 "directory)")
    p.set_defaults(func=cmd_report)


def cmd_report(args) -> int:
    run_dir = resolve_run_dir(args.name, args.storage)
    png, page = write_report(run_dir, args.out)
    print(f"wrote {png}\nwrote {page}")
    return 0
