"""Goodput from the run timeline: committed useful step time / wall time.

Computed from ``metrics.jsonl`` and ``events.jsonl`` alone, so ``result.json``, ``rayflex
status`` and ``rayflex report`` agree, and a resumed run is accounted for as a whole.

- **Wall time** is the sum of the driver sessions: each ``run_started`` opens one, which
  lasts until its terminal event (``run_finished`` / ``run_failed`` / ``run_stopped``) or
  its last record. The time between a stop and a resubmission is nobody's wall time.
- **Useful time** is the ``step_time_s`` of the steps in the final history: a
  ``workers_started`` (or ``checkpoint_loaded`` / ``restarted``) at step ``k`` rolls back
  every step above ``k`` recorded before it, so work a restart threw away is lost time.
- **Committed**: a step counts only once it is safe, i.e. covered by the latest committed
  checkpoint, or the run finished (the end of a run leaves a checkpoint). Steps after the
  last checkpoint of a failed run would be redone on resume, so they are not goodput yet.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional, Union

from rayflex.telemetry import events as ev

TERMINAL_EVENTS = (ev.RunFinished, ev.RunFailedEvent, ev.RunStopped)

# Stored dicts are accepted too (parsed on the way in): the events of a run directory.
Events = Iterable[Union[ev.Event, dict]]


def _rollback_step(event: ev.Event) -> Optional[int]:
    """The step training continues from after ``event`` (everything recorded above it
    before the event was rolled back); None for events that roll nothing back."""
    if isinstance(event, (ev.WorkersStarted, ev.CheckpointLoaded)):
        return event.step
    if isinstance(event, ev.Restarted):
        return event.from_step
    return None


@dataclass(frozen=True)
class Goodput:
    """The accounting behind one goodput number (all times in seconds)."""

    wall_s: float
    useful_s: float       # step time of committed steps in the final history
    rolled_back_s: float  # step time of steps a restart threw away
    uncommitted_s: float  # final-history steps not (yet) covered by a checkpoint
    sessions: int         # driver sessions (run_started events)
    committed_step: Optional[int]  # the newest step that counts; None: every step

    @property
    def value(self) -> float:
        if self.wall_s <= 0:
            return 0.0
        return max(0.0, min(1.0, self.useful_s / self.wall_s))

    def to_dict(self) -> dict:
        return {"goodput": self.value, "wall_s": self.wall_s, "useful_s": self.useful_s,
                "rolled_back_s": self.rolled_back_s, "uncommitted_s": self.uncommitted_s,
                "sessions": self.sessions, "committed_step": self.committed_step}


def final_history(metrics: Iterable[dict], events: Events) -> tuple[dict[int, dict], list[dict]]:
    """(step -> metrics line of the final history, the lines a restart rolled back)."""
    timeline: list[tuple[float, int, Optional[dict], Optional[int]]] = []
    for m in metrics:
        if m.get("step") is not None:
            timeline.append((float(m.get("time") or 0.0), 1, m, None))
    for e in ev.as_events(events):
        k = _rollback_step(e)
        if k is not None and e.time is not None:
            timeline.append((float(e.time), 0, None, int(k)))
    # Stable sort: a metric line and a rollback with the same timestamp keep the rollback
    # first only when it really came first (priority 0), which is the conservative reading.
    timeline.sort(key=lambda t: (t[0], t[1]))
    history: dict[int, dict] = {}
    lost: list[dict] = []
    for _, _, rec, k in timeline:
        if rec is not None:
            if rec["step"] in history:
                lost.append(history[rec["step"]])
            history[rec["step"]] = rec
        else:
            for step in [s for s in history if s > k]:
                lost.append(history.pop(step))
    return history, lost


def sessions(metrics: list[dict], events: Events, now: Optional[float] = None) -> list[tuple[float, float]]:
    """(start, end) wall-clock intervals of the driver sessions, in order."""
    evs = sorted((e for e in ev.as_events(events) if e.time is not None), key=lambda e: e.time)
    starts = [e.time for e in evs if isinstance(e, ev.RunStarted)]
    times = sorted([e.time for e in evs] + [m["time"] for m in metrics if m.get("time") is not None])
    if not starts:
        return [(times[0], times[-1])] if times else []
    out = []
    for i, start in enumerate(starts):
        nxt = starts[i + 1] if i + 1 < len(starts) else math.inf
        inside = [e for e in evs if start <= e.time < nxt]
        terminal = [e.time for e in inside if isinstance(e, TERMINAL_EVENTS)]
        if terminal:
            end = terminal[-1]
        else:
            last = max([t for t in times if start <= t < nxt], default=start)
            # A live session (the last one, no terminal event) runs until now.
            end = max(last, now) if (now is not None and nxt is math.inf) else last
        out.append((start, end))
    return out


def goodput_breakdown(metrics: list[dict], events: Events, *, now: Optional[float] = None) -> Goodput:
    """The full accounting; ``now``: count a live run's wall time up to this moment."""
    metrics, events = list(metrics or []), ev.as_events(events or [])
    history, lost = final_history(metrics, events)
    spans = sessions(metrics, events, now)
    wall = sum(max(0.0, end - start) for start, end in spans)
    terminal = [e for e in events if isinstance(e, TERMINAL_EVENTS)]
    finished = bool(terminal) and isinstance(max(terminal, key=lambda e: e.time or 0), ev.RunFinished)
    committed_step: Optional[int] = None
    if not finished:
        # The newest commit by time (after a rollback to an older checkpoint, that older
        # step is the one a resume would start from).
        commits = [e for e in events if isinstance(e, ev.CheckpointCommitted) and e.step is not None]
        committed_step = max(commits, key=lambda e: e.time or 0).step if commits else 0
    useful = uncommitted = 0.0
    for step, m in history.items():
        dt = float(m.get("step_time_s") or 0.0)
        if committed_step is None or step <= committed_step:
            useful += dt
        else:
            uncommitted += dt
    return Goodput(wall_s=wall, useful_s=useful, rolled_back_s=sum(float(m.get("step_time_s") or 0.0) for m in lost),
                   uncommitted_s=uncommitted, sessions=len(spans), committed_step=committed_step)


def goodput(metrics: list[dict], events: Events, *, now: Optional[float] = None) -> float:
    """Committed useful step time / wall time, in [0, 1] (0.0 for an empty timeline)."""
    return goodput_breakdown(metrics, events, now=now).value
