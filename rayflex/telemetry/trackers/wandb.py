"""A W&B run per rayflex run. Its id is stored in ``trackers.json`` and passed back with
``resume="allow"`` on a resume by name, so the curves continue in the same W&B run (an
offline run is synced into it by ``wandb sync``). W&B steps must only grow, which the
TrackerSet guarantees: it hands W&B each step once, when it is final.

``mode``: "online", "offline" or "disabled" (None: W&B's own default, ``WANDB_MODE``).
Files go to ``directory``, else to a local run directory, else to W&B's default.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from typing import Optional

from rayflex.storage import fs as rfs
from rayflex.telemetry.trackers.tracker import KeyEvent, RunEnd, Tracker


class WandbTracker(Tracker):
    name = "wandb"

    def __init__(self, *, project: str, mode: Optional[str], directory: Optional[str], run_name: str,
                 run_dir: str):
        self.project, self.mode, self.run_name = project, mode, run_name
        if directory is None:
            fs, path = rfs.resolve(run_dir)
            directory = path if rfs.is_local(fs) else None
        self.directory = directory
        self.run = None

    def open(self, state: Optional[dict]) -> dict:
        wandb = _import_wandb(self.directory)
        state = state or {}
        run_id = state.get("run_id") if state.get("project") == self.project else None
        run_id = run_id or uuid.uuid4().hex[:12]
        settings = wandb.Settings(silent=True, console="off", disable_git=True, save_code=False)
        self.run = wandb.init(project=self.project, id=run_id, resume="allow", name=self.run_name,
                              mode=self.mode, dir=self.directory, settings=settings)
        return {"run_id": run_id, "project": self.project}

    def log_metrics(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def log_event(self, event: KeyEvent) -> None:
        self.run.summary[f"events/{event.name}"] = event.count
        self.run.summary["rayflex/last_event"] = event.text[:4000]

    def close(self, end: RunEnd, goodput: Optional[float], step: int) -> None:
        if goodput is not None:
            self.run.summary["run/goodput"] = goodput
        self.run.summary["rayflex/end"] = end.value
        self.run.finish(exit_code=0 if end is RunEnd.FINISHED else 1)


def _import_wandb(directory: Optional[str]):
    """``wandb``, imported with Python's temporary directory inside ``directory``: the
    import makes two temporary directories (media, artifacts) that only the interpreter's
    exit removes, so a process killed with its run (a controller on a lost node) left them
    in /tmp; under the run's W&B directory they go with it."""
    import sys

    if directory is None or "wandb" in sys.modules:
        import wandb

        return wandb
    tmp = os.path.join(directory, ".tmp")
    os.makedirs(tmp, exist_ok=True)
    before, tempfile.tempdir = tempfile.tempdir, tmp
    try:
        import wandb
    finally:
        tempfile.tempdir = before
    return wandb
