"""Nodes checked before use: a node the run is about to grow onto runs a health check
first (``worker.health_probe``), and one that fails it is held out of placement and named;
so is a node evicted as a straggler. A held-out node is checked again every
``HEALTH_RECHECK_S`` (doubling each time it is held out again in the run), and re-admitted
— usable for the next growth — once it passes. The verdicts are the health policy's
(``faults.health``); each is a ``node_health_checked`` event.

The yardstick is the run's own nodes. On GPUs, the speed every rank measured on its own
device at setup. On CPUs the cores may be shared with the run's ranks (several emulated
nodes on one machine; a CPU node's other tenants), and a check beside a training step gets
only part of a core: there, each round of checks also runs one on a node the run trains
on, timed in the same window (a load that swings by the second hits both alike), and that is
the yardstick (the setup figure if it fails). A check is judged only against a yardstick
timed with it: one whose new worker started after the window (a slow node's raylet and
Python start slowly too) is run again at once, with a lead that covers the start each node
was seen to take, at most ``WINDOW_ROUNDS`` rounds.

Restarts after a failure place on the nodes Ray lists without a check (a restart is
latency-bound); they never place on a held-out node.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Optional

from rayflex.constants import knob
from rayflex.faults.health import HealthPolicy, HealthVerdict, reference_speed
from rayflex.telemetry import events as ev
from rayflex.worker.health_probe import WINDOW_S

log = logging.getLogger(__name__)


# Rounds of a node's check whose window missed the yardstick's before it is judged against
# the setup figure instead (each round waits longer, for the start the last one took).
WINDOW_ROUNDS = 3


@dataclass(frozen=True)
class HeldOut:
    reason: str
    check_at: float  # when it is checked again


@dataclass(frozen=True)
class _Check:
    probe: Any  # what ``cluster.check_health`` returned for it
    node_id: str
    node: Any  # the topology's node (None for the yardstick, a node the run trains on)
    started: float  # the controller's clock
    submitted_at: float  # epoch seconds, as the probe's ``window_at``


class NodeHealth:
    def __init__(self, cluster, clock, policy: Optional[HealthPolicy], *, gpus_per_slot: int = 0):
        self._cluster, self._clock, self.policy = cluster, clock, policy
        self._gpus_per_slot = gpus_per_slot
        self.held_out: dict[str, HeldOut] = {}
        self.passed: set[str] = set()  # checked and healthy, or trained on, in this run
        self.reference: Optional[float] = None  # GFLOP/s of the nodes the run trains on, at setup
        self.training_on: set[str] = set()  # the current attempt's nodes
        self._probes: dict[str, _Check] = {}  # node -> its check under way
        self._yardstick: Optional[_Check] = None  # CPU: a check of a node the run trains on
        self._yardstick_gflops: Optional[float] = None
        self._yardstick_at: Optional[float] = None  # epoch seconds its timing began
        self._late_once: set[str] = set()  # nodes a check began late on (a new worker's start)
        self._start_s: dict[str, float] = {}  # node -> how long a check took to begin timing there
        self._rounds: dict[str, int] = {}  # node -> rounds of its check not timed beside the yardstick
        self._times: dict[str, int] = {}  # node -> how often it was held out in this run

    @property
    def enabled(self) -> bool:
        return self.policy is not None

    @property
    def checking(self) -> bool:
        return bool(self._probes) or self._yardstick is not None

    def hold_out(self, node: str, reason: str) -> None:
        """Leave ``node`` out of placement until it passes a check (never, with checks off)."""
        self._times[node] = self._times.get(node, 0) + 1
        self.passed.discard(node)
        self.training_on.discard(node)  # no yardstick while the restart without it is under way
        self._hold(node, reason, self._clock.time())

    def _hold(self, node: str, reason: str, now: float) -> None:
        """Out until a check after HEALTH_RECHECK_S, doubled for each earlier hold-out."""
        self.held_out[node] = HeldOut(reason, now + knob("HEALTH_RECHECK_S") * 2 ** (self._times[node] - 1))

    def attempt_started(self, node_ids, speeds) -> None:
        """A new attempt runs on ``node_ids``; its ranks measured ``speeds`` at setup. A node
        the run has trained on needs no check to be grown back onto (a run that shrank off it
        when another rank failed); only nodes new to the run, or held out, are checked."""
        self.training_on = set(node_ids)
        self.passed |= self.training_on - set(self.held_out)
        self.reference = reference_speed(speeds)

    def ready_for_growth(self, topology) -> bool:
        """Whether every node a growth could use now has a verdict; starts the checks of the
        ones that have none (their verdicts arrive in ``tick``)."""
        if not self.enabled:
            return True
        unchecked = [n for n in topology.nodes if n.slots and n.node_id not in self.training_on
                     and n.node_id not in self.passed and n.node_id not in self.held_out]
        self._start([n for n in unchecked if n.node_id not in self._probes])
        return not unchecked

    def tick(self, ctx, topology_of) -> None:
        """Read the checks that finished (or ran out of time), and start the re-checks due
        (``topology_of()``: the cluster's topology, read only when one is due)."""
        if not self.enabled:
            return
        now = self._clock.time()
        timeout = knob("HEALTH_PROBE_TIMEOUT_S")
        if self._yardstick is not None:
            check = self._yardstick
            report = self._cluster.health_reports({check.node_id: check.probe}).get(check.node_id)
            if report is None and now - check.started > timeout:
                report = {"error": "did not run"}
            if report is not None:
                self._yardstick = None
                self._learn(check, report)
                failed = bool(report.get("error")) or not report.get("gflops")
                self._yardstick_gflops = None if failed else report["gflops"]
                self._yardstick_at = None if failed else report.get("window_at")
        if self._probes and self._yardstick is None:  # judged against a yardstick of the same moment
            reports = self._cluster.health_reports({n: c.probe for n, c in self._probes.items()})
            for node, check in list(self._probes.items()):
                if node not in reports and now - check.started > timeout:
                    reports[node] = {"error": f"the check did not run within {timeout:g} s"}
            again = []
            for node, report in reports.items():
                check = self._probes.pop(node)
                self._learn(check, report)
                timed_beside = self._timed_beside_yardstick(node, report)
                if timed_beside is None:
                    again.append(check.node)
                    continue
                self._rounds.pop(node, None)
                reference = self._yardstick_gflops if timed_beside else None
                self._judge(ctx, node, report, now, reference or self.reference)
            self._start(again)
        due = {n for n, held in self.held_out.items() if n not in self._probes and now >= held.check_at}
        if due:
            self._start([n for n in topology_of().nodes if n.node_id in due])

    def _learn(self, check: _Check, report: dict) -> None:
        """How long a check that began late took to begin timing on its node. The first late
        start there is a new worker's, which the next check finds started: only a second
        one sets the lead."""
        if not (report.get("late_s") and report.get("window_at")):
            return
        if check.node_id in self._late_once:
            self._start_s[check.node_id] = report["window_at"] - check.submitted_at
        self._late_once.add(check.node_id)

    def _timed_beside_yardstick(self, node: str, report: dict) -> Optional[bool]:
        """Whether ``node``'s check may be judged against the yardstick (True), against the
        setup figure (False: its windows kept missing), or runs again (None)."""
        at = report.get("window_at")
        if report.get("error") or at is None or self._yardstick_at is None:
            return True
        if abs(at - self._yardstick_at) <= WINDOW_S / 2:
            return True
        self._rounds[node] = self._rounds.get(node, 0) + 1
        if self._rounds[node] >= WINDOW_ROUNDS:
            return False
        log.info("node %s: its check was timed %.1f s apart from the run's node beside it; checking again",
                 node[:12], at - self._yardstick_at)
        return None

    def _start(self, nodes) -> None:
        if not nodes:
            return
        expected = {n.node_id: n.slots * self._gpus_per_slot for n in nodes}
        # CPUs: the same check on a node the run trains on; never one under suspicion (a
        # slow node judged against itself passes).
        peers = self.training_on - set(self.held_out) - set(expected)
        yardstick = None
        if not self._gpus_per_slot and peers and self._yardstick is None:
            yardstick = min(peers)
            expected[yardstick] = 0
        # On CPUs the yardstick and the checks are timed in one window, a lead from now that
        # covers a check's start (a new worker process, numpy imported) on every node of the
        # round: as long as the start seen there, half as long again.
        submitted_at = time.time()
        lead = max([knob("HEALTH_PROBE_LEAD_S")] + [1.5 * self._start_s.get(n, 0.0) for n in expected])
        lead = min(lead, knob("HEALTH_PROBE_TIMEOUT_S") / 2)
        probes = self._cluster.check_health(expected, submitted_at + lead if yardstick is not None else None)
        now = self._clock.time()
        if yardstick is not None:
            self._yardstick = _Check(probes.pop(yardstick), yardstick, None, now, submitted_at)
            self._yardstick_gflops = self._yardstick_at = None
        self._probes.update({n.node_id: _Check(probes[n.node_id], n.node_id, n, now, submitted_at)
                             for n in nodes})

    def _judge(self, ctx, node: str, report: dict, now: float, reference: Optional[float]) -> None:
        verdict: HealthVerdict = self.policy.judge(node, report, reference)
        held = self.held_out.get(node)
        if verdict.passed:
            self.passed.add(node)
            action = "readmitted" if held else "admitted"
            self.held_out.pop(node, None)
        else:
            action = "kept_out" if held else "left_out"
            if not held:
                self._times[node] = self._times.get(node, 0) + 1
            self._hold(node, verdict.reason, now)
            log.warning("node %s %s: %s", node[:12], action.replace("_", " "), verdict.reason)
        ctx.record(ev.NodeHealthChecked(step=ctx.ledger.step, node_id=node, passed=verdict.passed, action=action,
                                        reason=verdict.reason, gflops=verdict.gflops,
                                        reference_gflops=verdict.reference_gflops,
                                        probe_s=float(report.get("probe_s") or 0.0)))
