"""How often to checkpoint with ``CheckpointConfig(every_steps="auto")``: Young/Daly.

Checkpointing every T seconds of training costs C per save (the training time a save
blocks) and loses, per failure, the work since the last save: T/2 on average. With a failure
every M seconds on average the waste per unit time, C/T + T/(2M), is least at
T = sqrt(2CM) (Young, 1974); Daly (2006) adds the higher-order terms used here, which
matter once C is not much smaller than M.

C is measured: the median training time this run's recent saves cost — what a save
blocked, plus how much the steps beside its asynchronous upload slowed down
(``StepLedger.save_costs_s``) — with a prior (``RAYFLEX_CHECKPOINT_COST_PRIOR_S``) until
the first one. M is estimated from this run's own faults with
a prior of one failure per ``mtbf_prior_s``: (mtbf_prior_s + elapsed) / (1 + faults). So a
run on a quiet cluster stretches its interval as hours pass without a failure, and one on
a cluster that keeps losing nodes shortens it after the second or third loss. An
asynchronous save keeps uploading after training resumes: the interval is never shorter
than the time a save takes in all, so uploads do not queue behind each other.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class IntervalChoice:
    steps: int  # checkpoint every this many steps
    seconds: float  # the optimum in seconds of training, before rounding to steps
    cost_s: float  # C: training time one save costs (measured, or the prior)
    mtbf_s: float  # M: estimated mean time between failures
    faults: int  # failures and preemptions this run has seen
    step_time_s: float
    measured: bool  # C comes from this run's saves (False: the prior)


def daly_interval_s(cost_s: float, mtbf_s: float) -> float:
    """Daly's optimum checkpoint interval (seconds of work between saves)."""
    if cost_s <= 0:
        return 0.0
    if cost_s >= 2 * mtbf_s:
        return mtbf_s
    r = cost_s / (2 * mtbf_s)
    return math.sqrt(2 * cost_s * mtbf_s) * (1 + math.sqrt(r) / 3 + r / 9) - cost_s


class CheckpointIntervalPolicy:
    """Decides the interval; the controller asks for the checkpoints."""

    def __init__(self, mtbf_prior_s: float, cost_prior_s: float, max_steps: int):
        self.mtbf_prior_s, self.cost_prior_s, self.max_steps = mtbf_prior_s, cost_prior_s, max(1, max_steps)

    def choose(self, *, save_costs_s: list[float], save_total_s: list[float], step_time_s: float,
               elapsed_s: float, faults: int) -> IntervalChoice:
        measured = bool(save_costs_s)
        cost = statistics.median(save_costs_s[-5:]) if measured else self.cost_prior_s
        mtbf = (self.mtbf_prior_s + max(0.0, elapsed_s)) / (1 + faults)
        seconds = daly_interval_s(cost, mtbf)
        step_time_s = max(step_time_s, 1e-6)
        steps = round(seconds / step_time_s)
        if save_total_s:  # never queue an upload behind the one before it
            steps = max(steps, math.ceil(statistics.median(save_total_s[-5:]) / step_time_s))
        steps = min(max(1, steps), self.max_steps)
        return IntervalChoice(steps=steps, seconds=seconds, cost_s=cost, mtbf_s=mtbf, faults=faults,
                              step_time_s=step_time_s, measured=measured)

