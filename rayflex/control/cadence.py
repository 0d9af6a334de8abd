"""Checkpoints on the controller's schedule: ``CheckpointConfig(every_steps="auto")``.

The interval is the policy's (``faults.checkpoint_interval``: Young/Daly from the measured
save cost and the failures seen); this module only keeps the choice current and asks the
workers for a checkpoint when one is due. The choice is an event whenever it changes by
more than a tenth (and the first time), with the inputs it came from.
"""

from __future__ import annotations

from typing import Optional

from rayflex.config import CheckpointConfig
from rayflex.constants import knob
from rayflex.faults.checkpoint_interval import CheckpointIntervalPolicy, IntervalChoice
from rayflex.telemetry import events as ev


class CheckpointCadence:
    def __init__(self, checkpoint: CheckpointConfig, steps: int, clock):
        self.clock = clock
        self.started = clock.time()
        self.policy = CheckpointIntervalPolicy(checkpoint.mtbf_prior_s, knob("CHECKPOINT_COST_PRIOR_S"),
                                               max_steps=steps)
        self.choice: Optional[IntervalChoice] = None
        self.requested_step = 0  # the step the last request was made at

    def tick(self, ctx, group) -> None:
        """Re-evaluate the interval; ask ``group`` for a checkpoint if one is due."""
        ledger = ctx.ledger
        choice = self.policy.choose(save_costs_s=ledger.save_costs_s(), save_total_s=ledger.save_total_s(),
                                    step_time_s=ledger.step_time_estimate_s(),
                                    elapsed_s=self.clock.time() - self.started,
                                    faults=ctx.policies.failure.failures + ctx.policies.failure.preemptions)
        if self.choice is None or abs(choice.steps - self.choice.steps) > 0.1 * self.choice.steps \
                or choice.measured != self.choice.measured:
            ctx.record(ev.CheckpointIntervalChosen(
                step=ledger.step, every_steps=choice.steps, interval_s=round(choice.seconds, 3),
                cost_s=round(choice.cost_s, 4), mtbf_s=round(choice.mtbf_s, 1), faults=choice.faults,
                step_time_s=round(choice.step_time_s, 4), measured=choice.measured))
            self.choice = choice
        if self.requested_step > ledger.step:  # a restart rolled back past it
            self.requested_step = 0
        if ledger.step >= ctx.spec.run.steps - 1:
            return  # the end of the run saves anyway
        last = max(ledger.committed_step, self.requested_step, ledger.start_step)
        if not choice.measured:
            # No save measured yet: take one early to learn what a save costs. On the prior
            # alone (5 s) a benchmark's first save was due at 35 s, after its first failure.
            due = self.requested_step == 0 and ledger.step - last >= knob("CHECKPOINT_AUTO_FIRST_STEPS")
        else:
            # In seconds of training, not steps: a step-time estimate swings through warm-up.
            # Asked a step early: the save happens at the step boundary after the request.
            due = ledger.training_s_since(last) >= self.choice.seconds - choice.step_time_s
        if due:
            group.request_checkpoint("auto")
            self.requested_step = ledger.step
