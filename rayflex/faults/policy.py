"""Policies that decide what happens after an event; the controller acts on the decision.

``FailurePolicy.decide`` returns a frozen decision — :class:`Restart` (at a world size the
mesh and the global batch allow, within [min_workers, max_workers] and the slots that are
usable), :class:`WaitForResources` or :class:`Fail` with the reason. Failures and
preemptions have separate budgets, and a failure that repeats at the same step with no
committed progress in between (a poison batch, a bug) fails the run instead of looping.
``ElasticPolicy.grow_to`` says when a run should scale back up because capacity returned;
``NoticePolicy.decide`` whether a spot notice leaves time for an emergency checkpoint;
``StragglerPolicy.decide`` whether restarting without a slow node pays for itself.
The controller receives them as one :class:`Policies`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from rayflex.config import TrainSpec
from rayflex.faults.detector import STRAGGLER_SHARE
from rayflex.faults.health import HealthPolicy
from rayflex.mesh import rules


@dataclass(frozen=True)
class Restart:
    world_size: int
    reason: str


@dataclass(frozen=True)
class WaitForResources:
    min_world_size: int
    timeout_s: float
    reason: str


@dataclass(frozen=True)
class Fail:
    reason: str


Decision = Union[Restart, WaitForResources, Fail]


def valid_world_sizes(spec: TrainSpec) -> list[int]:
    """World sizes in [min_workers, max_workers] the run can use, largest first: those
    where ``plan_mesh`` accepts the spec's pipeline and batch (``rayflex.mesh.rules``).

    With ``layout="auto"`` a size is valid when some pp could run there at a tp the model
    splits into (``rules.pp_options``, ``rules.tp_options_of``);
    whether that mesh fits in memory is decided when the restart re-plans (CapacityError).
    """
    return rules.valid_world_sizes(spec.parallel.mesh_request(), spec.data.global_batch,
                                   min_size=spec.scaling.min_size, max_size=spec.scaling.max_size,
                                   micro_batch=spec.data.micro_batch, num_blocks=spec.model.num_blocks,
                                   tp_options=rules.tp_options_of(getattr(spec.model, "metadata", None)))


def best_world_size(spec: TrainSpec, usable_slots: int) -> Optional[int]:
    return next((n for n in valid_world_sizes(spec) if n <= usable_slots), None)


class FailurePolicy:
    def __init__(self, spec: TrainSpec):
        self.spec = spec
        self.failures = 0
        self.preemptions = 0
        self._last_failure: Optional[tuple] = None  # (step, committed step then, error)
        self._repeats = 0

    def decide(self, *, kind: str, step: int, committed_step: int, usable_slots: int, error: str = "",
               diagnosis=None) -> Decision:
        """``diagnosis``: a hang's verdict (``faults.diagnosis.Diagnosis``); a program-level
        one (a collective mismatch) that hangs the same step again is a bug, not bad luck."""
        cfg = self.spec.elastic
        if kind == "straggler":  # a restart the straggler policy chose: no budget is charged
            pass
        elif kind == "preemption":
            self.preemptions += 1
            if self.preemptions > cfg.max_preemptions:
                return Fail(f"preemption budget exhausted ({self.preemptions} > max_preemptions="
                            f"{cfg.max_preemptions})")
        else:
            self.failures += 1
            program_level = diagnosis is not None and diagnosis.program_level
            # A mismatch is judged by the step it hangs and what it is: the commit of the
            # checkpoint before it may still be in flight when the first one is decided.
            key = (step, diagnosis.signature()) if program_level else (step, committed_step, _last_line(error))
            self._repeats = self._repeats + 1 if self._last_failure == key else 0
            self._last_failure = key
            if self._repeats >= 1 and program_level:
                return Fail(f"the same collective mismatch hung step {step} again after a restart: a bug in "
                            f"the training program, not a fault of the cluster: {diagnosis.sentence}")
            if self._repeats >= 1:
                return Fail(f"the same failure repeated at step {step} with no progress since the checkpoint "
                            f"of step {committed_step} (a poison batch or a bug?): {_last_line(error)}")
            if self.failures > cfg.max_failures:
                return Fail(f"failure budget exhausted ({self.failures} failures > max_failures="
                            f"{cfg.max_failures}); last: {_last_line(error)}")
        return self.resize(usable_slots=usable_slots, reason=f"{kind} at step {step}: {_last_line(error)}")

    def resize(self, *, usable_slots: int, reason: str = "resources returned") -> Decision:
        """The size to restart at with the slots usable now (no budget is charged)."""
        cfg = self.spec.elastic
        size = best_world_size(self.spec, usable_slots)
        if size is None:
            sizes = valid_world_sizes(self.spec)
            smallest = min(sizes) if sizes else self.spec.scaling.min_size
            return WaitForResources(min_world_size=smallest, timeout_s=cfg.resource_wait_s,
                                    reason=f"{usable_slots} usable slots, the run needs at least {smallest}")
        return Restart(world_size=size, reason=reason)


class ElasticPolicy:
    """Scale up when capacity returns, at a checkpoint boundary."""

    def __init__(self, spec: TrainSpec):
        self.spec = spec

    def grow_to(self, current: int, usable_slots: int) -> Optional[int]:
        size = best_world_size(self.spec, usable_slots)
        return size if size is not None and size > current else None


@dataclass(frozen=True)
class NoticeDecision:
    """What a spot notice for a node of the running attempt leads to: ``"no_workers"`` (only
    left out of placement), ``"emergency_checkpoint"`` (stop at the next step boundary with a
    checkpoint; ``joins``: one is already under way) or ``"restore_last_committed"`` (too
    little time: the node's ranks count as lost now)."""

    action: str
    reason: str
    joins: bool = False


class NoticePolicy:
    """Whether a spot notice leaves time for an emergency checkpoint: a step, the save and a
    margin (``needed_s``, from the run's measured step and save times)."""

    def decide(self, *, ranks: list, seconds_left: float, needed_s: float, step_s: float, save_s: float,
               margin_s: float, saving: bool, committed_step: int, node_id: str) -> NoticeDecision:
        if not ranks:
            return NoticeDecision("no_workers", "no worker on the node; it is excluded from placement")
        if seconds_left >= needed_s:
            if saving:
                return NoticeDecision("emergency_checkpoint", "joins the emergency checkpoint already under way",
                                      joins=True)
            return NoticeDecision("emergency_checkpoint", (
                f"{seconds_left:.1f}s left >= {needed_s:.1f}s needed (a step {step_s:.2f}s + checkpoint "
                f"{save_s:.2f}s + margin {margin_s:.1f}s)"))
        # Also beside an emergency checkpoint under way: that save cannot finish before the node goes.
        return NoticeDecision("restore_last_committed", (
            f"only {seconds_left:.1f}s left, an emergency checkpoint needs {needed_s:.1f}s: restoring the last "
            f"committed checkpoint (step {committed_step}) without node {node_id[:12]}"))


@dataclass(frozen=True)
class StragglerDecision:
    """Whether to restart without a node a straggler was named on (``"evict_node"``) or
    keep it (``"keep"``), with the numbers behind the choice: over the ``remaining_steps``,
    keeping it costs ``slow_step_s`` a step; without it a step takes ``after_step_s`` (the
    step without the others' wait, ``healthy_step_s``, at ``to_world`` ranks instead of
    ``world``) after a restart of ``restart_s``; ``gain_s`` is what evicting saves."""

    action: str
    reason: str
    node_id: str
    ranks: tuple
    world: int
    to_world: Optional[int]
    remaining_steps: int
    slow_step_s: float
    healthy_step_s: float
    after_step_s: Optional[float]
    restart_s: float
    gain_s: float

    @property
    def evict(self) -> bool:
        return self.action == "evict_node"


class StragglerPolicy:
    """Act on a straggler only when it pays: the time a slow node will cost the rest of the
    run must exceed a restart without it (the restart, and every remaining step at the
    size the cluster has without it). Evidence is the recent steps, not the step that named
    it: a node that was slow for a while and is not now costs nothing more — and one whose
    ranks no longer arrive last in most of them is kept whatever the others wait (on shared
    cores somebody waits every step). A node is never
    left when no valid world size remains without it (the run's only node)."""

    def __init__(self, spec: TrainSpec):
        self.spec = spec

    def decide(self, *, node_id: str, ranks: list, world: int, usable_slots: int, remaining_steps: int,
               slow_step_s: float, wait_s: float, restart_s: float, last_share: float = 1.0,
               named_share: float = STRAGGLER_SHARE) -> StragglerDecision:
        """``usable_slots``: the slots the cluster has for the run without the node;
        ``wait_s``: how long the other ranks wait for the node's at each step; ``last_share``:
        in how many of those steps the node's ranks arrived last (``named_share`` named it)."""
        healthy = max(slow_step_s - wait_s, 1e-9)
        to_world = best_world_size(self.spec, usable_slots)
        after = healthy * world / to_world if to_world else None
        gain = remaining_steps * (slow_step_s - after) - restart_s if after is not None else 0.0
        base = dict(node_id=node_id, ranks=tuple(ranks), world=world, to_world=to_world,
                    remaining_steps=remaining_steps, slow_step_s=slow_step_s, healthy_step_s=healthy,
                    after_step_s=after, restart_s=restart_s, gain_s=gain)
        if last_share < named_share:  # healed: the others' waits are not for it any more
            return StragglerDecision("keep", (
                f"no longer the straggler: its ranks arrived last in {last_share:.0%} of the last steps "
                f"(named at {named_share:.0%})"), **base)
        if to_world is None:  # e.g. it is the run's only node
            return StragglerDecision("keep", f"without it the cluster has {usable_slots} usable slot(s), too few "
                                     f"for any valid world size (min_workers={self.spec.scaling.min_size})", **base)
        if gain <= 0:
            return StragglerDecision("keep", (
                f"not worth a restart: {remaining_steps} steps x {slow_step_s:.3f}s slowed = "
                f"{remaining_steps * slow_step_s:.1f}s, vs {restart_s:.1f}s restart + {remaining_steps} x "
                f"{after:.3f}s at {to_world} ranks = {restart_s + remaining_steps * after:.1f}s"), **base)
        return StragglerDecision("evict_node", (
            f"restarting without it saves {gain:.1f}s: {remaining_steps} steps x {slow_step_s:.3f}s slowed = "
            f"{remaining_steps * slow_step_s:.1f}s, vs {restart_s:.1f}s restart + {remaining_steps} x "
            f"{after:.3f}s at {to_world} ranks"), **base)


@dataclass(frozen=True)
class Policies:
    """The decisions a run's controller asks for, injected (``Controller(policies=...)``;
    the tests queue decisions through it): failures, growth, spot notices, stragglers."""

    failure: FailurePolicy
    elastic: ElasticPolicy
    notice: NoticePolicy
    straggler: Optional[StragglerPolicy] = None  # None: stragglers are named, never acted on
    health: Optional[HealthPolicy] = None  # None: nodes are used unchecked, an evicted one never again

    @classmethod
    def for_spec(cls, spec: TrainSpec) -> "Policies":
        return cls(failure=FailurePolicy(spec), elastic=ElasticPolicy(spec), notice=NoticePolicy(),
                   straggler=StragglerPolicy(spec) if spec.elastic.evict_stragglers else None,
                   health=HealthPolicy(spec.elastic.health_min_speed) if spec.elastic.health_checks else None)


def _last_line(text: str) -> str:
    """The last non-empty line (of a traceback: the exception and its message), at most 300
    characters: what a repeated failure is recognized by and what the reason quotes."""
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "unknown"
