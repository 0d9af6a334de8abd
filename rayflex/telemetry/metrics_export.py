"""Run metrics through ``ray.util.metrics``: Ray's Prometheus endpoint and dashboard.

A callback for the Controller: ``on_metrics(line)`` per ``metrics.jsonl`` line and
``on_event(event)`` per timeline event. Every series carries the tag ``run=<name>``;
Ray prefixes names with ``ray_`` and exports counters with a ``_total`` suffix, so
Prometheus sees e.g. ``ray_rayflex_step_time_seconds{run="gpt-demo"}`` and
``ray_rayflex_restarts_total{run="gpt-demo"}``.

The mapping (line/event -> samples) is pure and tested without Ray; the exporter applies
it to metric objects built lazily, and never lets a metrics error reach the run.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from rayflex.telemetry import events as ev

log = logging.getLogger(__name__)


class MetricType(enum.Enum):
    GAUGE = "gauge"      # set to the value
    COUNTER = "counter"  # incremented by the value


@dataclass(frozen=True)
class MetricDef:
    name: str
    type: MetricType
    description: str
    tag_keys: tuple[str, ...] = ("run",)


METRICS: dict[str, MetricDef] = {m.name: m for m in (
    MetricDef("rayflex_step", MetricType.GAUGE, "Last training step every rank finished"),
    MetricDef("rayflex_step_time_seconds", MetricType.GAUGE, "Wall time of the last step (slowest rank)"),
    MetricDef("rayflex_tokens_per_second", MetricType.GAUGE, "Training throughput of the last step"),
    MetricDef("rayflex_loss", MetricType.GAUGE, "Training loss of the last step"),
    MetricDef("rayflex_world_size", MetricType.GAUGE, "Number of training workers"),
    MetricDef("rayflex_tokens", MetricType.COUNTER, "Tokens trained (steps a restart rolls back count again)"),
    MetricDef("rayflex_checkpoint_blocked_seconds", MetricType.GAUGE,
              "Training time blocked by the last checkpoint (staging to host memory)"),
    MetricDef("rayflex_checkpoint_blocked_seconds_sum", MetricType.COUNTER, "Training time blocked by checkpoints"),
    MetricDef("rayflex_checkpoints", MetricType.COUNTER, "Committed checkpoints"),
    MetricDef("rayflex_restarts", MetricType.COUNTER, "Restarts of the worker group (failure, preemption, resize)"),
    MetricDef("rayflex_failures", MetricType.COUNTER, "Worker failures, deaths, lost nodes and hangs",
              ("run", "kind")),
    MetricDef("rayflex_preemptions", MetricType.COUNTER, "Preemption notices received"),
)}

_FAILURES = (ev.WorkerFailed, ev.WorkerDied, ev.NodeLost, ev.HangDetected)


@dataclass(frozen=True)
class Sample:
    metric: str
    value: float
    tags: tuple[tuple[str, str], ...] = ()


def samples_for_metrics(line: dict) -> list[Sample]:
    """What one ``metrics.jsonl`` line sets (tokens = tokens_per_s x step_time_s)."""
    out = []
    for key, metric in (("step", "rayflex_step"), ("step_time_s", "rayflex_step_time_seconds"),
                        ("tokens_per_s", "rayflex_tokens_per_second"), ("loss", "rayflex_loss"),
                        ("world_size", "rayflex_world_size")):
        if line.get(key) is not None:
            out.append(Sample(metric, float(line[key])))
    if line.get("tokens_per_s") and line.get("step_time_s"):
        out.append(Sample("rayflex_tokens", float(line["tokens_per_s"]) * float(line["step_time_s"])))
    return out


def samples_for_event(event: Union[ev.Event, dict]) -> list[Sample]:
    """What one timeline event (an ``Event``, or its stored dict) counts."""
    e = event if isinstance(event, ev.Event) else ev.parse_event(event)
    if isinstance(e, ev.CheckpointCommitted):
        blocked = float(e.blocked_s or 0.0)
        return [Sample("rayflex_checkpoints", 1.0), Sample("rayflex_checkpoint_blocked_seconds", blocked),
                Sample("rayflex_checkpoint_blocked_seconds_sum", blocked)]
    if isinstance(e, ev.Restarted):
        out = [Sample("rayflex_restarts", 1.0)]
        if e.world_size:
            out.append(Sample("rayflex_world_size", float(e.world_size)))
        return out
    if isinstance(e, _FAILURES):
        return [Sample("rayflex_failures", 1.0, (("kind", e.kind.value),))]
    if isinstance(e, ev.PreemptionNotice):
        return [Sample("rayflex_preemptions", 1.0)]
    if isinstance(e, (ev.PlanChosen, ev.WorkersStarted)) and e.world_size:
        return [Sample("rayflex_world_size", float(e.world_size))]
    return []


def _ray_metric(defn: MetricDef):
    from ray.util import metrics

    cls = metrics.Gauge if defn.type is MetricType.GAUGE else metrics.Counter
    return cls(defn.name, description=defn.description, tag_keys=defn.tag_keys)


class MetricsExporter:
    """Apply samples to ``ray.util.metrics`` objects tagged ``run=<name>``.

    ``factory(MetricDef) -> object with set()/inc()`` defaults to Ray's Gauge/Counter;
    tests pass a recorder.
    """

    def __init__(self, run_name: str, factory: Optional[Callable[[MetricDef], Any]] = None):
        self.run_name = run_name
        self._factory = factory or _ray_metric
        self._metrics: dict[str, Any] = {}
        self._broken = False

    def on_metrics(self, line: dict) -> None:
        self._apply(samples_for_metrics(line))

    def on_event(self, event: Union[ev.Event, dict]) -> None:
        self._apply(samples_for_event(event))

    def _apply(self, samples: list[Sample]) -> None:
        if self._broken:
            return
        try:
            for s in samples:
                defn = METRICS[s.metric]
                metric = self._metrics.get(s.metric)
                if metric is None:
                    metric = self._metrics[s.metric] = self._factory(defn)
                tags = {"run": self.run_name, **dict(s.tags)}
                if defn.type is MetricType.GAUGE:
                    metric.set(s.value, tags=tags)
                elif s.value > 0:  # Ray counters only take positive increments
                    metric.inc(s.value, tags=tags)
        except Exception:  # noqa: BLE001 - metrics must never fail a run
            log.warning("exporting run metrics failed; metrics export disabled for run %s", self.run_name,
                        exc_info=True)
            self._broken = True
