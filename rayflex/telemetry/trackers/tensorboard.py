"""TensorBoard event files in ``{run_dir}/tensorboard/`` (training curves) and
``{run_dir}/tensorboard/events/`` (restarts, preemptions, checkpoints, failures, as a run
of their own so a rewind never erases them).

Written with the ``tensorboard`` package's event writer and protos, not tensorboardX (which
imports torch: the Controller must not). A rewind closes the writer and opens a new file
that begins with a ``SessionLog.START`` event at the first void step: TensorBoard purges
every point at or after that step from the files before it, so a restart leaves one curve.
A remote run directory (s3://) is written to a local temporary folder and uploaded through
``rayflex.storage.fs`` at every checkpoint and at the end, which then removes the folder
(an upload that fails leaves it, with the run's curves).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Optional

from rayflex.storage import fs as rfs
from rayflex.telemetry.trackers.tracker import KeyEvent, RunEnd, Tracker


class TensorBoardTracker(Tracker):
    name = "tensorboard"
    rewinds = True

    def __init__(self, root: "rfs.Store | str", *parts: str):
        """Event files under ``root`` (a resolved run directory, or a URI) at ``parts``."""
        store = rfs.Store.of(root)
        self.uri = store.uri_of(*parts)
        fs, path = store.fs, store.path_of(*parts)
        if rfs.is_local(fs):
            self._local, self._remote = path, None
        else:
            self._local, self._remote = tempfile.mkdtemp(prefix="rayflex-tensorboard-"), (fs, path)
        self._curves = self._events = None

    def open(self, state: Optional[dict]) -> dict:
        os.makedirs(os.path.join(self._local, "events"), exist_ok=True)
        self._curves = self._writer(self._local)
        self._events = self._writer(os.path.join(self._local, "events"))
        return {"logdir": self.uri}

    def log_metrics(self, step: int, values: dict[str, float]) -> None:
        self._scalars(self._curves, step, values)

    def rewind(self, step: int) -> None:
        self._curves.close()
        self._curves = self._writer(self._local, purge_from=step + 1)

    def log_event(self, event: KeyEvent) -> None:
        self._scalars(self._events, event.step, {f"events/{event.name}": float(event.count)})

    def sync(self) -> None:
        self._curves.flush()
        self._events.flush()
        self._upload()

    def close(self, end: RunEnd, goodput: Optional[float], step: int) -> None:
        if goodput is not None:
            self._scalars(self._events, step, {"run/goodput": goodput})
        self._curves.close()
        self._events.close()
        self._upload()
        if self._remote is not None:  # uploaded: the local copy of a remote run goes
            shutil.rmtree(self._local, ignore_errors=True)

    # -----------------------------------------------------------------
    @staticmethod
    def _writer(logdir: str, purge_from: Optional[int] = None):
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        writer = EventFileWriter(logdir, flush_secs=10)
        if purge_from is not None:
            writer.add_event(Event(wall_time=time.time(), step=purge_from,
                                   session_log=SessionLog(status=SessionLog.START)))
        return writer

    @staticmethod
    def _scalars(writer, step: int, values: dict[str, float]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        writer.add_event(Event(wall_time=time.time(), step=step, summary=Summary(
            value=[Summary.Value(tag=tag, simple_value=value) for tag, value in values.items()])))

    def _upload(self) -> None:
        if self._remote is None:
            return
        fs, path = self._remote
        for root, _, files in os.walk(self._local):
            rel = os.path.relpath(root, self._local)
            for name in files:
                target = path if rel == "." else f"{path}/{rel}"
                fs.put_file(os.path.join(root, name), f"{target}/{name}")
