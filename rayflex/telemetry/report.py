"""``rayflex report NAME``: one picture of a run, from its run directory alone.

Four panels on one wall-clock axis (seconds since the run first started): loss, tokens/s,
world size, and the event timeline (checkpoints, failures, preemptions, restarts), whose
events are also drawn as vertical lines through the other panels. Steps a restart rolled
back are drawn faded; the gaps between driver sessions (stop ... resubmit) are shaded.
Goodput (see :mod:`rayflex.telemetry.goodput`) is in the title; where nodes have prices, a
fifth panel shows what the run cost and where the money went (:mod:`rayflex.telemetry.cost`).

Writes ``report.png``, ``report.html`` (the PNG inlined, plus a summary and the event
table) and ``report.json`` (the numbers behind the picture, including how many event
markers were drawn) next to each other, by default into the run directory itself.
``Trainer.fit()`` calls :func:`write_report` at the end of a run.
"""

from __future__ import annotations

import base64
import html
import io
import json
import os
import time
from dataclasses import dataclass
from typing import Optional

from rayflex.storage import fs as rfs
from rayflex.telemetry import events as ev
from rayflex.telemetry.cost import CATEGORIES, cost_breakdown
from rayflex.telemetry.events import EventKind
from rayflex.telemetry.goodput import TERMINAL_EVENTS, final_history, goodput_breakdown, sessions

# Event kinds drawn on the timeline: label, colour, marker. Bookkeeping events
# (run_started, plan_chosen, workers_started, run_finished) are not markers.
MARKER_KINDS: dict[EventKind, tuple[str, str, str]] = {
    EventKind.CHECKPOINT_COMMITTED: ("checkpoint committed", "tab:green", "v"),
    EventKind.CHECKPOINT_LOADED: ("checkpoint loaded", "tab:cyan", "^"),
    EventKind.CHECKPOINT_FAILED: ("checkpoint failed", "tab:olive", "X"),
    EventKind.PREEMPTION_NOTICE: ("preemption notice", "tab:orange", "D"),
    EventKind.NODE_LOST: ("node lost", "tab:brown", "s"),
    EventKind.WORKER_DIED: ("worker died", "tab:red", "x"),
    EventKind.WORKER_FAILED: ("worker failed", "darkred", "P"),
    EventKind.HANG_DETECTED: ("hang detected", "tab:pink", "h"),
    EventKind.HANG_DIAGNOSED: ("hang diagnosed", "magenta", "H"),
    EventKind.STRAGGLER_DETECTED: ("straggler", "tab:gray", "<"),
    EventKind.RESTARTED: ("restarted", "tab:purple", "o"),
    EventKind.RUN_STOPPED: ("run stopped", "black", "*"),
    EventKind.RUN_FAILED: ("run failed", "crimson", "*"),
}
# What the title says a run ended as, after its last terminal event.
_STATUS_AFTER = {ev.RunFinished: "finished", ev.RunFailedEvent: "failed", ev.RunStopped: "stopped"}

FILES = ("report.png", "report.html", "report.json")


@dataclass(frozen=True)
class ReportData:
    name: str
    metrics: list[dict]
    events: list[ev.Event]
    result: Optional[dict]

    @classmethod
    def load(cls, run_dir_uri: str) -> "ReportData":
        from rayflex.errors import RayflexError
        from rayflex.storage.rundir import RunDirectory

        rd = RunDirectory(run_dir_uri)
        metrics, events = rd.read_jsonl("metrics.jsonl"), ev.as_events(rd.read_jsonl("events.jsonl"))
        if not metrics and not events:
            raise RayflexError(f"{run_dir_uri} holds no metrics.jsonl or events.jsonl: not a rayflex run "
                               f"directory (check NAME and --storage)")
        name = run_dir_uri.rstrip("/").rsplit("/", 1)[-1]
        return cls(name=name, metrics=metrics, events=events, result=rd.read_json("result.json"))

    @property
    def live(self) -> bool:
        return not any(isinstance(e, TERMINAL_EVENTS) for e in self.events[-3:])


def marker_events(events: list[ev.Event]) -> list[ev.Event]:
    """The events the timeline marks, in time order."""
    return sorted((e for e in events if e.kind in MARKER_KINDS and e.time is not None), key=lambda e: e.time)


def _broken(points: list[dict], key: str, breaks: list[float], x) -> tuple[list, list]:
    """x/y of ``points[key]`` with a NaN wherever a break time falls between two points."""
    xs, ys = [], []
    prev = None
    for m in points:
        if m.get(key) is None:
            continue
        if prev is not None and any(prev < b < m["time"] for b in breaks):
            xs.append(float("nan"))
            ys.append(float("nan"))
        xs.append(x(m["time"]))
        ys.append(m[key])
        prev = m["time"]
    return xs, ys


def _setup_spans(events: list[ev.Event]) -> list[tuple[float, float]]:
    """(start, end) of each setup: from a run start or restart to its ``workers_started``."""
    out, opened = [], None
    for e in sorted((e for e in events if e.time is not None), key=lambda e: e.time):
        if isinstance(e, (ev.RunStarted, ev.Restarted)):
            opened = e.time if opened is None else opened
        elif isinstance(e, ev.WorkersStarted) and opened is not None:
            out.append((opened, e.time))
            opened = None
    return out


def _time_unit(span_s: float) -> tuple[float, str]:
    if span_s > 3 * 3600:
        return 3600.0, "h"
    if span_s > 3 * 60:
        return 60.0, "min"
    return 1.0, "s"


def render(data: ReportData, now: Optional[float] = None) -> tuple[bytes, dict]:
    """Draw the report; returns (PNG bytes, summary with the number of markers drawn)."""
    # The Agg canvas directly, not pyplot: no global backend switch (a notebook keeps its
    # inline backend), no figure registry, safe from a controller thread.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    now = now if now is not None else (time.time() if data.live else None)
    gp = goodput_breakdown(data.metrics, data.events, now=now)
    spans = sessions(data.metrics, data.events, now)
    history, _ = final_history(data.metrics, data.events)
    kept = {id(m) for m in history.values()}
    all_times = [m["time"] for m in data.metrics if m.get("time")] + [e.time for e in data.events if e.time]
    t0 = spans[0][0] if spans else (min(all_times) if all_times else 0.0)
    t_end = max([s[1] for s in spans] + all_times + [t0 + 1.0])
    scale, unit = _time_unit(t_end - t0)

    def x(t: float) -> float:
        return (t - t0) / scale

    cost = cost_breakdown(data.metrics, data.events, now=now)
    fig = Figure(figsize=(11, 9 if cost is None else 10), dpi=100)
    FigureCanvasAgg(fig)
    if cost is None:
        axes = fig.subplots(4, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2, 1.3, 1.6]})
    else:  # a fifth panel, on an axis of its own: where the money went
        *axes, ax_cost = fig.subplots(5, 1, gridspec_kw={"height_ratios": [3, 2, 1.3, 1.6, 0.8]})
        for ax in axes[1:]:
            ax.sharex(axes[0])
        for ax in axes[:-1]:
            ax.tick_params(labelbottom=False)
        _draw_cost(ax_cost, cost)
    ax_loss, ax_tps, ax_ws, ax_ev = axes

    good = sorted((m for m in data.metrics if id(m) in kept and m.get("time")), key=lambda m: m["time"])
    lost = sorted((m for m in data.metrics if id(m) not in kept and m.get("time")), key=lambda m: m["time"])
    setup = _setup_spans(data.events)
    # Lines break where training did not run: setups (restarts) and gaps between sessions.
    breaks = sorted([a for a, _ in setup] + [end for end, _ in spans[:-1]])
    if good:
        ax_loss.plot(*_broken(good, "loss", breaks, x), ".-", color="tab:blue", ms=3, lw=1)
        ax_tps.plot(*_broken(good, "tokens_per_s", breaks, x), ".-", color="tab:orange", ms=3, lw=1)
    if lost:
        ax_loss.plot([x(m["time"]) for m in lost], [m.get("loss") for m in lost], "x", color="0.6", ms=4,
                     label="rolled back by a restart")
        ax_tps.plot([x(m["time"]) for m in lost if m.get("tokens_per_s")],
                    [m["tokens_per_s"] for m in lost if m.get("tokens_per_s")], "x", color="0.6", ms=4)
    ax_loss.set_ylabel("loss")
    ax_tps.set_ylabel("tokens/s")

    # World size: from the metrics (per step) and the events that change it (plans, restarts).
    ws_points = sorted([(m["time"], m["world_size"]) for m in data.metrics if m.get("world_size") and m.get("time")]
                       + [(e.time, e.world_size) for e in data.events
                          if isinstance(e, (ev.PlanChosen, ev.WorkersStarted, ev.Restarted))
                          and e.world_size and e.time])
    if ws_points:
        ws_x = [x(t) for t, _ in ws_points] + [x(t_end)]
        ws_y = [w for _, w in ws_points] + [ws_points[-1][1]]
        ax_ws.step(ws_x, ws_y, where="post", color="tab:green")
        ax_ws.set_ylim(0, max(ws_y) * 1.25 + 0.5)
    ax_ws.set_ylabel("world size")

    # Time between driver sessions: nobody's wall time (not in goodput's denominator).
    for (_, end), (nxt, _) in zip(spans, spans[1:]):
        for ax in axes:
            ax.axvspan(x(end), x(nxt), color="0.92", zorder=0)

    # Setup: placing and starting workers (and loading a checkpoint) before steps resume.
    for a, b in setup:
        for ax in axes:
            ax.axvspan(x(a), x(b), color="gold", alpha=0.15, zorder=0)

    markers = marker_events(data.events)
    kinds = [k for k in MARKER_KINDS if any(e.kind is k for e in markers)]
    drawn = 0
    for row, kind in enumerate(kinds):
        label, color, marker = MARKER_KINDS[kind]
        xs = [x(e.time) for e in markers if e.kind is kind]
        coll = ax_ev.scatter(xs, [row] * len(xs), marker=marker, color=color, s=60, zorder=3)
        drawn += len(coll.get_offsets())
        for ax in (ax_loss, ax_tps, ax_ws):
            for xv in xs:
                ax.axvline(xv, color=color, lw=0.9, ls="--", alpha=0.7, zorder=1)
        prev_x, lift = None, False
        for e in markers:
            if e.kind is kind and e.step is not None:
                # Neighbours closer than 3% of the axis: alternate label heights.
                lift = (not lift) if prev_x is not None and x(e.time) - prev_x < 0.03 * x(t_end) else False
                prev_x = x(e.time)
                ax_ev.annotate(str(e.step), (prev_x, row), textcoords="offset points",
                               xytext=(0, 15 if lift else 6), ha="center", fontsize=7, color=color)
    ax_ev.set_yticks(range(len(kinds)), [MARKER_KINDS[k][0] for k in kinds], fontsize=8)
    ax_ev.set_ylim(-0.7, max(len(kinds), 1) - 0.3)
    ax_ev.set_xlabel(f"wall-clock time since the run started ({unit}); numbers on markers are steps")
    ax_ev.set_title("events", fontsize=9, loc="left")
    handles = [Line2D([], [], color=MARKER_KINDS[k][1], marker=MARKER_KINDS[k][2], ls="--", lw=0.9,
                      label=MARKER_KINDS[k][0]) for k in kinds]
    if lost:
        handles.append(Line2D([], [], color="0.6", marker="x", ls="", label="rolled back by a restart"))
    if setup:
        handles.append(Patch(color="gold", alpha=0.3, label="setup (place, start, load)"))
    if len(spans) > 1:
        handles.append(Patch(color="0.85", label="no driver (stopped)"))
    if handles:
        # Outside the plot, right of the loss panel: it never hides the curve.
        ax_loss.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    for ax in axes:
        ax.grid(True, alpha=0.3)
    ax_ev.set_xlim(min(0.0, x(t0)) - 0.01 * x(t_end), x(t_end) * 1.02 + 1e-9)

    res = data.result or {}
    terminal = [e for e in data.events if isinstance(e, TERMINAL_EVENTS)]
    status = res.get("status") or ("running" if data.live else
                                   _STATUS_AFTER[type(terminal[-1])] if terminal else "unknown")
    steps = max(history) if history else 0
    target = res.get("target_steps") or next((e.target_steps for e in data.events
                                              if isinstance(e, ev.RunStarted)), None)
    fig.suptitle(f"rayflex run {data.name!r} ({status}, step {steps}/{target})  —  goodput {gp.value:.1%}  "
                 f"({gp.useful_s:.1f}s committed step time / {gp.wall_s:.1f}s wall)"
                 + ("" if cost is None else f"  —  {_usd(cost.total_usd)}".replace("$", r"\$")), fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    summary = {"name": data.name, "status": status, "steps": steps, "target_steps": target,
               "markers": drawn, "marker_kinds": {k.value: sum(e.kind is k for e in markers) for k in kinds},
               "rolled_back_points": len(lost), "sessions": len(spans), **gp.to_dict()}
    if cost is not None:
        summary.update(cost_usd=cost.total_usd, usd_per_1k_tokens=cost.usd_per_1k_tokens,
                       cost_parts_usd=cost.parts_usd, cost_seconds=cost.seconds,
                       unpriced_nodes=list(cost.unpriced_nodes))
    diagnosed = [e for e in data.events if isinstance(e, ev.HangDiagnosed)]
    if diagnosed:
        summary["hang_diagnosis"] = f"step {diagnosed[-1].step}: {diagnosed[-1].verdict}"
    return buf.getvalue(), summary


# Colours of the cost categories (rayflex.telemetry.cost.CATEGORIES), useful work first.
COST_COLOURS = {"training": "tab:green", "stragglers": "tab:gray", "checkpoint_stalls": "tab:olive",
                "setup": "gold", "recovery": "tab:purple", "capacity_wait": "tab:orange",
                "recomputed": "tab:red", "uncommitted": "tab:pink"}


def _usd(v: Optional[float]) -> str:
    return "n/a" if v is None else f"${v:,.2f}" if v >= 1 else f"${v:.4f}"


def _draw_cost(ax, cost) -> None:
    """One bar, the run's dollars split by category, each part labelled with its share."""
    left = 0.0
    for category in CATEGORIES:
        part = cost.parts_usd[category]
        if part <= 0:
            continue
        ax.barh([0], [part], left=left, color=COST_COLOURS[category], label=category.replace("_", " "))
        if part >= 0.06 * cost.total_usd:
            ax.text(left + part / 2, 0, f"{part / cost.total_usd:.0%}", ha="center", va="center", fontsize=8)
        left += part
    ax.set_yticks([])
    ax.set_xlim(0, max(cost.total_usd, 1e-9))
    per_1k = "" if cost.usd_per_1k_tokens is None else f", {_usd(cost.usd_per_1k_tokens)} per 1k tokens"
    title = f"cost: {_usd(cost.total_usd)}{per_1k}, {cost.node_hours:.3g} node-hours"
    ax.set_title(title.replace("$", r"\$"), fontsize=9, loc="left")  # not matplotlib's math mode
    ax.set_xlabel("dollars")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def _cost_html(summary: dict) -> str:
    """The cost section: dollars and seconds per category, with their shares."""
    parts, seconds, total = summary.get("cost_parts_usd"), summary.get("cost_seconds"), summary.get("cost_usd")
    if not parts:
        return ""
    rows = "".join(f"<tr><td>{html.escape(c)}</td><td>{_usd(parts[c])}</td><td>{parts[c] / total:.1%}</td>"
                   f"<td>{seconds[c]:.1f}</td></tr>" for c in CATEGORIES if total and seconds.get(c))
    unpriced = summary.get("unpriced_nodes")
    note = (f"<p>Held without a price (charged nothing): {html.escape(', '.join(unpriced))}.</p>"
            if unpriced else "")
    return (f"<h2>Cost</h2><p>{_usd(total)} in all, {_usd(summary.get('usd_per_1k_tokens'))} per 1k tokens "
            f"trained: every node the run held, at its price per hour, over the seconds below.</p>{note}"
            f"<table class=\"cost\"><tr><th>where the money went</th><th>dollars</th><th>share</th>"
            f"<th>seconds</th></tr>{rows}</table>\n")


def _html(png: bytes, summary: dict, events: list[ev.Event]) -> str:
    t0 = events[0].time if events else 0
    rows = "\n".join(_html_row(e.to_dict(), t0) for e in events if e.time is not None)
    facts = "".join(f"<li><b>{html.escape(k)}</b>: {html.escape(_fmt(v))}</li>" for k, v in summary.items())
    b64 = base64.b64encode(png).decode()
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>rayflex run {html.escape(summary['name'])}</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse;font-size:90%}}
td,th{{border:1px solid #ccc;padding:2px 6px;text-align:left}}</style></head>
<body data-markers="{summary['markers']}" data-goodput="{summary['goodput']:.6f}">
<h1>rayflex run {html.escape(summary['name'])}</h1>
<p>Goodput {summary['goodput']:.1%}: committed useful step time / wall time of the driver sessions.</p>
<img alt="loss, throughput, world size and events of run {html.escape(summary['name'])}"
     src="data:image/png;base64,{b64}">
<h2>Summary</h2><ul>{facts}</ul>
{_cost_html(summary)}{_diagnoses_html(events)}<h2>Events</h2><table><tr><th>t (s)</th><th>kind</th><th>step</th><th>detail</th></tr>
{rows}
</table></body></html>
"""


def _diagnoses_html(events: list[ev.Event]) -> str:
    """A section per hang diagnosis: the verdict and one row per rank of its group."""
    out = []
    for e in events:
        if not isinstance(e, ev.HangDiagnosed):
            continue
        columns = [c for c in ("rank", "step", "phase", "last_completed", "sent", "received", "at")
                   if any(c in row for row in e.table)]
        head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
        rows = "".join("<tr>" + "".join(f"<td>{html.escape(str(row.get(c, '')))}</td>" for c in columns) + "</tr>"
                       for row in e.table)
        out.append(f"<h2>Hang diagnosed at step {e.step}</h2><p class=\"diagnosis\">{html.escape(e.verdict)}</p>"
                   f"<table><tr>{head}</tr>{rows}</table>")
    return "\n".join(out) + ("\n" if out else "")


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else json.dumps(v) if isinstance(v, (dict, list)) else str(v)


def _html_row(d: dict, t0: float) -> str:
    """One row of the event table, from the event's stored form (an unknown kind too)."""
    return (f"<tr><td>{d['time'] - t0:.1f}</td><td>{html.escape(str(d['kind']))}</td>"
            f"<td>{'' if d.get('step') is None else d['step']}</td>"
            f"<td>{html.escape(_event_detail(d))}</td></tr>")


def _event_detail(e: dict) -> str:
    skip = {"kind", "time", "step", "explanation", "rank_to_node", "planned_rank_to_node", "stage_costs"}
    parts = [f"{k}={v}" for k, v in e.items() if k not in skip and v not in (None, "", [], {}, 0, 0.0)]
    return " ".join(parts)[:300]


def drawn_at_run_end() -> bool:
    """Whether a run draws its report when it ends (``RAYFLEX_RUN_REPORT``, default on).

    Drawing costs the controller about a CPU-second (matplotlib) before the run returns;
    ``RAYFLEX_RUN_REPORT=0`` skips it (sweeps, CI), and ``rayflex report NAME`` draws the
    same report from the run directory at any time later."""
    raw = os.environ.get("RAYFLEX_RUN_REPORT", "1").strip().lower()
    if raw not in ("0", "1", "false", "true", "no", "yes", "off", "on"):
        raise ValueError(f"RAYFLEX_RUN_REPORT={raw!r}: use 1 (draw the report when a run ends) or 0 (do not)")
    return raw in ("1", "true", "yes", "on")


def write_report(run_dir_uri: str, out_dir: Optional[str] = None) -> tuple[str, str]:
    """Render the report of ``run_dir_uri`` into ``out_dir`` (default: the run directory).

    Returns the URIs of the PNG and the HTML page; ``report.json`` lies beside them.
    """
    data = ReportData.load(run_dir_uri)
    png, summary = render(data)
    out = (out_dir or run_dir_uri).rstrip("/")
    if "://" not in out:
        out = "file://" + os.path.abspath(out)
    fs, path = rfs.resolve(out)
    rfs.ensure_dir(fs, path)
    uris = {name: f"{out}/{name}" for name in FILES}
    summary.update({"png": uris["report.png"], "html": uris["report.html"]})
    payloads = {"report.png": png, "report.html": _html(png, summary, data.events).encode(),
                "report.json": json.dumps(summary, indent=2, default=str).encode()}
    for name, payload in payloads.items():
        _write(fs, f"{path}/{name}", payload, uris[name])
    return uris["report.png"], uris["report.html"]


def _write(fs, path: str, payload: bytes, uri: str) -> None:
    rfs.with_retries(lambda: fs.pipe_file(path, payload), what=f"write {rfs.redact_uri(uri)}")


# ------------------------------------------------------------------ command line
def resolve_run_dir(name: str, storage: Optional[str] = None) -> str:
    """NAME may be a run directory (path or URI), or a run name under ``storage``
    (default ``$RAYFLEX_DEMO_STORAGE`` or ``./runs``), or a live run on the cluster."""
    if "://" in name or os.sep in name:
        return name if "://" in name else "file://" + os.path.abspath(name)
    if storage:
        return storage.rstrip("/") + "/" + name
    from rayflex.constants import default_storage

    default = default_storage()
    candidate = default.rstrip("/") + "/" + name
    from rayflex.storage.rundir import RunDirectory

    if RunDirectory(candidate).exists("events.jsonl"):
        return candidate
    try:  # a live run knows its own run directory
        from rayflex.telemetry.status import run_statuses

        for row in run_statuses(name=name):
            if row.get("run_dir"):
                return row["run_dir"]
    except Exception:  # noqa: BLE001 - no cluster: fall through to the clear error below
        pass
    from rayflex.errors import RayflexError

    raise RayflexError(f"no run {name!r} under {default} and none live on the cluster; pass --storage URI "
                       f"(where the run's directory lives) or the run directory itself")
