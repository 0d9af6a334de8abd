"""The Controller: owns one run, as an explicit state machine.

INITIALIZING -> PLACING -> RUNNING -> RESTARTING -> PLACING ... -> FINISHED | FAILED | STOPPED.
Each state is a frozen payload (``states.py``) handled by one function that returns the
next state (``placing.py``, ``running.py``, ``restarting.py``); the controller only runs
the loop, answers queries and tears down. It never computes tensors and never imports
torch: it places workers, polls them, records what happens and decides through policies.

A plain class: ``ray.remote(Controller)`` at spawn time makes it the named run actor; unit
tests drive it with a stand-in cluster and clock (``tests/test_controller_states.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import traceback
from typing import Optional

from rayflex.config import TrainSpec
from rayflex.control.cluster import Clock, RayCluster
from rayflex.control.context import RunContext
from rayflex.control.seams import Cluster
from rayflex.control.handoff import commit_handed_off
from rayflex.control.placing import place
from rayflex.control.restarting import restart
from rayflex.control.running import run_attempt
from rayflex.control.states import Failed, Initializing, Placing, Restarting, Running, RunState
from rayflex.errors import WorkerError
from rayflex.faults.policy import Policies
from rayflex.telemetry import events as ev

log = logging.getLogger(__name__)

HANDLERS = {Placing: place, Running: run_attempt, Restarting: restart}


class Controller:
    def __init__(self, spec: TrainSpec, *, cluster: Optional[Cluster] = None, clock: Optional[Clock] = None,
                 knobs: Optional[dict] = None, policies: Optional[Policies] = None):
        from rayflex.constants import adopt_knobs

        adopt_knobs(knobs)
        self.spec = spec
        self.clock = clock or Clock()
        self.ctx = RunContext(spec, cluster or RayCluster(spec), self.clock, policies)
        self.state = Initializing()
        self.transitions: list[tuple[RunState, RunState]] = []
        self._started_at = self.clock.time()

    # ----------------------------------------------------------------- public
    def run(self) -> dict:
        """Drive the state machine to a terminal state; returns the result dict."""
        while not self.state.kind.terminal:
            try:
                nxt = self._initialize() if isinstance(self.state, Initializing) else \
                    HANDLERS[type(self.state)](self.ctx, self.state)
            except Exception as e:  # noqa: BLE001 - any error ends the run with its reason
                log.exception("controller error in state %s", self.state.kind.value)
                for actor in getattr(self.state, "survivors", {}).values():
                    self.ctx.cluster.kill(actor)
                nxt = Failed(self.ctx.stop_reason or f"{type(e).__name__}: {e}", e)
            self._transition(nxt)
        return self._finish()

    def status(self) -> dict:
        last, plan = self.ctx.ledger.last_metrics(), self.ctx.plan
        return {"name": self.spec.run.name, "state": self.state.kind.value, "step": self.ctx.ledger.step,
                "target_steps": self.spec.run.steps, "loss": last.get("loss"),
                "tokens_per_s": last.get("tokens_per_s"), "world_size": plan.world_size if plan else None,
                "last_checkpoint": self.ctx.ledger.last_checkpoint, "run_dir": self.spec.run.run_dir,
                "reason": self._reason(), "restarts": len(self.ctx.recorder.timeline.of(ev.Restarted)),
                # A spot notice shorter than this restores the last commit instead of saving.
                "emergency_notice_s": self.ctx.ledger.emergency_notice_s(self.spec.elastic.emergency_margin_s),
                "workers": self._workers()}

    def metrics(self, since_step: int = 0) -> list[dict]:
        return self.ctx.ledger.metrics(since_step)

    def events(self) -> list[dict]:
        return [e.to_dict() for e in self.ctx.recorder.timeline.events]

    def inject_failure(self, rank: int, at_step: int, message: str) -> int:
        """Fault injection (chaos runs, tests): rank ``rank`` of the current attempt raises
        ``message`` once, at the first step it starts at or after ``at_step``. A restart
        before then disarms it (the injector re-arms). Returns the rank's last finished step."""
        return self.ctx.cluster.set_fail_at(self.ctx.group.actors[rank], at_step, message)

    def process_info(self) -> dict:
        """The controller's own process: pid, peak resident memory, and whether torch was
        ever imported (it should not be: the controller is a 0-CPU actor beside the driver)."""
        import os
        import resource
        import sys

        return {"pid": os.getpid(), "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "torch_imported": "torch" in sys.modules}

    def request_stop(self, reason: str = "stop requested") -> None:
        self.ctx.stop_reason = reason
        self.ctx.stop_requested.set()

    # ----------------------------------------------------------------- states
    def _transition(self, nxt) -> None:
        log.info("run %s: %s -> %s", self.spec.run.name, self.state.kind.value, nxt.kind.value)
        self.transitions.append((self.state.kind, nxt.kind))
        self.state = nxt

    def _initialize(self) -> Placing:
        """A run directory with history continues its files (resume by name)."""
        last_step = self.ctx.ledger.resume(self.ctx.recorder.resume())
        self.ctx.recorder.start()
        self.ctx.recorder.rundir.write_json("spec.json", _describe_spec(self.spec))
        self.ctx.record(ev.RunStarted(name=self.spec.run.name, target_steps=self.spec.run.steps, step=last_step))
        return Placing()

    def _workers(self) -> list[dict]:
        group = self.ctx.group
        if group is None or not getattr(group, "node_of", None):
            return []
        pids = getattr(group, "pids", {})
        return [{"rank": r, "node_id": group.node_of.get(r), "pid": pids.get(r)} for r in sorted(group.node_of)]

    def _reason(self) -> str:
        """Why the run is in its state: a failure or stop, or why it is placing again."""
        return getattr(self.state, "reason", "") or getattr(self.state, "restart_reason", "") or self.ctx.stop_reason

    # ----------------------------------------------------------------- teardown
    def _finish(self) -> dict:
        if self.state.kind is RunState.FINISHED:
            self.ctx.record(ev.RunFinished(step=self.ctx.ledger.step))
        elif self.state.kind is RunState.FAILED:
            self.ctx.record(ev.RunFailedEvent(step=self.ctx.ledger.step, reason=self.state.reason))
        self._teardown()
        self.ctx.recorder.finish()
        result = self.result()
        self.ctx.recorder.rundir.write_json("result.json", result)
        from rayflex.telemetry import report

        if report.drawn_at_run_end():
            try:  # the report is a convenience: never fail a run over a plot
                report.write_report(self.spec.run.run_dir)
            except Exception as e:  # noqa: BLE001
                log.warning("could not write the run report: %s", e)
        return result

    def _teardown(self) -> None:
        ctx = self.ctx
        for what, release in (("worker shutdown", ctx.group and ctx.group.shutdown),
                              ("standby release", ctx.standby and ctx.standby.clear),
                              ("preemption watcher", ctx.watcher and ctx.watcher.close),
                              ("placement removal", ctx.reservation and ctx.reservation.remove),
                              # before the keepers go: they may still be uploading it
                              ("handed-off checkpoint", ctx.keepers and (lambda: commit_handed_off(ctx))),
                              ("replica keepers", ctx.keepers and ctx.keepers.clear)):
            if release:
                try:
                    release()
                except Exception:  # noqa: BLE001 - release the rest all the same
                    log.warning("%s failed:\n%s", what, traceback.format_exc())

    def result(self) -> dict:
        ledger, timeline = self.ctx.ledger, self.ctx.recorder.timeline
        metrics = ledger.metrics()
        steady = [m["tokens_per_s"] for m in metrics[1:] if m["step"] > ledger.start_step + 1
                  and m.get("tokens_per_s")]
        err = getattr(self.state, "error", None)
        return {
            "name": self.spec.run.name,
            "status": self.state.kind.value.lower(),
            "reason": self._reason(),
            "error_type": type(err).__name__ if err else None,
            "error": (err.traceback if isinstance(err, WorkerError) else str(err)) if err else None,
            "error_rank": getattr(err, "rank", None),
            "error_node": getattr(err, "node_id", None),
            "error_step": getattr(err, "step", None),
            "steps_completed": ledger.step,
            "target_steps": self.spec.run.steps,
            "start_step": ledger.start_step,
            "first_loss": metrics[0]["loss"] if metrics else None,
            "final_loss": metrics[-1]["loss"] if metrics else None,
            "tokens_per_s": statistics.median(steady) if steady else None,
            "time_to_first_step_s": (ledger.first_step_at - self._started_at) if ledger.first_step_at else None,
            "wall_time_s": self.clock.time() - self._started_at,
            "world_size": self.ctx.plan.world_size if self.ctx.plan else None,
            "restarts": len(timeline.of(ev.Restarted)),
            "failures": len(timeline.of(ev.WorkerFailed)) + len(timeline.of(ev.WorkerDied)),
            "last_checkpoint": ledger.last_checkpoint,
            "run_dir": self.spec.run.run_dir,
            "goodput": _goodput(metrics, timeline),
            "cost": _cost(metrics, timeline),
            "preemptions": len({e.node_id for e in timeline.of(ev.PreemptionNotice) if e.ranks}),
            "lost_steps": sum(e.lost_steps for e in timeline.of(ev.Restarted)),
        }


def _describe_spec(spec: TrainSpec) -> dict:
    out = {name: dataclasses.asdict(getattr(spec, name))
           for name in ("data", "run", "scaling", "parallel", "checkpoint", "elastic")}
    out["model"] = {"name": spec.model.name, "num_blocks": spec.model.num_blocks}
    metadata = getattr(spec.model, "metadata", None)
    if metadata:  # e.g. a Hugging Face model's family and the config an exporter writes
        out["model"]["metadata"] = metadata
    return out


def _cost(metrics: list[dict], timeline) -> Optional[dict]:
    """What the run cost by category (None: no node it held has a price)."""
    try:
        from rayflex.telemetry.cost import cost_breakdown

        cost = cost_breakdown(metrics, timeline.events)
        return cost.to_dict() if cost is not None else None
    except Exception as e:  # noqa: BLE001 - a report number must not fail the run
        log.warning("cost unavailable: %s", e)
        return None


def _goodput(metrics: list[dict], timeline) -> Optional[float]:
    try:
        from rayflex.telemetry.goodput import goodput

        return goodput(metrics, timeline.events)
    except Exception as e:  # noqa: BLE001 - a report number must not fail the run
        log.warning("goodput unavailable: %s", e)
        return None
