"""Committed benchmark results as markdown tables and one picture, for the README and the docs.

    python benchmarks/tables.py ratios [benchmarks/results/compare.json]
    python benchmarks/tables.py results benchmarks/results/*.json
    python benchmarks/tables.py timeline [benchmarks/results/chaos.json] [--seed 1] [--out FILE.svg]

``ratios`` prints the README's comparison table: every peer's figure over rayflex's, from one
``compare.py`` result (the peers ran in the same invocation, so the ratio is the part that
carries to another host). ``results`` renders any result file as tables (the docs site's
"Committed results" page). ``timeline`` draws one chaos run (``python -m rayflex.chaos``): the
world size that trained each step and every fault injected, as an SVG (the README's picture).

Everything here reads the JSON only: no torch, no Ray, nothing measured.
"""

from __future__ import annotations

import argparse
import html
import json
import re
import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
COMPARE_JSON = os.path.join(HERE, "results", "compare.json")
CHAOS_JSON = os.path.join(HERE, "results", "chaos.json")

PEERS = {"ray_train": "Ray Train `TorchTrainer`", "torchrun": "`torchrun --max-restarts 3`"}
# (key, what, rayflex is ahead when the ratio is ...)
RATIO_ROWS = (
    ("tokens_per_s", "tokens/s, steps without a save", "< 1"),
    ("tokens_per_s_with_checkpoints", "tokens/s, all steps", "< 1"),
    ("time_to_first_step_s", "launch to first step", "> 1"),
    ("checkpoint_blocked_s", "training blocked per checkpoint", "> 1"),
    ("checkpoint_step_excess_s", "step slowdown around a checkpoint", "> 1"),
    ("recovery_s", "recovery: kill to first resumed step", "> 1"),
    ("steps_lost", "steps lost to the kill", "> 1"),
)


def _ratio_cell(got: dict, peer: str, key: str) -> str:
    by_round = got.get("ratios_vs_rayflex_by_round", {}).get(peer, {}).get(key)
    if by_round:  # paired rounds: the spread of the ratio itself
        return f"{by_round['median']:.2f} ({by_round['min']:.2f}-{by_round['max']:.2f})"
    mine, theirs = got["results"]["rayflex"].get(key), got["results"].get(peer, {}).get(key)
    if not mine or theirs is None:
        return "-"
    return f"{theirs / mine:.2f}"


def ratio_table(path: str = COMPARE_JSON) -> str:
    """Each peer's figure divided by rayflex's, from one ``compare.py`` result: medians of
    the round-by-round ratios with their range where the runs alternated in rounds, else the
    ratio of the single runs (recovery, steps lost)."""
    with open(path) as f:
        got = json.load(f)
    peers = [p for p in PEERS if p in got["results"]]
    rows = ["| peer ÷ rayflex | " + " | ".join(PEERS[p] for p in peers) + " | rayflex ahead when |",
            "|---|" + "---|" * len(peers) + "---|"]
    for key, what, ahead in RATIO_ROWS:
        rows.append(f"| {what} | " + " | ".join(_ratio_cell(got, p, key) for p in peers) + f" | {ahead} |")
    return "\n".join(rows)


# ---------------------------------------------------------------------------- any result file

def _fmt(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return str(v).lower() if isinstance(v, bool) else "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (dict, list)):
        text = json.dumps(v, separators=(", ", ": "))
        v = text if len(text) <= 80 else text[:77] + "..."
    return str(v).replace("|", "\\|").replace("\n", " ")


def _scalar_rows(obj: dict, prefix: str = "") -> list[tuple[str, str]]:
    rows = []
    for k, v in obj.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            rows.extend(_scalar_rows(v, name + "."))
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            continue  # a table of its own
        elif isinstance(v, list) and len(v) > 12:
            rows.append((name, _fmt(v[:12]).rstrip("]") + f", ... ({len(v)} items)]"))
        else:
            rows.append((name, _fmt(v)))
    return rows


def _record_tables(obj: Any, prefix: str = "") -> list[tuple[str, list[dict]]]:
    found = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            found.extend(_record_tables(v, f"{prefix}{k}."))
    elif isinstance(obj, list) and obj and all(isinstance(x, dict) for x in obj):
        found.append((prefix.rstrip("."), obj))
    return found


def result_tables(path: str, max_rows: int = 24, heading: str = "###") -> str:
    """One result file as markdown: its scalar figures in a table (nested keys dotted), then
    every list of records as a table of its own (at most ``max_rows`` rows shown)."""
    with open(path) as f:
        got = json.load(f)
    out = []
    if isinstance(got, dict) and got.get("command"):
        cmd = got["command"]
        out.append(f"Recorded command: `{' '.join(cmd) if isinstance(cmd, list) else cmd}`\n")
    scalars = _scalar_rows(got) if isinstance(got, dict) else []
    if scalars:
        out.append("| figure | value |\n|---|---|")
        out.extend(f"| `{k}` | {v} |" for k, v in scalars)
        out.append("")
    for name, records in _record_tables(got):
        cols = []
        for r in records:
            cols.extend(c for c in r if c not in cols)
        cols = cols[:10]
        out.append(f"{heading} `{name}`\n")
        out.append("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
        out.extend("| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in records[:max_rows])
        if len(records) > max_rows:
            out.append(f"\n{len(records) - max_rows} more rows in the file.")
        out.append("")
    return "\n".join(out)


# ---------------------------------------------------------------------------- the chaos picture

COLORS = {"preempt_long": "#d62728", "preempt_short": "#ff7f0e", "remove_node": "#9467bd",
          "kill_actor": "#8c564b", "sigstop": "#1f77b4", "raise_once": "#7f7f7f",
          "s3_down": "#2ca02c", "corrupt_checkpoint": "#e377c2", "slow_node": "#bcbd22"}
WORDS = {"preempt_long": "spot notice, 15 s", "preempt_short": "spot notice, 1 s", "remove_node": "node removed",
         "kill_actor": "worker killed", "sigstop": "worker frozen", "raise_once": "worker raised",
         "s3_down": "object store down", "corrupt_checkpoint": "checkpoint corrupted",
         "slow_node": "machine slowed (straggler)"}


def chaos_timeline_svg(path: str = CHAOS_JSON, seed: int = 1) -> str:
    """The world size that trained each committed step of one chaos run (the fault-free
    replay's segments) and every fault injected, at the step it went in."""
    with open(path) as f:
        got = json.load(f)
    run = next(r for r in got["runs"] if r["seed"] == seed)
    segments = run["checks"]["equals_fault_free_replay"]["detail"]["segments"]
    faults = run["faults"]
    steps, most = run["steps"], max(s["world_size"] for s in segments)
    w, h, left, right, top, bottom = 760, 300, 48, 16, 58, 92
    pw, ph = w - left - right, h - top - bottom

    def x(step: float) -> float:
        return left + pw * step / steps

    def y(size: float) -> float:
        return top + ph * (1 - size / most)

    e = html.escape
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
           'font-family="Helvetica, Arial, sans-serif" font-size="11">',
           f'<rect width="{w}" height="{h}" fill="#ffffff"/>']
    checks = run["checks"]
    replay = checks["equals_fault_free_replay"]["detail"]
    trained = re.search(r"steps_completed=(\d+/\d+)", checks["finished_every_step"]["detail"]).group(1)
    title = (f"One chaos run (seed {seed}): {len(faults)} faults, {trained} steps trained, "
             f"{run['restarts']} restarts")
    sub = (f"final weights and optimizer state {'bitwise equal' if replay.get('bitwise_equal') else 'NOT equal'} "
           f"to a fault-free replay ({replay['tensors']} tensors); {os.path.basename(path)}, "
           f"{got['machine']['cpus']} CPU cores, 4 loopback nodes")
    svg.append(f'<text x="{left}" y="20" font-size="14" font-weight="bold">{e(title)}</text>')
    svg.append(f'<text x="{left}" y="38" fill="#444">{e(sub)}</text>')
    for size in range(0, most + 1):
        svg.append(f'<line x1="{left}" x2="{w - right}" y1="{y(size):.1f}" y2="{y(size):.1f}" stroke="#eee"/>')
        svg.append(f'<text x="{left - 8}" y="{y(size) + 4:.1f}" text-anchor="end" fill="#444">{size}</text>')
    svg.append(f'<text x="12" y="{top + ph / 2:.1f}" transform="rotate(-90 12 {top + ph / 2:.1f})" '
               'text-anchor="middle" fill="#444">workers</text>')
    points = []
    for s in segments:
        points += [f"{x(s['from_step']):.1f},{y(s['world_size']):.1f}", f"{x(s['to_step']):.1f},{y(s['world_size']):.1f}"]
    area = [f"{x(segments[0]['from_step']):.1f},{y(0):.1f}"] + points + [f"{x(segments[-1]['to_step']):.1f},{y(0):.1f}"]
    svg.append(f'<polygon points="{" ".join(area)}" fill="#c6dbef"/>')
    svg.append(f'<polyline points="{" ".join(points)}" fill="none" stroke="#3182bd" stroke-width="1.5"/>')
    for tick in range(0, steps + 1, 50 if steps <= 600 else 100):
        svg.append(f'<text x="{x(tick):.1f}" y="{top + ph + 14:.1f}" text-anchor="middle" fill="#444">{tick}</text>')
    svg.append(f'<text x="{left + pw / 2:.1f}" y="{top + ph + 28:.1f}" text-anchor="middle" fill="#444">step</text>')
    for fault in faults:
        fx = x(fault["step"])
        svg.append(f'<line x1="{fx:.1f}" x2="{fx:.1f}" y1="{top:.1f}" y2="{top + ph:.1f}" '
                   f'stroke="{COLORS.get(fault["kind"], "#000")}" stroke-width="2"/>')
    kinds = list(dict.fromkeys(f["kind"] for f in faults))
    for i, kind in enumerate(kinds):
        lx, ly = left + (i % 4) * 180, top + ph + 46 + (i // 4) * 16
        svg.append(f'<rect x="{lx}" y="{ly - 9}" width="10" height="10" fill="{COLORS.get(kind, "#000")}"/>')
        svg.append(f'<text x="{lx + 14}" y="{ly}">{e(WORDS.get(kind, kind))}</text>')
    svg.append("</svg>")
    return "\n".join(svg) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    r = sub.add_parser("ratios", help="the README's comparison table from a compare.py result")
    r.add_argument("json", nargs="?", default=COMPARE_JSON)
    t = sub.add_parser("results", help="result files as markdown tables")
    t.add_argument("json", nargs="+")
    c = sub.add_parser("timeline", help="one chaos run as an SVG")
    c.add_argument("json", nargs="?", default=CHAOS_JSON)
    c.add_argument("--seed", type=int, default=1)
    c.add_argument("--out", help="write the SVG here (default: stdout)")
    args = ap.parse_args(argv)
    if args.what == "ratios":
        print(ratio_table(args.json))
    elif args.what == "results":
        for path in args.json:
            print(f"## {os.path.basename(path)}\n\n{result_tables(path)}")
    else:
        svg = chaos_timeline_svg(args.json, args.seed)
        if args.out:
            with open(args.out, "w") as f:
                f.write(svg)
        else:
            sys.stdout.write(svg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
