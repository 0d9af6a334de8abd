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
the yardstick (the setup figure if it fails).

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

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeldOut:
    reason: str
    check_at: float  # when it is checked again


class NodeHealth:
    def __init__(self, cluster, clock, policy: Optional[HealthPolicy], *, gpus_per_slot: int = 0):
        self._cluster, self._clock, self.policy = cluster, clock, policy
        self._gpus_per_slot = gpus_per_slot
        self.held_out: dict[str, HeldOut] = {}
        self.passed: set[str] = set()  # checked and healthy, or trained on, in this run
        self.reference: Optional[float] = None  # GFLOP/s of the nodes the run trains on, at setup
        self.training_on: set[str] = set()  # the current attempt's nodes
        self._probes: dict[str, tuple[Any, float]] = {}  # node -> (its probe, started at)
        self._yardstick: Optional[tuple[str, Any, float]] = None  # CPU: (training node, its probe, started at)
        self._yardstick_gflops: Optional[float] = None
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
            node, probe, started = self._yardstick
            report = self._cluster.health_reports({node: probe}).get(node)
            if report is None and now - started > timeout:
                report = {"error": "did not run"}
            if report is not None:
                self._yardstick = None
                self._yardstick_gflops = None if report.get("error") else report.get("gflops") or None
        if self._probes and self._yardstick is None:  # judged against a yardstick of the same moment
            reports = self._cluster.health_reports({n: p for n, (p, _) in self._probes.items()})
            for node, (_, started) in list(self._probes.items()):
                if node not in reports and now - started > timeout:
                    reports[node] = {"error": f"the check did not run within {timeout:g} s"}
            for node, report in reports.items():
                del self._probes[node]
                self._judge(ctx, node, report, now)
        due = {n for n, held in self.held_out.items() if n not in self._probes and now >= held.check_at}
        if due:
            self._start([n for n in topology_of().nodes if n.node_id in due])

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
        # covers a check's start (a new worker process, torch imported).
        start_at = time.time() + knob("HEALTH_PROBE_LEAD_S") if yardstick is not None else None
        probes = self._cluster.check_health(expected, start_at)
        now = self._clock.time()
        if yardstick is not None:
            self._yardstick, self._yardstick_gflops = (yardstick, probes.pop(yardstick), now), None
        self._probes.update({n: (p, now) for n, p in probes.items()})

    def _judge(self, ctx, node: str, report: dict, now: float) -> None:
        verdict: HealthVerdict = self.policy.judge(node, report, self._yardstick_gflops or self.reference)
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
