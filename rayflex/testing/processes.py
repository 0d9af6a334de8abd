"""Local processes for harnesses (replays, tests), forked ready instead of spawned cold.

A spawned process imports torch and the worker again: ~2 CPU-s each (``python -X importtime
-c "import rayflex.worker.train_worker"``: 1.2 s, 1.13 of it torch), paid for every rank of
every replay and multi-process test. Here a fork server imports them once per process that
asks (``multiprocessing``'s ``forkserver`` with a preload), and each new process is forked
from it with the imports done. What a spawned process would see is kept: the target runs
with the environment of the caller at ``Process(...)`` time (the server's is the one it was
started with), and the server never initializes a process group or a thread pool.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from typing import Any, Callable, Sequence

# The fork server starts once per process and keeps the preload of its first start.
_preload: list[str] | None = None


def preload(modules: Sequence[str]) -> None:
    """Add ``modules`` to what the fork server imports, if it has not started yet (a test
    session names its heavy imports once, before any pool starts)."""
    global _preload
    _preload = [*(_preload or ["rayflex.worker.train_worker"]), *modules]
    mp.get_context("forkserver").set_forkserver_preload(_preload)


class ForkedContext:
    """The parts of a multiprocessing context a harness uses: ``Queue`` and ``Process``."""

    def __init__(self) -> None:
        if _preload is None:
            preload(())
        self._ctx = mp.get_context("forkserver")

    def Queue(self):  # noqa: N802 - multiprocessing's name
        return self._ctx.Queue()

    def Process(self, target: Callable[..., Any], args: tuple = (), daemon: bool | None = None):  # noqa: N802
        return self._ctx.Process(target=_with_env, args=(dict(os.environ), target, args), daemon=daemon)


def _with_env(env: dict[str, str], target: Callable[..., Any], args: tuple) -> None:
    os.environ.clear()
    os.environ.update(env)
    target(*args)
