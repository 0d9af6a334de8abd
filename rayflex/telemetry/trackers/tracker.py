"""What an experiment tracker implements, and the typed things it is handed.

A tracker sees the run as its user does: one point per metric per step, the key events
as counters, and how the run ended. It never sees a rolled-back step twice: trackers that
cannot delete points (MLflow, W&B) get a step only once a checkpoint (or the run's end)
makes it final; a tracker that can (TensorBoard, through a purge event) gets every step
live and is told to ``rewind`` when a restart rolls steps back (``tracker_set.py``).
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from typing import ClassVar, Optional

from rayflex.telemetry import events as ev


class RunEnd(enum.Enum):
    FINISHED = "finished"
    FAILED = "failed"
    STOPPED = "stopped"  # stopped or killed: a resume by name continues it


@dataclass(frozen=True)
class KeyEvent:
    """A counted event: ``count`` is the run's total so far, earlier sessions included."""

    name: str  # restarts | preemptions | checkpoints | failures
    step: int
    count: int
    text: str


# The events trackers count, by the name of their series (``events/<name>``).
KEY_EVENTS: dict[str, tuple[type[ev.Event], ...]] = {
    "restarts": (ev.Restarted,),
    "preemptions": (ev.PreemptionNotice,),
    "checkpoints": (ev.CheckpointCommitted,),
    "failures": (ev.WorkerFailed, ev.WorkerDied, ev.NodeLost, ev.HangDetected),
}

# Metric line fields that are bookkeeping, not curves.
_NOT_CURVES = ("step", "time", "ranks_reported")


def curves(line: dict) -> dict[str, float]:
    """The plotted values of one ``metrics.jsonl`` line, as ``train/<field>``."""
    return {f"train/{k}": float(v) for k, v in line.items()
            if k not in _NOT_CURVES and isinstance(v, (int, float)) and not isinstance(v, bool)}


class Tracker(abc.ABC):
    """One backend. Methods run on the trackers' own thread, never on the controller loop;
    an exception from any of them disables this tracker (logged and recorded), never the run."""

    name: ClassVar[str]
    # True: can drop points it already has (gets steps live, and ``rewind``).
    rewinds: ClassVar[bool] = False

    @abc.abstractmethod
    def open(self, state: Optional[dict]) -> dict:
        """Start, or continue the tracker run ``state`` (what ``open`` returned in an earlier
        session of this run, from ``trackers.json``). Returns the state to store."""

    @abc.abstractmethod
    def log_metrics(self, step: int, values: dict[str, float]) -> None: ...

    def rewind(self, step: int) -> None:
        """Points after ``step`` are void (a restart rolled them back); only if ``rewinds``."""
        raise NotImplementedError(f"{self.name} cannot rewind")

    @abc.abstractmethod
    def log_event(self, event: KeyEvent) -> None: ...

    def sync(self) -> None:
        """Make what was logged durable (a checkpoint committed); optional."""

    @abc.abstractmethod
    def close(self, end: RunEnd, goodput: Optional[float], step: int) -> None: ...
