"""TrackerSet: the Recorder's one callback for every experiment tracker of a run.

The Recorder hands it every metric line and event on the controller loop; it only
queues them. One background thread delivers them in order, so a tracker server that is
slow or down never stalls fault detection, and a tracker that raises is switched off for
the rest of the session with a ``tracker_failed`` event: a tracker never fails a run.

Exactly one point per step, also across restarts and resumes by name: a restart rolls
the run back to its checkpoint and trains the steps after it again. Steps therefore wait
here until they are final (a checkpoint at or after them committed, the run finished, or
a restart resumed at or after them) before trackers that cannot delete points get them;
a tracker that can (``rewinds``) gets them live and is told to rewind. What the trackers
hold (their run ids, the newest step they have) is stored as ``trackers.json`` in the run
directory, so a run resumed by name continues the same tracker runs.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, Optional

from rayflex.telemetry import events as ev
from rayflex.telemetry.trackers.tracker import KEY_EVENTS, KeyEvent, RunEnd, Tracker, curves

log = logging.getLogger(__name__)

STATE_FILE = "trackers.json"
FINISH_TIMEOUT_S = 60.0  # the end of a run waits this long for the trackers to close
TRACKER_FAILED = "tracker_failed"

_ENDS = {ev.RunFinished: RunEnd.FINISHED, ev.RunFailedEvent: RunEnd.FAILED, ev.RunStopped: RunEnd.STOPPED}


def tracker_failed_event(tracker: str, step: int, error: str) -> ev.Event:
    """A ``tracker_failed`` line in events.jsonl. events.py has no typed kind for it yet, so
    it is carried as the kind-preserving UnknownEvent (readers skip it, the report lists it)."""
    now = time.time()
    return ev.UnknownEvent(stored_kind=TRACKER_FAILED, time=now, step=step,
                           data={"time": now, "step": step, "tracker": tracker, "error": error})


def build_trackers(run, rundir) -> list[Tracker]:
    """The trackers ``run.loggers`` names (a RunConfig validated on the driver)."""
    out: list[Tracker] = []
    for name in run.loggers:
        if name == "tensorboard":
            from rayflex.telemetry.trackers.tensorboard import TensorBoardTracker

            out.append(TensorBoardTracker(rundir.store, "tensorboard"))
        elif name == "mlflow":
            from rayflex.telemetry.trackers.mlflow import MlflowTracker

            out.append(MlflowTracker(tracking_uri=run.mlflow_tracking_uri, experiment=run.mlflow_experiment,
                                     run_name=run.name, run_dir=rundir.uri))
        elif name == "wandb":
            from rayflex.telemetry.trackers.wandb import WandbTracker

            out.append(WandbTracker(project=run.wandb_project, mode=run.wandb_mode, directory=run.wandb_dir,
                                    run_name=run.name, run_dir=rundir.uri))
    return out


class TrackerSet:
    def __init__(self, trackers: list[Tracker], rundir, on_failure: Callable[[ev.Event], object]):
        self.trackers = list(trackers)
        self.rundir = rundir
        self._on_failure = on_failure
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="trackers") if self.trackers else None
        self._opened = self._closed = False
        self._state: dict = {}
        self._pending: list[tuple[int, dict[str, float]]] = []  # steps not final yet
        self._logged = 0  # newest step the non-rewinding trackers have
        self._final = 0   # steps up to here are final (a commit can be heard before its step's line)
        self._live = 0    # newest step the rewinding trackers have
        self._step = 0
        self._counts = {name: 0 for name in KEY_EVENTS}
        self._end: Optional[RunEnd] = None

    @classmethod
    def for_run(cls, run, rundir, on_failure) -> "TrackerSet":
        return cls(build_trackers(run, rundir) if getattr(run, "loggers", ()) else [], rundir, on_failure)

    # ----------------------------------------------------------------- controller loop
    def resumed(self, timeline: ev.Timeline, lines: list[dict]) -> None:
        """The run directory had history: its events are counted on, its steps were live,
        and those the trackers never got (the last session ended before they were final)
        wait again: the resumed attempt's start step says which are final."""
        counts = {name: sum(1 for e in timeline.events if isinstance(e, classes))
                  for name, classes in KEY_EVENTS.items()}
        self._submit(self._resumed, counts, [dict(line) for line in lines])

    def on_metrics(self, line: dict) -> None:
        self._submit(self._metrics, dict(line))

    def on_event(self, event: ev.Event) -> None:
        self._submit(self._event, event)

    def finish(self, goodput: Optional[float], timeout_s: float = FINISH_TIMEOUT_S) -> None:
        """Close every tracker (waits up to ``timeout_s``; a tracker still busy is reported)."""
        if self._thread is None or self._closed:
            return
        future = self._thread.submit(self._guarded, self._close, goodput)
        try:
            future.result(timeout=timeout_s)
        except FutureTimeout:
            names = ", ".join(t.name for t in self.trackers)
            log.warning("experiment trackers (%s) did not close within %.0fs; their last points may be "
                        "missing", names, timeout_s)
            self._on_failure(tracker_failed_event(names, self._step, f"did not close within {timeout_s:.0f}s"))
        self._closed = True
        self._thread.shutdown(wait=False)

    def wait_idle(self, timeout_s: float = FINISH_TIMEOUT_S) -> None:
        """Block until everything queued so far was delivered (tests, the end of a run)."""
        if self._thread is not None and not self._closed:
            self._thread.submit(lambda: None).result(timeout=timeout_s)

    def _submit(self, fn, *args) -> None:
        if self._thread is not None and not self._closed:
            self._thread.submit(self._guarded, fn, *args)

    # ----------------------------------------------------------------- trackers' thread
    def _guarded(self, fn, *args) -> None:
        try:
            self._open()
            fn(*args)
        except Exception:  # noqa: BLE001 - the tracker plumbing must not fail the run either
            log.warning("experiment tracker delivery failed", exc_info=True)

    def _call(self, tracker: Tracker, method: str, *args):
        try:
            return getattr(tracker, method)(*args)
        except Exception as e:  # noqa: BLE001 - a tracker is switched off, the run goes on
            self.trackers = [t for t in self.trackers if t is not tracker]
            error = f"{method}: {type(e).__name__}: {e}"
            log.warning("experiment tracker %s failed (%s); it is off for the rest of this run's session. "
                        "Fix: check the tracker's server/credentials; training continues", tracker.name, error,
                        exc_info=True)
            self._on_failure(tracker_failed_event(tracker.name, self._step, error))
            return None

    def _open(self) -> None:
        if self._opened:
            return
        self._opened = True
        try:
            stored = self.rundir.read_json(STATE_FILE) or {}
        except Exception as e:  # noqa: BLE001 - an unreadable state file: start new tracker runs
            log.warning("could not read %s (%s); trackers start new runs", STATE_FILE, e)
            stored = {}
        self._logged = int(stored.get("logged_step", 0))
        for tracker in list(self.trackers):
            state = self._call(tracker, "open", stored.get(tracker.name))
            if state is not None:
                self._state[tracker.name] = state
        self._store()

    def _store(self) -> None:
        try:
            self.rundir.write_json(STATE_FILE, {"logged_step": self._logged, **self._state})
        except Exception as e:  # noqa: BLE001 - storage trouble is the Recorder's to report
            log.warning("could not store %s: %s", STATE_FILE, e)

    def _resumed(self, counts: dict[str, int], lines: list[dict]) -> None:
        self._counts.update(counts)
        self._live = self._step = int(lines[-1]["step"]) if lines else 0
        self._pending = [(int(line["step"]), curves(line)) for line in lines if int(line["step"]) > self._logged]

    def _metrics(self, line: dict) -> None:
        step, values = int(line["step"]), curves(line)
        self._step = step
        for tracker in [t for t in self.trackers if t.rewinds]:
            self._call(tracker, "log_metrics", step, values)
        self._live = max(self._live, step)
        self._pending.append((step, values))
        if step <= self._final:
            self._release(step)

    def _event(self, event: ev.Event) -> None:
        if isinstance(event, ev.WorkersStarted):  # an attempt starts at event.step: later steps are void
            start = event.step or 0
            if self._live > start:
                for tracker in [t for t in self.trackers if t.rewinds]:
                    self._call(tracker, "rewind", start)
            self._live = self._step = self._final = start
            self._pending = [p for p in self._pending if p[0] <= start]
            self._release(start)
        elif isinstance(event, ev.CheckpointCommitted) and event.step is not None:
            self._final = max(self._final, event.step)
            self._release(event.step)
            for tracker in list(self.trackers):
                self._call(tracker, "sync")
        elif isinstance(event, ev.RunFinished):
            self._release(None)
        for kind, end in _ENDS.items():
            if isinstance(event, kind):
                self._end = end
        for name, classes in KEY_EVENTS.items():
            if isinstance(event, classes):
                self._counts[name] += 1
                key = KeyEvent(name=name, step=event.step if event.step is not None else self._step,
                               count=self._counts[name], text=event.describe())
                for tracker in list(self.trackers):
                    self._call(tracker, "log_event", key)

    def _release(self, upto: Optional[int]) -> None:
        """Hand the final steps (``<= upto``; None: all) to the trackers that wait for them."""
        ready = [p for p in self._pending if upto is None or p[0] <= upto]
        self._pending = [p for p in self._pending if not (upto is None or p[0] <= upto)]
        fresh = [(step, values) for step, values in ready if step > self._logged]
        if not fresh:
            return
        for step, values in fresh:
            for tracker in [t for t in self.trackers if not t.rewinds]:
                self._call(tracker, "log_metrics", step, values)
            self._logged = step
        self._store()

    def _close(self, goodput: Optional[float]) -> None:
        end = self._end or RunEnd.STOPPED
        for tracker in list(self.trackers):
            self._call(tracker, "close", end, goodput, self._step)
        self._store()
