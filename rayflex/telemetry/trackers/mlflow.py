"""An MLflow run per rayflex run, through ``MlflowClient`` (no global fluent state in the
Controller). Its run id is stored in ``trackers.json``, so a resume by name reopens the
same MLflow run (status back to RUNNING) and its curves continue where they stopped.

A ``file:`` tracking URI (or a bare path) opts into MLflow's file store, which MLflow 3
otherwise refuses (``MLFLOW_ALLOW_FILE_STORE``): naming a file store is asking for it.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Optional

from rayflex.telemetry.trackers.tracker import KeyEvent, RunEnd, Tracker

log = logging.getLogger(__name__)

_STATUS = {RunEnd.FINISHED: "FINISHED", RunEnd.FAILED: "FAILED", RunEnd.STOPPED: "KILLED"}


class MlflowTracker(Tracker):
    name = "mlflow"

    def __init__(self, *, tracking_uri: Optional[str], experiment: str, run_name: str, run_dir: str):
        self.tracking_uri, self.experiment = tracking_uri, experiment
        self.run_name, self.run_dir = run_name, run_dir
        self.client = None
        self.run_id: Optional[str] = None

    def open(self, state: Optional[dict]) -> dict:
        if self.tracking_uri and (self.tracking_uri.startswith("file:") or ":" not in self.tracking_uri):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient, get_tracking_uri

        uri = self.tracking_uri or get_tracking_uri()
        self.client = MlflowClient(uri)
        state = state or {}
        if state.get("run_id") and state.get("tracking_uri") == uri:
            self.run_id = self._reopen(state["run_id"])
        if self.run_id is None:
            found = self.client.get_experiment_by_name(self.experiment)
            experiment_id = found.experiment_id if found else self.client.create_experiment(self.experiment)
            run = self.client.create_run(experiment_id, run_name=self.run_name,
                                         tags={"rayflex.run_name": self.run_name, "rayflex.run_dir": self.run_dir})
            self.run_id = run.info.run_id
        return {"run_id": self.run_id, "tracking_uri": uri, "experiment": self.experiment}

    def _reopen(self, run_id: str) -> Optional[str]:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(run_id)
        except MlflowException as e:
            log.warning("MLflow run %s of run %s is gone (%s); starting a new MLflow run", run_id,
                        self.run_name, e)
            return None
        self.client.update_run(run_id, status="RUNNING")
        return run_id

    def log_metrics(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def log_event(self, event: KeyEvent) -> None:
        self.client.log_metric(self.run_id, f"events/{event.name}", float(event.count), step=event.step)
        self.client.set_tag(self.run_id, "rayflex.last_event", event.text[:4000])

    def close(self, end: RunEnd, goodput: Optional[float], step: int) -> None:
        if goodput is not None:
            self.client.log_metric(self.run_id, "run/goodput", goodput, step=step)
        self.client.set_terminated(self.run_id, status=_STATUS[end])
