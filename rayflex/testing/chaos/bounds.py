"""How fast each injected fault must be named: the detector's own wait (the run's knobs),
plus what this machine measured in the same run (its step time, and any restart the fault
landed in) — never a fixed number of seconds that holds on one host and not on a 3x slower one.

Per kind, the mechanism that names it:

* ``kill_actor``, ``raise_once`` — the next poll (``POLL_INTERVAL_S``) gets Ray's death
  notice or the rank's traceback; a death Ray reports later than the heartbeat timeout is
  named by the heartbeat instead (``HEARTBEAT_TIMEOUT_S`` added).
* ``remove_node`` — the node's actors die with it (the next poll), or the next refresh of
  Ray's node list (``NODES_REFRESH_S``) misses it: the slower of the two.
* ``sigstop`` — a frozen rank answers no poll: named once its silence passes the heartbeat
  timeout, at the poll after.
* ``preempt_*`` — the drain is read every ``NOTICE_POLL_S``, acted on in that cycle.
* ``slow_node`` — the straggler signal names a rank last to arrive in 80% of the steps of
  the last ``STRAGGLER_WINDOW_S`` (at least 10 steps): a window of slow steps, or 10 of
  them where they are longer than a tenth of it (the slow step as the straggler policy
  measured it, else the run's median), then the next poll.
* ``s3_down`` — the product's promise (:func:`storage_outage_bound_s`): the recorder's
  ticker, which no step or poll delays. No slack: the promise holds on any host.
* ``corrupt_checkpoint`` — named by the restore of the restart that follows the kill it
  comes with: the kill's bound plus that restart's own duration, read off the timeline (or
  by that restart's choice to resume from the survivors' memory, which reads no checkpoint).

Every bound but the outage's gets ``SLACK_STEPS`` x the run's median step time: the
controller's cycle and Ray's notices share the cores with the ranks, so on a host k times
slower they take about k times longer, as the step does. A fault that lands while the
controller restarts the run (overlap mode) is timed from the end of that restart: until
then no attempt is polled, and what the restart itself saw is named earlier still.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Optional

from rayflex.constants import knob
from rayflex.telemetry import events as ev

# Controller cycles and Ray notices stretch with the host as a step does. CI's seed on the
# 2-core host of 2026-12-05 (0.092 s median step: 0.55 s of slack): the detections beyond
# their knobs' wait took at most 0.06 s (a spot notice 0.16 s against 0.6 s of knobs).
SLACK_STEPS = 6.0


def storage_outage_bound_s() -> float:
    """What the product promises for an object-store outage, from its own mechanism: the
    recorder's ticker starts a write of the run directory every ``RUNDIR_FLUSH_S`` whatever
    the controller is doing, and names a write still unfinished after ``STORAGE_STALL_S``
    (or one that failed) at its next tick. The first write to hit the outage starts within
    one interval of it: named within ``STORAGE_STALL_S + 2 x RUNDIR_FLUSH_S`` (7 s by
    default) on any host — no step time, poll or restart in it."""
    return knob("STORAGE_STALL_S") + 2 * knob("RUNDIR_FLUSH_S")


@dataclass(frozen=True)
class DetectionTiming:
    """What bounds detection in one run: its knobs and its measured median step time."""

    poll_s: float
    notice_poll_s: float
    nodes_refresh_s: float
    heartbeat_s: float
    step_s: float

    @classmethod
    def of_run(cls, heartbeat_s: float, metrics: list[dict]) -> "DetectionTiming":
        """The knobs as this process reads them (the chaos run's) and the run's step times."""
        times = [float(m["step_time_s"]) for m in metrics if m.get("step_time_s")]
        return cls(poll_s=knob("POLL_INTERVAL_S"), notice_poll_s=knob("NOTICE_POLL_S"),
                   nodes_refresh_s=knob("NODES_REFRESH_S"), heartbeat_s=heartbeat_s,
                   step_s=statistics.median(times) if times else 0.0)

    @property
    def slack_s(self) -> float:
        return SLACK_STEPS * self.step_s

    def mechanism_s(self, kind: str, named: Optional[ev.Event] = None, slow_step_s: float = 0.0) -> float:
        """The detector's own wait for ``kind`` (``named``: the event that named it)."""
        if kind in ("kill_actor", "raise_once", "corrupt_checkpoint"):
            silent = kind == "kill_actor" and isinstance(named, ev.HangDetected)
            return self.poll_s + (self.heartbeat_s if silent else 0.0)
        if kind == "remove_node":
            return max(self.poll_s, self.nodes_refresh_s) + self.poll_s
        if kind == "sigstop":
            return self.heartbeat_s + 2 * self.poll_s  # its last answer: up to a poll before the stop
        if kind in ("preempt_long", "preempt_short"):
            return self.notice_poll_s + self.poll_s
        if kind == "slow_node":
            return max(knob("STRAGGLER_WINDOW_S"), 10 * max(slow_step_s, self.step_s)) + self.poll_s
        raise ValueError(f"unknown fault kind {kind!r}")


def restart_windows(events: list[ev.Event]) -> list[tuple[float, float]]:
    """(detected, restarted) for every restart on the timeline: the controller restarting."""
    return [(e.fault_time, e.time) for e in events if isinstance(e, ev.Restarted) and e.fault_time]


def clock_start(fault_time: float, windows: list[tuple[float, float]]) -> float:
    """When the detector could first see a fault at ``fault_time``: then, or the end of the
    restart it landed in."""
    inside = [end for start, end in windows if start <= fault_time < end]
    return max(inside, default=fault_time)


def bound_s(fault: dict, named: Optional[ev.Event], events: list[ev.Event], timing: DetectionTiming) -> float:
    """Seconds after the fault by which ``named`` must have come."""
    kind = fault["kind"]
    if kind == "s3_down":
        return storage_outage_bound_s()
    windows = restart_windows(events)
    start = clock_start(fault["time"], windows)
    slow = [e.slow_step_s for e in events if isinstance(e, ev.StragglerDecided) and e.node_id == fault.get("node_id")]
    bound = start - fault["time"] + timing.mechanism_s(kind, named, max(slow, default=0.0)) + timing.slack_s
    if kind == "corrupt_checkpoint":  # + the restart that follows the kill, which restores
        after = [(s, e) for s, e in windows if s >= fault["time"]]
        if after:
            bound += after[0][1] - after[0][0]
    return round(bound, 3)
