"""What failures cost a mesh: the planner's trade-off between HSDP replicas and rollbacks.

A failure without notice costs every mesh a restart. A mesh whose every shard has a replica
(``dp_replicate >= 2``) then resumes from the survivors' memory (live recovery: nothing is
trained again); any other mesh also trains again what the last checkpoint did not hold —
half a checkpoint interval on average. With failures expected at ``failures_per_hour``, a
mesh keeps ``1 - rate x lost`` of its time for training, so the search ranks fitting meshes
by ``step_s / (1 - rate x lost)``: on a cluster that fails often, HSDP's extra memory and
replica all-reduce can be cheaper than the steps a plain FSDP mesh loses. ``None`` (the
default everywhere): failures are not priced and meshes rank by step time alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from rayflex.errors import ConfigError
from rayflex.mesh.plan import MeshPlan

MAX_LOST_FRACTION = 0.95  # beyond this the run makes no progress anyway; keeps the ratio finite


@dataclass(frozen=True)
class FailureCost:
    """``failures_per_hour`` expected; a restart costs ``restart_s``; without live recovery a
    failure also trains again ``rollback_steps`` steps of the mesh plus ``rollback_s``."""

    failures_per_hour: float
    restart_s: float = 30.0
    rollback_steps: float = 0.0  # e.g. half of CheckpointConfig.every_steps
    rollback_s: float = 0.0  # e.g. half a checkpoint interval in seconds

    def __post_init__(self) -> None:
        for name in ("failures_per_hour", "restart_s", "rollback_steps", "rollback_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or not math.isfinite(value):
                raise ConfigError(f"FailureCost.{name}", f"must be a number >= 0, got {value!r}",
                                  "give failures per hour (e.g. 2 for a spot cluster), seconds or steps")

    @staticmethod
    def live(layout: MeshPlan) -> bool:
        """Every shard has a replica: a lost rank's state survives in a peer's memory."""
        return layout.dp_replicate >= 2

    def lost_s(self, layout: MeshPlan, step_s: float) -> float:
        """Training time one failure costs ``layout`` (its step taking ``step_s``)."""
        if self.live(layout):
            return self.restart_s
        return self.restart_s + self.rollback_s + self.rollback_steps * step_s

    def lost_fraction(self, layout: MeshPlan, step_s: float) -> float:
        return min(MAX_LOST_FRACTION, self.failures_per_hour / 3600.0 * self.lost_s(layout, step_s))

    def effective_step_s(self, layout: MeshPlan, step_s: float) -> float:
        """``step_s`` stretched by the time failures take from training."""
        return step_s / (1.0 - self.lost_fraction(layout, step_s))

    def describe(self) -> str:
        rollback = " + ".join(x for x in (f"{self.rollback_steps:g} steps" if self.rollback_steps else "",
                                          f"{self.rollback_s:.0f} s" if self.rollback_s else "") if x) or "nothing"
        return (f"{self.failures_per_hour:g} failures/h expected; each costs a {self.restart_s:.0f} s restart, "
                f"plus {rollback} trained again on a mesh without replicas (dp_replicate=1: no live recovery)")


def for_run(failures_per_hour: Optional[float], every_steps, restart_s: float = 30.0,
            save_cost_s: float = 1.0) -> Optional[FailureCost]:
    """The failure cost of a run's config: a periodic checkpoint every ``every_steps`` loses
    half of them on average; ``"auto"`` picks an interval of about sqrt(2 x save cost x
    MTBF) seconds (the first term of the interval policy's formula, with its cost prior)."""
    if failures_per_hour is None:
        return None
    if isinstance(every_steps, int) and every_steps > 0:
        return FailureCost(failures_per_hour, restart_s=restart_s, rollback_steps=every_steps / 2)
    if failures_per_hour <= 0:
        return FailureCost(failures_per_hour, restart_s=restart_s)
    mtbf_s = 3600.0 / failures_per_hour
    if every_steps == "auto":
        return FailureCost(failures_per_hour, restart_s=restart_s, rollback_s=math.sqrt(2 * save_cost_s * mtbf_s) / 2)
    # No periodic checkpoint: a failure goes back to the last one (the start), half a run between failures.
    return FailureCost(failures_per_hour, restart_s=restart_s, rollback_s=mtbf_s / 2)
