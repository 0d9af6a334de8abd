"""Typed events and the run timeline.

Everything that happens to a run is one frozen dataclass on the timeline, written as a
line of ``events.jsonl``. Goodput and the report are computed from the timeline alone.

Readers never switch on the stored ``"kind"`` strings: :func:`parse_event` turns a stored
line back into its class (``isinstance`` or ``event.kind is EventKind.X``). A kind this
version does not know (written by a newer rayflex) parses to :class:`UnknownEvent`, which
keeps the line whole: every reader skips it, the report still lists it.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable, Optional, Union


class EventKind(enum.StrEnum):
    """The ``"kind"`` of an ``events.jsonl`` line (the stored strings, unchanged)."""

    RUN_STARTED = "run_started"
    PLAN_CHOSEN = "plan_chosen"
    WORKERS_STARTED = "workers_started"
    CHECKPOINT_COMMITTED = "checkpoint_committed"
    CHECKPOINT_FAILED = "checkpoint_failed"
    CHECKPOINT_DEFERRED = "checkpoint_deferred"
    CHECKPOINT_LOADED = "checkpoint_loaded"
    SCHEDULE_CHANGED = "schedule_changed"
    CHECKPOINT_INTERVAL_CHOSEN = "checkpoint_interval_chosen"
    MEMORY_REPLICAS_SHORT = "memory_replicas_short"
    WORKER_FAILED = "worker_failed"
    WORKER_DIED = "worker_died"
    NODE_LOST = "node_lost"
    HANG_DETECTED = "hang_detected"
    HANG_DIAGNOSED = "hang_diagnosed"
    STRAGGLER_DETECTED = "straggler_detected"
    STRAGGLER_DECIDED = "straggler_decided"
    NODE_HEALTH_CHECKED = "node_health_checked"
    PREEMPTION_NOTICE = "preemption_notice"
    RESTARTED = "restarted"
    CAPACITY_WAITED = "capacity_waited"
    RECOVERY_CHOSEN = "recovery_chosen"
    STORAGE_UNAVAILABLE = "storage_unavailable"
    STORAGE_RECOVERED = "storage_recovered"
    RUN_STOPPED = "run_stopped"
    RUN_FINISHED = "run_finished"
    RUN_FAILED = "run_failed"
    # Not a stored kind: the kind of an UnknownEvent (its stored kind is in ``stored_kind``).
    UNKNOWN = "unknown"


_REGISTRY: dict[EventKind, type["Event"]] = {}


@dataclass(frozen=True, kw_only=True)
class Event:
    kind: ClassVar[EventKind]
    # None only for a stored line that had no time (hand-written, or foreign).
    time: Optional[float] = field(default_factory=time.time)
    step: Optional[int] = None

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        kind = cls.__dict__.get("kind")
        if kind is None:
            raise TypeError(f"event class {cls.__name__} must set kind: ClassVar[EventKind]")
        if kind is not EventKind.UNKNOWN:
            if kind in _REGISTRY:
                raise TypeError(f"{cls.__name__} and {_REGISTRY[kind].__name__} both have kind {kind.value!r}")
            _REGISTRY[kind] = cls

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind.value}
        d.update(dataclasses.asdict(self))
        return d

    def describe(self) -> str:
        fields = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("time",)}
        return f"{self.kind.value} " + " ".join(f"{k}={v}" for k, v in fields.items() if v not in (None, "", [], {}))


@dataclass(frozen=True, kw_only=True)
class RunStarted(Event):
    kind: ClassVar[EventKind] = EventKind.RUN_STARTED
    name: str = ""
    target_steps: int = 0
    resumed_from: Optional[int] = None


@dataclass(frozen=True, kw_only=True)
class PlanChosen(Event):
    kind: ClassVar[EventKind] = EventKind.PLAN_CHOSEN
    world_size: int = 0
    pp: int = 1
    dp: int = 1
    tp: int = 1
    dp_replicate: int = 1  # HSDP replicas (dp = dp_replicate x dp_shard)
    activation_checkpointing: str = ""  # what the workers apply (the planner's pick with "auto")
    # CommConfig(replicate="auto"): what the workers apply, CommConfig's fields (and
    # "reduce_dtype" of PrecisionConfig); empty when the spec's own CommConfig applies
    replicate_choice: dict = field(default_factory=dict)
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
    # node id -> dollars per hour (None: no price known) for the nodes of rank_to_node
    node_prices: dict = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class WorkersStarted(Event):
    kind: ClassVar[EventKind] = EventKind.WORKERS_STARTED
    world_size: int = 0
    # From the start of placement: spawning processes, rendezvous, building, restoring.
    setup_s: float = 0.0
    spawn_s: float = 0.0
    rendezvous_s: float = 0.0
    build_s: float = 0.0
    restore_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class CheckpointCommitted(Event):
    kind: ClassVar[EventKind] = EventKind.CHECKPOINT_COMMITTED
    uri: str = ""
    blocked_s: float = 0.0
    total_s: float = 0.0
    bytes: int = 0
    reason: str = "periodic"
    upload: str = ""  # process | thread | sync: where the bytes were written from (CheckpointConfig.upload)
    due_step: Optional[int] = None  # set when the save was deferred: the step it fell due at


@dataclass(frozen=True, kw_only=True)
class CheckpointDeferred(Event):
    """A save fell due while the previous one was still being written; it is taken at the
    first step boundary after that upload ended (``CheckpointConfig(when_busy="defer")``),
    training not waiting meanwhile."""
    kind: ClassVar[EventKind] = EventKind.CHECKPOINT_DEFERRED
    behind_step: Optional[int] = None  # the save still being written
    reason: str = "periodic"


@dataclass(frozen=True, kw_only=True)
class CheckpointFailed(Event):
    kind: ClassVar[EventKind] = EventKind.CHECKPOINT_FAILED
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class CheckpointLoaded(Event):
    kind: ClassVar[EventKind] = EventKind.CHECKPOINT_LOADED
    uri: str = ""
    world_size: int = 0
    saved_world_size: int = 0
    skipped: list = field(default_factory=list)
    data_order: str = ""  # set when the checkpoint's sample order is not this rayflex's
    load_s: float = 0.0  # the slowest rank's read of the checkpoint
    # With memory replicas: shard files read per source, summed over ranks ("own_copy": the
    # memory of the node that saved it, "replica": a peer's, "storage"), and each file read
    # from storage with why (e.g. its node and its replicas' nodes are gone).
    sources: dict = field(default_factory=dict)
    fell_back: dict = field(default_factory=dict)
    remote_reads: int = 0  # shard files read from another node's memory (the rest: the reader's own)


@dataclass(frozen=True, kw_only=True)
class ScheduleChanged(Event):
    """The run resumed from a checkpoint trained toward a different ``run.steps``.

    The learning rate is a pure function of (step, the current ``run.steps``), so from
    step ``step + 1`` on the run follows the new total's schedule: ``lr_before`` is what
    step ``step + 1`` would have trained at under the saved total, ``lr_after`` what it
    trains at now.
    """

    kind: ClassVar[EventKind] = EventKind.SCHEDULE_CHANGED
    from_total_steps: int = 0
    to_total_steps: int = 0
    lr_before: float = 0.0
    lr_after: float = 0.0

    def describe(self) -> str:
        return (f"{self.kind.value} at step {self.step}: total steps {self.from_total_steps} -> "
                f"{self.to_total_steps}, lr of step {(self.step or 0) + 1} {self.lr_before:.3g} -> "
                f"{self.lr_after:.3g}")


@dataclass(frozen=True, kw_only=True)
class WorkerFailed(Event):
    """A worker raised in its training loop (the traceback is in ``error``)."""

    kind: ClassVar[EventKind] = EventKind.WORKER_FAILED
    rank: int = -1
    node_id: str = ""
    error: str = ""
    detected_after_s: Optional[float] = None


@dataclass(frozen=True, kw_only=True)
class WorkerDied(Event):
    """A worker's process is gone (actor death)."""

    kind: ClassVar[EventKind] = EventKind.WORKER_DIED
    rank: int = -1
    node_id: str = ""
    error: str = ""
    detected_after_s: Optional[float] = None


@dataclass(frozen=True, kw_only=True)
class NodeLost(Event):
    kind: ClassVar[EventKind] = EventKind.NODE_LOST
    node_id: str = ""
    ranks: list = field(default_factory=list)
    # Empty: Ray declared the node dead. Otherwise why rayflex stopped using a node Ray
    # still lists (its ranks froze and it did not run a probe task).
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class HangDetected(Event):
    kind: ClassVar[EventKind] = EventKind.HANG_DETECTED
    ranks: list = field(default_factory=list)
    phases: dict = field(default_factory=dict)
    stalled_s: float = 0.0
    timeout_s: float = 0.0
    # Seconds since the detector's check before the one that named the hang (the controller's
    # cycle on this host then): stalled_s - poll_gap_s <= timeout_s < stalled_s. 0 where the
    # hang was named otherwise (setup, a leaving rank).
    poll_gap_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class HangDiagnosed(Event):
    """What the hang was, from every answering rank's flight record (``faults/diagnosis``):
    ``verdict`` in one sentence, its ``diagnosis`` kind, the ranks at fault, the process
    group (its role and members), the collective and its sequence number in that group,
    and one ``table`` row per member of the group."""

    kind: ClassVar[EventKind] = EventKind.HANG_DIAGNOSED
    trigger: str = "hang"  # or "worker_died": a collective mismatch on gloo can kill a rank
    verdict: str = ""
    diagnosis: str = ""
    ranks: list = field(default_factory=list)
    group: str = ""
    members: list = field(default_factory=list)
    op: str = ""
    seq: int = 0
    program_level: bool = False
    answered: list = field(default_factory=list)
    table: list = field(default_factory=list)
    diagnose_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class StragglerDetected(Event):
    kind: ClassVar[EventKind] = EventKind.STRAGGLER_DETECTED
    rank: int = -1
    node_id: str = ""
    ratio: float = 0.0


@dataclass(frozen=True, kw_only=True)
class StragglerDecided(Event):
    """What the straggler policy chose for a node a straggler was named on: ``action``
    ``"evict_node"`` (restart without it) or ``"keep"``, why, and its numbers (seconds):
    over ``remaining_steps``, ``slow_step_s`` a step as now vs ``restart_s`` plus
    ``after_step_s`` a step at ``to_world`` ranks; ``gain_s`` what evicting saves."""

    kind: ClassVar[EventKind] = EventKind.STRAGGLER_DECIDED
    node_id: str = ""
    ranks: list = field(default_factory=list)
    action: str = ""
    reason: str = ""
    world: int = 0
    to_world: Optional[int] = None
    remaining_steps: int = 0
    slow_step_s: float = 0.0
    healthy_step_s: float = 0.0
    after_step_s: Optional[float] = None
    restart_s: float = 0.0
    gain_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class NodeHealthChecked(Event):
    """A node's health check (``control/node_health.py``) and what it meant: ``action``
    ``"admitted"`` (a newcomer usable for growth), ``"left_out"`` (a newcomer held out),
    ``"kept_out"`` (a held-out node failed again), ``"readmitted"`` (a held-out node passed);
    ``gflops`` its speed against ``reference_gflops``, the run's own nodes'."""

    kind: ClassVar[EventKind] = EventKind.NODE_HEALTH_CHECKED
    node_id: str = ""
    passed: bool = False
    action: str = ""
    reason: str = ""
    gflops: float = 0.0
    reference_gflops: Optional[float] = None
    probe_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class PreemptionNotice(Event):
    kind: ClassVar[EventKind] = EventKind.PREEMPTION_NOTICE
    node_id: str = ""
    deadline: Optional[float] = None
    source: str = ""
    ranks: list = field(default_factory=list)
    seconds_left: Optional[float] = None
    needed_s: Optional[float] = None
    # emergency_checkpoint | restore_last_committed | no_workers | excluded_from_placement (between attempts)
    action: str = ""
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class MemoryReplicasShort(Event):
    """An attempt keeps fewer in-memory copies of some node's shards than
    ``CheckpointConfig.memory_replicas`` asks: a copy lives on another node than its shard,
    and the attempt has too few (restores of those shards then come from storage)."""

    kind: ClassVar[EventKind] = EventKind.MEMORY_REPLICAS_SHORT
    wanted: int = 0
    fewest: int = 0  # the fewest copies any node's shards get
    nodes: int = 0
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class CheckpointIntervalChosen(Event):
    """``every_steps="auto"``: the interval chosen (Young/Daly) and what it came from."""

    kind: ClassVar[EventKind] = EventKind.CHECKPOINT_INTERVAL_CHOSEN
    every_steps: int = 0
    interval_s: float = 0.0  # the optimum in seconds of training, before rounding to steps
    cost_s: float = 0.0  # the training time a save costs: blocked + steps slowed by its upload (or the prior)
    mtbf_s: float = 0.0  # the mean time between failures assumed
    faults: int = 0
    step_time_s: float = 0.0
    measured: bool = False


@dataclass(frozen=True, kw_only=True)
class CapacityWaited(Event):
    """A restart waited ``waited_s`` (ending at ``time``) for the cluster to have room for
    the run (the failure policy's wait for resources, or a model that fit in no mesh of the
    survivors); ``outcome``: "placed" or "gave_up"."""

    kind: ClassVar[EventKind] = EventKind.CAPACITY_WAITED
    waited_s: float = 0.0
    reason: str = ""
    outcome: str = "placed"


@dataclass(frozen=True, kw_only=True)
class Restarted(Event):
    kind: ClassVar[EventKind] = EventKind.RESTARTED
    world_size: int = 0
    from_step: int = 0
    reason: str = ""
    lost_steps: int = 0
    reused_workers: int = 0
    fault_time: Optional[float] = None


@dataclass(frozen=True, kw_only=True)
class RecoveryChosen(Event):
    """Where a restart after a failure takes its state from (``faults.live_recovery``):
    ``"live_peers"`` (the survivors' memory: ``step`` is their last finished step, read
    from the old ranks ``holders``; no step is lost) or ``"checkpoint"`` (memory replicas,
    then storage), with the reason — e.g. which shard lost every copy."""

    kind: ClassVar[EventKind] = EventKind.RECOVERY_CHOSEN
    source: str = ""
    reason: str = ""
    holders: list = field(default_factory=list)
    snapshot_s: float = 0.0  # the slowest survivor's snapshot of its state
    snapshot_bytes: int = 0  # what the holders' snapshots hold, summed


@dataclass(frozen=True, kw_only=True)
class StorageUnavailable(Event):
    """The run directory could not be written (the object store is down or unreachable);
    its lines are kept and written when storage is back."""

    kind: ClassVar[EventKind] = EventKind.STORAGE_UNAVAILABLE
    uri: str = ""
    error: str = ""


@dataclass(frozen=True, kw_only=True)
class StorageRecovered(Event):
    kind: ClassVar[EventKind] = EventKind.STORAGE_RECOVERED
    uri: str = ""
    down_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class RunStopped(Event):
    kind: ClassVar[EventKind] = EventKind.RUN_STOPPED
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class RunFinished(Event):
    kind: ClassVar[EventKind] = EventKind.RUN_FINISHED


@dataclass(frozen=True, kw_only=True)
class RunFailedEvent(Event):
    kind: ClassVar[EventKind] = EventKind.RUN_FAILED
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class UnknownEvent(Event):
    """A stored event of a kind this version does not know (a newer rayflex wrote it).

    Kept whole rather than dropped, so ``to_dict()`` gives the stored line back and the
    report can list it; readers that count or draw known events skip it.
    """

    kind: ClassVar[EventKind] = EventKind.UNKNOWN
    stored_kind: str = ""
    data: dict = field(default_factory=dict)  # the stored line without its kind

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.stored_kind, **self.data}

    def describe(self) -> str:
        return f"{self.stored_kind} (unknown kind) " + " ".join(
            f"{k}={v}" for k, v in self.data.items() if k != "time" and v not in (None, "", [], {}))


def parse_event(d: dict[str, Any]) -> Event:
    """The typed event of one stored ``events.jsonl`` line (``Event.to_dict()`` inverted).

    Fields the class does not have (a newer version's) are dropped, missing ones take
    their defaults, a missing ``time`` stays None; an unknown kind is an UnknownEvent.
    """
    d = dict(d)
    kind = d.pop("kind", None)
    try:
        cls = _REGISTRY[EventKind(kind)]
    except (ValueError, KeyError):
        return UnknownEvent(stored_kind=str(kind), data=d, time=d.get("time"), step=d.get("step"))
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{"time": None, **{k: v for k, v in d.items() if k in names}})


def as_events(items: Iterable[Union[Event, dict[str, Any]]]) -> list[Event]:
    """Typed events from stored dicts; events already typed pass through."""
    return [e if isinstance(e, Event) else parse_event(e) for e in items]


class Timeline:
    """Append-only list of events, read back from JSON lines."""

    def __init__(self, events: list[Event] | None = None):
        self.events: list[Event] = list(events or [])

    def add(self, event: Event) -> Event:
        self.events.append(event)
        return event

    def of(self, cls: type[Event]) -> list[Event]:
        return [e for e in self.events if isinstance(e, cls)]

    def since_last(self, cls: type[Event]) -> list[Event]:
        """The newest event of ``cls`` and every event after it (empty: none of ``cls``)."""
        for i in range(len(self.events) - 1, -1, -1):
            if isinstance(self.events[i], cls):
                return self.events[i:]
        return []

    @classmethod
    def from_dicts(cls, dicts: Iterable[dict[str, Any]]) -> "Timeline":
        return cls(as_events(dicts))

    @classmethod
    def from_jsonl(cls, text: str) -> "Timeline":
        return cls.from_dicts(json.loads(line) for line in text.splitlines() if line.strip())
