"""What a rank reports to the controller: its state, phase, and one record per finished step.

Torch-free, so the controller unpickles poll answers without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

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
    sample_indices: Optional[list] = None
    # Seconds blocked in the end-of-step all-reduce: the last rank to arrive waits least.
    sync_wait_s: float = 0.0


@dataclass
class WorkerStatus:
    rank: int
    node_id: str
    state: str  # idle | running | done | stopped | failed
    step: int  # last finished step (0 = none)
    phase: str
    phase_since: float
    heartbeat: float
    records: list = field(default_factory=list)
    error: Optional[str] = None
    error_step: Optional[int] = None
    checkpoints: list = field(default_factory=list)
