"""The run directory is stored on a ticker of its own: an object-store outage is named while
the controller's thread is busy elsewhere (diagnosing a hang, releasing survivors), not once
it comes back to its polling loop — the cause of a chaos run naming an outage after 12 s on a
slow host, where the bound it promised was 10."""

import threading
import time

import pytest

import rayflex as rf
from rayflex.control.cluster import Clock
from rayflex.control.recorder import Recorder
from rayflex.storage.rundir import RunDirectory
from rayflex.telemetry import events as ev

from conftest import wait_for

STALL_S, FLUSH_S = 0.6, 0.1


@pytest.fixture
def recorder(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYFLEX_STORAGE_STALL_S", str(STALL_S))
    monkeypatch.setenv("RAYFLEX_RUNDIR_FLUSH_S", str(FLUSH_S))
    rec = Recorder(rf.RunConfig(name="unit", storage=f"file://{tmp_path}/runs"), Clock())
    rec.rundir.ensure()
    yield rec
    rec._stop_ticker and rec._stop_ticker()


def _hanging_writes(monkeypatch) -> threading.Event:
    """Every write of the run directory blocks until the returned event is set (an endpoint
    that accepts connections and never answers)."""
    back = threading.Event()
    flush = RunDirectory.flush

    def hang(self):
        back.wait()
        return flush(self)

    monkeypatch.setattr(RunDirectory, "flush", hang)
    return back


def test_an_outage_is_named_and_its_end_too_without_the_controller_calling(recorder, monkeypatch, tmp_path):
    recorder.start()
    recorder.add_metrics({"step": 1})
    wait_for(lambda: (tmp_path / "runs" / "unit" / "metrics.jsonl").exists(), 30, "the ticker's first write")
    back = _hanging_writes(monkeypatch)
    down_at = time.time()
    recorder.add_metrics({"step": 2})
    # This thread (the controller's) calls nothing from here on.
    wait_for(lambda: recorder.timeline.of(ev.StorageUnavailable), 60, "storage_unavailable from the ticker")
    named = recorder.timeline.of(ev.StorageUnavailable)[0]
    assert named.time - down_at >= STALL_S, "named as a stall: not before STORAGE_STALL_S"
    assert "has not finished" in named.error
    back.set()
    wait_for(lambda: recorder.timeline.of(ev.StorageRecovered), 60, "storage_recovered from the ticker")
    wait_for(lambda: '"step": 2' in (tmp_path / "runs" / "unit" / "metrics.jsonl").read_text(), 30,
             "the line written during the outage stored once it ended")
    recorder.finish()
    assert recorder.timeline.of(ev.StorageUnavailable) == [named], "one outage, named once"


def test_finish_stops_the_ticker(recorder, tmp_path):
    recorder.start()
    recorder.finish()
    ticks = [t for t in threading.enumerate() if t.name == "rundir-ticker"]
    wait_for(lambda: not any(t.is_alive() for t in ticks), 30, "the ticker's thread to end")
