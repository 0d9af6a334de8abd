"""Experiment trackers (TensorBoard, MLflow, W&B) as callbacks of the run's Recorder.

``RunConfig(loggers=("tensorboard", "mlflow", "wandb"))`` picks them. This module is the
registry only (names and the packages they need), so ``RunConfig`` can validate a name
and check the package on the driver without importing any tracker library; the backends
are imported in the Controller when the run opens them (``tracker_set.py``).
"""

from __future__ import annotations

# The registry is config's (``RunConfig`` validates names and packages with it; config
# sits below telemetry): re-exported here for the backends.
from rayflex.config import EXTRA_HINT, TRACKERS, TrackerInfo, missing_package

__all__ = ["EXTRA_HINT", "TRACKERS", "TrackerInfo", "missing_package"]
