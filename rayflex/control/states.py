"""The states of a run, each a frozen payload carrying what the next step needs.

INITIALIZING -> PLACING -> RUNNING -> RESTARTING -> PLACING ... -> FINISHED | FAILED | STOPPED.
A state handler takes its state and returns the next one; nothing a transition hands on
lives anywhere else.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional


class RunState(str, enum.Enum):
    INITIALIZING = "INITIALIZING"
    PLACING = "PLACING"
    RUNNING = "RUNNING"
    RESTARTING = "RESTARTING"
    FINISHED = "FINISHED"
    FAILED = "FAILED"
    STOPPED = "STOPPED"

    @property
    def terminal(self) -> bool:
        return self in (RunState.FINISHED, RunState.FAILED, RunState.STOPPED)


@dataclass(frozen=True)
class Attempt:
    """One attempt of the run: its worker group, mesh and fault detector."""

    group: Any
    plan: Any  # MeshPlan
    detector: Any  # FaultDetector


@dataclass(frozen=True)
class Initializing:
    kind = RunState.INITIALIZING


@dataclass(frozen=True)
class Placing:
    """Start an attempt. ``world_size`` None: the first start picks it. ``restart_reason``
    None: not a restart. ``survivors``: warm workers of the last attempt (actor id ->
    handle). ``workers_up``: restart now on only these slots (node -> workers), standing in
    for ``full_size`` until the newcomers are warm. ``live``: restore the survivors'
    snapshots (``control.live_state``), not a checkpoint."""

    kind = RunState.PLACING
    world_size: Optional[int] = None
    restart_reason: Optional[str] = None
    fault_time: Optional[float] = None
    survivors: Mapping[str, Any] = field(default_factory=dict)
    workers_up: Optional[Mapping[str, int]] = None
    full_size: Optional[int] = None
    live: Optional[Mapping[str, Any]] = None


@dataclass(frozen=True)
class Running:
    kind = RunState.RUNNING
    attempt: Attempt


@dataclass(frozen=True)
class Restarting:
    """``fault``: what the detector (or a notice) concluded; ``fault_time``: when."""

    kind = RunState.RESTARTING
    attempt: Attempt
    fault: Any  # Fault
    fault_time: float


@dataclass(frozen=True)
class Finished:
    kind = RunState.FINISHED


@dataclass(frozen=True)
class Failed:
    kind = RunState.FAILED
    reason: str
    error: Optional[BaseException] = None


@dataclass(frozen=True)
class Stopped:
    kind = RunState.STOPPED
    reason: str


State = Any  # one of the classes above
