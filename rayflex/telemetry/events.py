"""Typed events and the run timeline.

Everything that happens to a run is one frozen dataclass on the timeline, written as a
line of ``events.jsonl``. Goodput and the report are computed from the timeline alone.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

_REGISTRY: dict[str, type["Event"]] = {}


@dataclass(frozen=True, kw_only=True)
class Event:
    kind: ClassVar[str] = "event"
    time: float = field(default_factory=time.time)
    step: Optional[int] = None

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        _REGISTRY[cls.kind] = cls

    def to_dict(self) -> dict[str, Any]:
        d = {"kind": self.kind}
        d.update(dataclasses.asdict(self))
        return d

    def describe(self) -> str:
        fields = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("time",)}
        return f"{self.kind} " + " ".join(f"{k}={v}" for k, v in fields.items() if v not in (None, "", [], {}))


def event_from_dict(d: dict[str, Any]) -> Event:
    d = dict(d)
    cls = _REGISTRY.get(d.pop("kind"), Event)
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(frozen=True, kw_only=True)
class RunStarted(Event):
    kind: ClassVar[str] = "run_started"
    name: str = ""
    target_steps: int = 0
    resumed_from: Optional[int] = None


@dataclass(frozen=True, kw_only=True)
class PlanChosen(Event):
    kind: ClassVar[str] = "plan_chosen"
    world_size: int = 0
    pp: int = 1
    dp: int = 1
    schedule: str = ""
    stage_blocks: list = field(default_factory=list)
    stage_costs: list = field(default_factory=list)
    balance: str = ""
    microbatches: int = 1
    micro_batch: int = 1
    accum_steps: int = 1
    rank_to_node: list = field(default_factory=list)
    planned_rank_to_node: list = field(default_factory=list)
    modeled_comm_s: Optional[float] = None
    naive_comm_s: Optional[float] = None
    explanation: str = ""


@dataclass(frozen=True, kw_only=True)
class WorkersStarted(Event):
    kind: ClassVar[str] = "workers_started"
    world_size: int = 0
    # From the start of placement: spawning processes, rendezvous, building, restoring.
    setup_s: float = 0.0
    spawn_s: float = 0.0
    rendezvous_s: float = 0.0
    build_s: float = 0.0
    restore_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class CheckpointCommitted(Event):
    kind: ClassVar[str] = "checkpoint_committed"
    uri: str = ""
    blocked_s: float = 0.0
    total_s: float = 0.0
    bytes: int = 0
    reason: str = "periodic"


@dataclass(frozen=True, kw_only=True)
class CheckpointFailed(Event):
    kind: ClassVar[str] = "checkpoint_failed"
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class CheckpointLoaded(Event):
    kind: ClassVar[str] = "checkpoint_loaded"
    uri: str = ""
    world_size: int = 0
    saved_world_size: int = 0
    skipped: list = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class WorkerFailed(Event):
    """A worker raised in its training loop (the traceback is in ``error``)."""

    kind: ClassVar[str] = "worker_failed"
    rank: int = -1
    node_id: str = ""
    error: str = ""
    detected_after_s: Optional[float] = None


@dataclass(frozen=True, kw_only=True)
class WorkerDied(Event):
    """A worker's process is gone (actor death)."""

    kind: ClassVar[str] = "worker_died"
    rank: int = -1
    node_id: str = ""
    error: str = ""
    detected_after_s: Optional[float] = None


@dataclass(frozen=True, kw_only=True)
class NodeLost(Event):
    kind: ClassVar[str] = "node_lost"
    node_id: str = ""
    ranks: list = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class HangDetected(Event):
    kind: ClassVar[str] = "hang_detected"
    ranks: list = field(default_factory=list)
    phases: dict = field(default_factory=dict)
    stalled_s: float = 0.0
    timeout_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class StragglerDetected(Event):
    kind: ClassVar[str] = "straggler_detected"
    rank: int = -1
    node_id: str = ""
    ratio: float = 0.0


@dataclass(frozen=True, kw_only=True)
class PreemptionNotice(Event):
    kind: ClassVar[str] = "preemption_notice"
    node_id: str = ""
    deadline: Optional[float] = None
    source: str = ""
    ranks: list = field(default_factory=list)
    seconds_left: Optional[float] = None
    needed_s: Optional[float] = None
    # emergency_checkpoint | restore_last_committed | no_workers
    action: str = ""
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class Restarted(Event):
    kind: ClassVar[str] = "restarted"
    world_size: int = 0
    from_step: int = 0
    reason: str = ""
    lost_steps: int = 0
    reused_workers: int = 0
    fault_time: Optional[float] = None


@dataclass(frozen=True, kw_only=True)
class StorageUnavailable(Event):
    """The run directory could not be written (the object store is down or unreachable);
    its lines are kept and written when storage is back."""

    kind: ClassVar[str] = "storage_unavailable"
    uri: str = ""
    error: str = ""


@dataclass(frozen=True, kw_only=True)
class StorageRecovered(Event):
    kind: ClassVar[str] = "storage_recovered"
    uri: str = ""
    down_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class RunStopped(Event):
    kind: ClassVar[str] = "run_stopped"
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class RunFinished(Event):
    kind: ClassVar[str] = "run_finished"


@dataclass(frozen=True, kw_only=True)
class RunFailedEvent(Event):
    kind: ClassVar[str] = "run_failed"
    reason: str = ""


class Timeline:
    """Append-only list of events, serialisable to JSON lines."""

    def __init__(self, events: list[Event] | None = None):
        self.events: list[Event] = list(events or [])

    def add(self, event: Event) -> Event:
        self.events.append(event)
        return event

    def of(self, cls: type[Event]) -> list[Event]:
        return [e for e in self.events if isinstance(e, cls)]

    def to_jsonl(self) -> str:
        return "".join(json.dumps(e.to_dict(), default=str) + "\n" for e in self.events)

    @classmethod
    def from_jsonl(cls, text: str) -> "Timeline":
        return cls([event_from_dict(json.loads(line)) for line in text.splitlines() if line.strip()])
