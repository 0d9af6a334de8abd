"""Whether a node may be used: the health policy's verdict on a node's probe
(``worker.health_probe.probe_node``) against the speed of the nodes the run trains on.

A node fails when its probe could not run or found a fault (GPUs missing, a wrong
product), or when it computes at less than ``min_speed`` of the reference: the median of
the speeds the current attempt's ranks measured at setup, on the devices they train on.
The comparison is against the run's own nodes, not an absolute figure, so it holds for any
hardware; a run whose ranks measured nothing (no reference) judges faults only.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median
from typing import Iterable, Optional


@dataclass(frozen=True)
class HealthVerdict:
    node_id: str
    passed: bool
    reason: str
    gflops: float = 0.0
    reference_gflops: Optional[float] = None


def reference_speed(speeds: Iterable[Optional[float]]) -> Optional[float]:
    """The median of the ranks' measured speeds (None where none measured)."""
    measured = [s for s in speeds if s]
    return median(measured) if measured else None


@dataclass(frozen=True)
class HealthPolicy:
    min_speed: float = 0.5

    def judge(self, node_id: str, report: dict, reference: Optional[float]) -> HealthVerdict:
        gflops = float(report.get("gflops") or 0.0)
        if report.get("error"):
            return HealthVerdict(node_id, False, f"health check failed: {report['error']}", gflops, reference)
        if reference:
            ratio = gflops / reference
            if ratio < self.min_speed:
                return HealthVerdict(node_id, False,
                                     f"computes at {ratio:.2f}x the run's nodes ({gflops:.2f} vs {reference:.2f} "
                                     f"GFLOP/s; needs {self.min_speed:g}x)", gflops, reference)
            return HealthVerdict(node_id, True, f"healthy: computes at {ratio:.2f}x the run's nodes "
                                 f"({gflops:.2f} vs {reference:.2f} GFLOP/s)", gflops, reference)
        return HealthVerdict(node_id, True, f"healthy: its devices answer ({gflops:.2f} GFLOP/s; no speed of the "
                             "run's own nodes to compare with)", gflops, reference)
