"""Run status from anywhere: live runs from their named Controller actors, finished runs
from their run directories (``result.json``, ``metrics.jsonl``)."""

from __future__ import annotations

from typing import Optional

from rayflex.platform.controller import CONTROLLER_NAMESPACE


def live_runs() -> dict[str, object]:
    import ray

    out = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"] if isinstance(entry, dict) else entry
        ns = entry.get("namespace") if isinstance(entry, dict) else CONTROLLER_NAMESPACE
        if ns == CONTROLLER_NAMESPACE and name.startswith("rayflex-controller:"):
            out[name.split(":", 1)[1]] = ray.get_actor(name, namespace=ns)
    return out


def finished_runs(storage: str) -> list[dict]:
    import fsspec

    from rayflex.storage.rundir import RunDirectory

    fs, root = fsspec.core.url_to_fs(storage)
    rows = []
    try:
        entries = fs.ls(root, detail=False)
    except FileNotFoundError:
        return rows
    for path in sorted(entries):
        name = path.rstrip("/").rsplit("/", 1)[-1]
        rd = RunDirectory(storage.rstrip("/") + "/" + name)
        res = rd.read_json("result.json")
        if res is None:
            continue
        metrics = rd.read_jsonl("metrics.jsonl")
        last = metrics[-1] if metrics else {}
        rows.append({"name": name, "state": res["status"].upper(), "step": res["steps_completed"],
                     "target_steps": res["target_steps"], "loss": res.get("final_loss"),
                     "tokens_per_s": last.get("tokens_per_s"), "world_size": res.get("world_size"),
                     "last_checkpoint": res.get("last_checkpoint"), "restarts": res.get("restarts"),
                     "goodput": res.get("goodput"), "run_dir": res.get("run_dir")})
    return rows


def run_statuses(name: Optional[str] = None, storage: Optional[str] = None) -> list[dict]:
    import ray

    from rayflex.trainer import ensure_ray

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
            try:
                rows[run] = ray.get(actor.status.remote(), timeout=10)
            except Exception as e:  # noqa: BLE001 - an exiting controller
                rows[run] = {"name": run, "state": f"UNREACHABLE ({type(e).__name__})"}
    out = list(rows.values())
    return [r for r in out if name is None or r.get("name") == name]
