"""``rayflex diagnose NAME``: what the run's hangs were, from its events (live or finished).

Prints each ``hang_diagnosed`` event (the newest only unless ``--all``): the verdict, the
process group and collective, and one row per rank of that group (its step, phase, the last
collective it completed there, and what it did at the stuck one). The controller writes
the event as soon as it has pulled the ranks' flight records, so a live run shows it
within a flush interval (``RUNDIR_FLUSH_S``).
"""

from __future__ import annotations

from rayflex.telemetry import events as ev
from rayflex.telemetry.report import resolve_run_dir


def add_subcommand(subparsers) -> None:
    p = subparsers.add_parser("diagnose", help="name the rank, group and collective of a run's hangs")
    p.add_argument("name", help="run name (under --storage), or a run directory path/URI")
    p.add_argument("--storage", help="storage URI holding the run directory (default $RAYFLEX_DEMO_STORAGE "
                                     "or ./runs)")
    p.add_argument("--all", action="store_true", help="every diagnosis of the run, oldest first (default: "
                                                      "the newest)")
    p.set_defaults(func=cmd_diagnose)


def cmd_diagnose(args) -> int:
    from rayflex.errors import RayflexError
    from rayflex.storage.rundir import RunDirectory

    run_dir = resolve_run_dir(args.name, args.storage)
    events = ev.as_events(RunDirectory(run_dir).read_jsonl("events.jsonl"))
    if not events:
        raise RayflexError(f"{run_dir} holds no events.jsonl: not a rayflex run directory (check NAME and --storage)")
    found = [e for e in events if isinstance(e, ev.HangDiagnosed)]
    if not found:
        hangs = sum(isinstance(e, ev.HangDetected) for e in events)
        print(f"run {args.name}: no hang diagnosed ({len(events)} events, {hangs} hang(s) detected"
              f"{'; this rayflex predates the diagnosis, or the flight recorder was off' if hangs else ''})")
        return 0
    for e in found if args.all else found[-1:]:
        print(describe(e))
    return 0


def describe(e: ev.HangDiagnosed) -> str:
    """The verdict and its table, as ``rayflex diagnose`` prints it."""
    head = (f"step {e.step}: {e.diagnosis}{' (program-level)' if e.program_level else ''}, "
            f"after a {'hang' if e.trigger == 'hang' else 'dead worker'}; answered: {e.answered}")
    lines = [head, f"  {e.verdict}"]
    if e.table:
        columns = [c for c in ("rank", "step", "phase", "last_completed", "sent", "received", "at")
                   if any(c in row for row in e.table)]
        cells = [[str(row.get(c, "")) if row.get(c) is not None else "-" for c in columns] for row in e.table]
        widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip())
        lines += ["  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in cells]
    return "\n".join(lines)
