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
    activation_peak_bytes: int = 0
    pipeline_wait_s: float = 0.0
    forward_backward_s: float = 0.0
    pp_index: int = 0
    dp_index: int = 0
    tp_index: int = 0
    sample_indices: Optional[list] = None
    # Seconds blocked in the end-of-step all-reduce: the last rank to arrive waits least.
    sync_wait_s: float = 0.0


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
