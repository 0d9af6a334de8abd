"""The run directory survives an object-store outage: nothing written during it is lost."""

import json

import pytest

from rayflex.storage.rundir import RunDirectory


class _Outage:
    """Makes the filesystem's open() fail like an unreachable endpoint while ``down``."""

    def __init__(self, fs, monkeypatch):
        self.down = False
        real = fs.open

        def open_(path, mode="rb", *a, **kw):
            if self.down:
                raise ConnectionError("Could not connect to the endpoint URL")
            return real(path, mode, *a, **kw)

        monkeypatch.setattr(fs, "open", open_)


def _stored(tmp_path, name):
    return [json.loads(line) for line in (tmp_path / "run" / name).read_text().splitlines()]


def test_lines_written_during_an_outage_are_stored_when_it_ends(tmp_path, monkeypatch):
    rd = RunDirectory(f"file://{tmp_path}/run")
    rd.ensure()
    outage = _Outage(rd.fs, monkeypatch)
    rd.add_line("metrics.jsonl", {"step": 1})
    assert rd.flush() is None
    outage.down = True
    rd.add_line("metrics.jsonl", {"step": 2})
    rd.add_line("metrics.jsonl", {"step": 3})
    error = rd.flush()
    assert error and "metrics.jsonl" in error and "ConnectionError" in error
    # A restart rolls back step 3 while storage is still down.
    rd.rewrite("metrics.jsonl", lambda line: line["step"] <= 2)
    rd.add_line("metrics.jsonl", {"step": 3, "rerun": True})
    assert rd.flush() is not None
    outage.down = False
    assert rd.flush() is None
    assert _stored(tmp_path, "metrics.jsonl") == [{"step": 1}, {"step": 2}, {"step": 3, "rerun": True}]


def test_the_final_flush_waits_then_names_the_problem(tmp_path, monkeypatch):
    rd = RunDirectory(f"file://{tmp_path}/run")
    rd.ensure()
    _Outage(rd.fs, monkeypatch).down = True
    rd.add_line("events.jsonl", {"kind": "run_finished"})
    with pytest.raises(OSError, match="events.jsonl.*Fix: check that the storage endpoint is up"):
        rd.flush_until_stored(timeout_s=0.3, interval_s=0.1)
