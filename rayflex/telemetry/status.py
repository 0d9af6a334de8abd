"""Run status from anywhere: live runs from their named Controller actors, the others from
their run directories (``result.json``, ``metrics.jsonl``, ``events.jsonl``).

Any process connected to the cluster finds the live runs (the Controller is a named actor
in namespace ``rayflex``); ``--storage`` adds the runs whose driver is gone. Goodput and
cost come from the run's timeline (:mod:`rayflex.telemetry.goodput`,
:mod:`rayflex.telemetry.cost`), live or not.
"""

from __future__ import annotations

import logging
from typing import Optional

from rayflex.constants import CONTROLLER_NAMESPACE
from rayflex.telemetry import events as ev
from rayflex.telemetry.cost import cost_breakdown
from rayflex.telemetry.goodput import TERMINAL_EVENTS, goodput

log = logging.getLogger(__name__)

_STATE_AFTER = {ev.RunFinished: "FINISHED", ev.RunFailedEvent: "FAILED", ev.RunStopped: "STOPPED"}

COLUMNS = ("name", "state", "step", "target_steps", "loss", "tokens_per_s", "world_size", "last_checkpoint",
           "restarts", "goodput", "cost_usd")


def live_runs() -> dict[str, object]:
    import ray

    out = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"] if isinstance(entry, dict) else entry
        ns = entry.get("namespace") if isinstance(entry, dict) else CONTROLLER_NAMESPACE
        if ns == CONTROLLER_NAMESPACE and name.startswith("rayflex-controller:"):
            out[name.split(":", 1)[1]] = ray.get_actor(name, namespace=ns)
    return out


def _timeline(run_dir: str) -> tuple[list[dict], list[ev.Event]]:
    from rayflex.storage.rundir import RunDirectory

    rd = RunDirectory(run_dir)
    return rd.read_jsonl("metrics.jsonl"), ev.as_events(rd.read_jsonl("events.jsonl"))


def row_from_run_dir(run_dir: str) -> Optional[dict]:
    """The status of a run from its directory alone (None: not a run directory)."""
    from rayflex.storage.rundir import RunDirectory

    rd = RunDirectory(run_dir)
    res = rd.read_json("result.json")
    metrics, events = _timeline(run_dir)
    if res is None and not events:
        return None
    name = run_dir.rstrip("/").rsplit("/", 1)[-1]
    last = metrics[-1] if metrics else {}
    ends = [e for e in events if isinstance(e, TERMINAL_EVENTS)]
    starts = [e for e in events if isinstance(e, ev.RunStarted)]
    commits = [e for e in events if isinstance(e, ev.CheckpointCommitted)]
    newest = [e for e in ends if not starts or e.time >= starts[-1].time]
    if newest:
        state = _STATE_AFTER[type(newest[-1])]
    elif res is not None and not starts:
        state = res["status"].upper()
    else:
        # The newest session never ended: its driver was killed (or it is still running
        # on a cluster this process is not connected to).
        state = "NO DRIVER"
    res = res or {}
    return {"name": name, "state": state, "step": res.get("steps_completed", last.get("step", 0)),
            "target_steps": res.get("target_steps", starts[-1].target_steps if starts else None),
            "loss": last.get("loss"), "tokens_per_s": last.get("tokens_per_s"),
            "world_size": res.get("world_size", last.get("world_size")),
            "last_checkpoint": res.get("last_checkpoint") or (
                {"step": commits[-1].step, "uri": commits[-1].uri} if commits else None),
            "restarts": res.get("restarts", sum(isinstance(e, ev.Restarted) for e in events)),
            "goodput": res["goodput"] if res.get("goodput") is not None else goodput(metrics, events),
            **_cost_columns(res["cost"] if res.get("cost") is not None else _cost(metrics, events)),
            "run_dir": run_dir}


def _cost(metrics: list[dict], events, now: Optional[float] = None) -> Optional[dict]:
    cost = cost_breakdown(metrics, events, now=now)
    return cost.to_dict() if cost is not None else None


def _cost_columns(cost: Optional[dict]) -> dict:
    """The status row's cost: the total, dollars per 1k tokens, and the breakdown."""
    if cost is None:
        return {"cost_usd": None, "usd_per_1k_tokens": None, "cost": None}
    return {"cost_usd": cost["total_usd"], "usd_per_1k_tokens": cost["usd_per_1k_tokens"], "cost": cost}


def finished_runs(storage: str) -> list[dict]:
    """Every run directory under ``storage`` (a run with no live Controller is finished,
    stopped, failed, or lost its driver)."""
    from rayflex.storage import fs as rfs

    fs, root = rfs.resolve(storage)

    def _ls() -> list[dict]:
        fs.invalidate_cache(root)  # runs written by other processes since the last listing
        try:
            return fs.ls(root, detail=True)
        except FileNotFoundError:
            return []

    rows = []
    entries = rfs.with_retries(_ls, what=f"list {rfs.redact_uri(storage)}")
    for entry in sorted(entries, key=lambda e: e["name"]):
        if entry.get("type") != "directory":
            continue
        name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        try:
            row = row_from_run_dir(storage.rstrip("/") + "/" + name)
        except Exception as e:  # noqa: BLE001 - one unreadable directory must not hide the rest
            log.warning("skipping %s/%s: %s", storage, name, e)
            continue
        if row is not None:
            rows.append(row)
    return rows


def live_row(actor) -> dict:
    """A live run's status from its Controller, plus goodput from its run directory."""
    import ray

    row = ray.get(actor.status.remote(), timeout=10)
    row.pop("workers", None)
    try:
        import time

        metrics, events = _timeline(row["run_dir"])
        now = time.time()
        row["goodput"] = goodput(metrics, events, now=now)
        row.update(_cost_columns(_cost(metrics, events, now)))
    except Exception:  # noqa: BLE001 - storage unreachable from here: status still works
        row.update(goodput=None, **_cost_columns(None))
    return row


def _loopback_target() -> bool:
    """Whether the cluster we would join listens on loopback (RAY_ADDRESS, else the one
    ``ray start`` recorded), read without importing Ray."""
    import os

    address = os.environ.get("RAY_ADDRESS")
    if not address:
        # Where Ray keeps it: RAY_TMPDIR, else TMPDIR (Linux), else /tmp; then ray/.
        temp = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
        try:
            with open(os.path.join(temp, "ray", "ray_current_cluster")) as f:
                address = f.read().strip()
        except OSError:
            return False
    host = address.split("://")[-1].rsplit(":", 1)[0]
    return host in ("127.0.0.1", "localhost", "::1", "[::1]")


def run_statuses(name: Optional[str] = None, storage: Optional[str] = None) -> list[dict]:
    import os
    import sys

    if "ray" not in sys.modules and _loopback_target():
        # Ray reads this when imported: without it, it rewrites 127.0.0.1 in the address
        # to this machine's network IP, where a loopback-only cluster does not listen
        # (ray.init then retries for a minute and more).
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    from rayflex.local_ray import ensure_ray

    rows: dict[str, dict] = {}
    if storage:
        for row in finished_runs(storage):
            rows[row["name"]] = row
    try:
        ensure_ray(connect_only=True)
    except ConnectionError:
        pass
    if ray.is_initialized():
        for run, actor in live_runs().items():
            if name is not None and run != name:
                continue
            try:
                rows[run] = live_row(actor)
            except Exception as e:  # noqa: BLE001 - an exiting controller
                rows[run] = {**rows.get(run, {"name": run}), "state": f"UNREACHABLE ({type(e).__name__})"}
    out = list(rows.values())
    return [r for r in out if name is None or r.get("name") == name]
