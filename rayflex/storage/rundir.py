"""The run directory ``{storage}/{name}/``: metrics, events, result, spec.

Line files are appended where the filesystem can append (local disk, memory) and
rewritten whole where it cannot (object stores have no append); the controller keeps the
lines in memory either way, so a rewrite never loses data. For the same reason a write
that fails (the object store is down for a while) does not fail the run: ``flush``
reports the error, and the next flush writes everything that is still missing. Lines may
be added from one thread while another flushes (the controller flushes in the background,
so a slow store never stalls fault detection).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, Optional

from rayflex.constants import knob
from rayflex.storage import fs as rfs

log = logging.getLogger(__name__)


class RunDirectory:
    def __init__(self, uri: str):
        self.uri = uri.rstrip("/")
        self.store = rfs.Store(self.uri)  # resolved once: every file below goes through it
        self.fs, self.path = self.store.fs, self.store.path
        self._can_append = rfs.can_append(self.fs)
        self._lines: dict[str, list[str]] = {}
        self._flushed: dict[str, int] = {}
        self._stale: set[str] = set()  # the stored file must be rewritten whole
        self._generation: dict[str, int] = {}  # bumped by rewrite(): a flush in flight is outdated
        self._lock = threading.Lock()

    def ensure(self) -> None:
        rfs.ensure_dir(self.fs, self.path)

    def file(self, name: str) -> str:
        return f"{self.path}/{name}"

    def exists(self, name: str) -> bool:
        return self.store.exists(name)

    def read_text(self, name: str) -> Optional[str]:
        try:
            return self.store.read_text(name)
        except FileNotFoundError:
            return None

    def read_json(self, name: str) -> Optional[Any]:
        text = self.read_text(name)
        return None if text is None else json.loads(text)

    def read_jsonl(self, name: str) -> list[dict]:
        text = self.read_text(name) or ""
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def write_json(self, name: str, obj: Any) -> None:
        """Written atomically: readers never see half a file."""
        self.store.write_text_atomic(json.dumps(obj, indent=2, default=str), name)

    def load_lines(self, name: str) -> None:
        """Adopt the existing lines of a file (a resumed run continues its files)."""
        text = self.read_text(name) or ""
        with self._lock:
            self._lines[name] = [line for line in text.splitlines() if line.strip()]
            self._flushed[name] = len(self._lines[name])

    def add_line(self, name: str, obj: Any) -> None:
        line = json.dumps(obj, default=str)
        with self._lock:
            self._lines.setdefault(name, []).append(line)

    def rewrite(self, name: str, keep) -> None:
        """Keep only the lines whose parsed JSON satisfies ``keep``; the next flush
        rewrites the file (a restart rolls back the steps after its checkpoint)."""
        with self._lock:
            self._lines[name] = [line for line in self._lines.get(name, []) if keep(json.loads(line))]
            self._stale.add(name)
            self._generation[name] = self._generation.get(name, 0) + 1

    def lines(self, name: str) -> list[str]:
        with self._lock:
            return list(self._lines.get(name, []))

    def flush(self) -> Optional[str]:
        """Write the lines not yet stored. Never raises for a storage failure: returns its
        text (None when everything is stored), and the next flush tries again."""
        with self._lock:
            pending = [(name, list(lines), self._flushed.get(name, 0), name in self._stale,
                        self._generation.get(name, 0)) for name, lines in self._lines.items()
                       if self._flushed.get(name, 0) != len(lines) or name in self._stale]
        error = None
        for name, lines, done, stale, generation in pending:
            try:
                if self._can_append and not stale and self.fs.exists(self.file(name)):
                    with self.fs.open(self.file(name), "a") as f:
                        f.write("".join(line + "\n" for line in lines[done:]))
                else:
                    with self.fs.open(self.file(name), "w") as f:
                        f.write("".join(line + "\n" for line in lines))
            except Exception as e:  # noqa: BLE001 - the lines stay in memory for the next flush
                with self._lock:
                    self._stale.add(name)
                error = error or f"writing {self.uri}/{name}: {type(e).__name__}: {e}"
                continue
            with self._lock:
                if self._generation.get(name, 0) == generation:  # not rolled back meanwhile
                    self._flushed[name] = len(lines)
                    self._stale.discard(name)
        return error

    def flush_until_stored(self, timeout_s: float, interval_s: Optional[float] = None) -> None:
        """Flush, retrying for up to ``timeout_s`` (the end of a run: nothing may be lost to
        a short outage) every ``interval_s`` (default: the STORAGE_FINAL_RETRY_INTERVAL_S
        knob); raises OSError naming the problem if storage never came back."""
        interval_s = knob("STORAGE_FINAL_RETRY_INTERVAL_S") if interval_s is None else interval_s
        deadline = time.time() + timeout_s
        while True:
            error = self.flush()
            if error is None:
                return
            if time.time() >= deadline:
                raise OSError(f"{error}. Fix: check that the storage endpoint is up; the run's "
                              f"lines could not be stored for {timeout_s:.0f}s")
            log.warning("run directory not stored yet (%s); retrying in %.0fs", error, interval_s)
            time.sleep(interval_s)
