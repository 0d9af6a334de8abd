"""Recorder: every event of a run goes to its timeline, the metrics exporter, the experiment
trackers (``telemetry/trackers/``) and the run directory; the run directory is stored in the
background so a slow store never stalls fault detection, and an outage is an event, not a
failure.

The storing runs on a ticker of its own (``start``), not in the controller's states: an
outage is named within ``RUNDIR_FLUSH_S + STORAGE_STALL_S`` of its start (plus one tick)
whatever the controller is doing meanwhile — diagnosing a hang, releasing survivors,
waiting for a placement — all of which can take longer than that."""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from rayflex.constants import knob
from rayflex.config import RunConfig
from rayflex.storage.rundir import RunDirectory
from rayflex.telemetry import events as ev

log = logging.getLogger(__name__)


class Recorder:
    def __init__(self, run: RunConfig, clock):
        from rayflex.telemetry.metrics_export import MetricsExporter
        from rayflex.telemetry.trackers.tracker_set import TrackerSet

        self.run, self.clock = run, clock
        self.timeline = ev.Timeline()
        self.rundir = RunDirectory(run.run_dir)
        self.exporter = MetricsExporter(run.name)
        # Trackers deliver on a thread of their own; a failure comes back as an event here.
        self.trackers = TrackerSet.for_run(run, self.rundir, on_failure=self.record)
        self.step = 0  # stamped on storage events; the ledger keeps it current
        self._flusher = ThreadPoolExecutor(1, thread_name_prefix="rundir")
        self._flush_future = None
        self._flush_started = 0.0
        self._down_since: Optional[float] = None
        # The ticker's thread records storage events beside the controller's thread.
        self._lock = threading.RLock()
        self._stop_ticker = None

    def start(self) -> None:
        """Store the run directory every ``RUNDIR_FLUSH_S`` from now until ``finish``."""
        if self._stop_ticker is None:
            self._stop_ticker = self.clock.every(knob("RUNDIR_FLUSH_S"), self.flush, name="rundir-ticker")

    def record(self, event: ev.Event) -> ev.Event:
        # Stamped by the controller's clock, the clock its waits and timeouts run on, so a
        # timeline's durations (goodput, cost) agree with them.
        event = dataclasses.replace(event, time=self.clock.time())
        with self._lock:
            self.timeline.add(event)
            self.exporter.on_event(event)
            self.trackers.on_event(event)
            self.rundir.add_line("events.jsonl", event.to_dict())
        log.info("event: %s", event.describe())
        return event

    def add_metrics(self, line: dict) -> None:
        self.rundir.add_line("metrics.jsonl", line)
        self.exporter.on_metrics(line)
        self.trackers.on_metrics(line)

    def resume(self) -> list[str]:
        """Continue a run directory with history (resume by name); returns its metric lines."""
        self.rundir.ensure()
        for name in ("metrics.jsonl", "events.jsonl", "samples.jsonl"):
            self.rundir.load_lines(name)
        self.timeline = ev.Timeline.from_jsonl("\n".join(self.rundir.lines("events.jsonl")))
        lines = self.rundir.lines("metrics.jsonl")
        self.trackers.resumed(self.timeline, [json.loads(line) for line in lines])
        return lines

    def flush(self) -> None:
        """Store the new lines in the background; report a write that failed or stalls."""
        with self._lock:
            self._flush()

    def _flush(self) -> None:
        now = self.clock.time()
        if self._flush_future is not None:
            if not self._flush_future.done():
                if now - self._flush_started > knob("STORAGE_STALL_S"):
                    self._trouble(f"a write of the run directory has not finished after "
                                  f"{now - self._flush_started:.0f}s")
                return
            error = self._flush_future.result()
            if error is not None:
                self._trouble(error)
            elif self._down_since is not None:
                down, self._down_since = now - self._down_since, None
                self.record(ev.StorageRecovered(step=self.step, uri=self.run.run_dir, down_s=down))
        self._flush_started = now
        self._flush_future = self._flusher.submit(self.rundir.flush)

    def finish(self) -> None:
        """Close the trackers, wait for the background flush, then store everything
        (retrying through an outage)."""
        if self._stop_ticker is not None:
            self._stop_ticker()
        self.trackers.finish(self._goodput())
        with self._lock:
            future, self._flush_future = self._flush_future, None
        if future is not None:
            future.result()
        self.rundir.flush_until_stored(knob("STORAGE_FINAL_WAIT_S"))
        self._flusher.shutdown(wait=False)

    def _goodput(self) -> Optional[float]:
        from rayflex.telemetry.goodput import goodput

        try:
            return goodput([json.loads(line) for line in self.rundir.lines("metrics.jsonl")], self.timeline.events)
        except Exception as e:  # noqa: BLE001 - a tracker number must not fail the run
            log.warning("goodput unavailable for the trackers: %s", e)
            return None

    def _trouble(self, error: str) -> None:
        if self._down_since is None:
            self._down_since = self.clock.time()
            self.record(ev.StorageUnavailable(step=self.step, uri=self.run.run_dir, error=error))
            log.warning("run directory unavailable, keeping its lines in memory: %s", error)
