"""What a rank reports to the controller: its state, phase, and one record per finished step.

Torch-free, so the controller unpickles poll answers without importing torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional


class WorkerState(enum.StrEnum):
    IDLE = "idle"
    RUNNING = "running"
    DONE = "done"  # reached the run's last step
    STOPPED = "stopped"  # left at a step boundary it was asked to stop at
    FAILED = "failed"  # the training loop raised
    RELEASED = "released"  # left the attempt (its process may be reused)

class Leaving(enum.StrEnum):
    """How a rank's ``release`` went."""

    LEFT = "left"  # the process is free for the next attempt
    STUCK = "stuck"  # its training loop was still blocked: a hang, the process is replaced
    UPLOADING = "uploading"  # a checkpoint upload still ran: it left, but its process is replaced

# Phases a rank reports, so a hang can be attributed to what the rank was doing.
PHASES = ("idle", "setup", "data", "forward_backward", "optimizer", "collective", "checkpoint", "done")


@dataclass
class StepRecord:
    step: int
    loss: float
    step_time_s: float
    lr: float
    grad_norm: float
    time: float
    samples: int
    # Peak bytes autograd held for backward during the step, and (pipelines) seconds spent
    # blocked on neighbouring stages vs the whole forward/backward.
    activation_peak_bytes: int = 0  # 0 on steps not measured (constants ACTIVATION_PROBE_EVERY)
    pipeline_wait_s: float = 0.0
    forward_backward_s: float = 0.0
    pp_index: int = 0
    dp_index: int = 0
    tp_index: int = 0
    sample_indices: Optional[list] = None
    # Seconds this rank waited for its peers in the step (inside its collectives and at the
    # end-of-step all-reduce): the last rank to arrive waits least.
    sync_wait_s: float = 0.0
    # Seconds the step waited for its rows (0-ish when the prefetcher had them cached).
    data_wait_s: float = 0.0
    # The replicate tier (CommConfig): bytes this rank sent over it in the step, DiLoCo
    # fragments synchronised after it, what int8 rounding still owes (None: no int8).
    replicate_bytes: int = 0
    outer_synced: int = 0
    residual_norm: Optional[float] = None
    # Bytes this rank sent in the step by process-group role (``dp_shard``: FSDP's all-gathers
    # and reduce-scatters inside a replica; ``dp_replicate``; ``pp``; ``control``), counted
    # as issued (instrument.sent_bytes_counter).
    sent_bytes: dict = field(default_factory=dict)


# Steps whose metrics a checkpoint carries (rank 0's): more than a poll interval's worth of
# the quickest steps, so a restart after every rank died before its next poll still has them.
RECENT_STEPS = 64


def recent_step(record: StepRecord, world_size: int) -> dict:
    """What a checkpoint keeps of a step's record: the metrics line's agreed fields."""
    return {"step": record.step, "loss": record.loss, "step_time_s": record.step_time_s, "lr": record.lr,
            "grad_norm": record.grad_norm, "time": record.time, "samples": record.samples,
            "data_wait_s": record.data_wait_s, "world_size": world_size}


@dataclass
class WorkerStatus:
    rank: int
    node_id: str
    state: WorkerState
    step: int  # last finished step (0 = none)
    phase: str
    records: list = field(default_factory=list)
    error: Optional[str] = None
    error_step: Optional[int] = None
    checkpoints: list = field(default_factory=list)


@dataclass(frozen=True)
class CollectiveEntry:
    """One collective (or point-to-point op) this rank issued, from its flight recorder.

    ``group``: the group's role in the mesh ("dp", "tp", "pp", "dp_replicate", "world",
    "control", "checkpoint"); ``members``: its global ranks; ``seq``: the op's number in
    that group (collectives and point-to-point ops are numbered separately, as torch
    does); ``completed``: the op finished on this rank; ``step``: the training step it
    was issued in (0: setup or restore).
    """

    group: str
    members: tuple
    seq: int
    op: str
    sizes: tuple = ()
    dtypes: tuple = ()
    completed: bool = False
    p2p: bool = False
    started: float = 0.0  # unix time the op was issued
    step: int = 0


@dataclass(frozen=True)
class FlightRecord:
    """A rank's recent collectives, newest last, as it answers a hang investigation.

    ``available`` is False where no recorder ran (``ElasticConfig.flight_recorder=0``,
    or a torch without one); ``error`` says why."""

    rank: int
    step: int
    phase: str
    entries: tuple = ()
    available: bool = True
    error: str = ""
