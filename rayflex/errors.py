"""One error hierarchy for everything rayflex raises on purpose.

Errors that cross Ray (a worker's failure reaching the driver) keep their type because
they are plain picklable exceptions carrying only strings and ints.
"""

from __future__ import annotations


class RayflexError(Exception):
    """Base class of every error rayflex raises on purpose."""


class ConfigError(RayflexError, ValueError):
    """A config value is invalid. Raised before any actor starts.

    The message names the field (``ScalingConfig.num_workers``) and says how to fix it.
    """

    def __init__(self, field: str, problem: str, fix: str):
        self.field = field
        self.problem = problem
        self.fix = fix
        super().__init__(f"{field}: {problem}. Fix: {fix}")

    def __reduce__(self):
        return (type(self), (self.field, self.problem, self.fix))


class SetupFailed(RayflexError):
    """Workers of a new attempt died, or did not answer in time, while it started (their
    node went mid-restart: a spot node preempted, a frozen node declared dead by Ray).
    The controller treats it as a failure of the attempt, not of the run."""

    def __init__(self, phase: str, dead: dict, slow: list, timeout_s: float, frozen: bool = False):
        """``slow``: ranks that did not finish the phase within ``timeout_s`` — or, with
        ``frozen``, that stopped answering liveness pings for ``timeout_s`` (the heartbeat
        timeout) while the others waited."""
        self.phase, self.dead, self.slow, self.timeout_s, self.frozen = phase, dict(dead), list(slow), timeout_s, frozen
        parts = [f"rank {r} died ({e})" for r, e in sorted(self.dead.items())]
        if self.slow:
            which = f"rank{'s' if len(self.slow) > 1 else ''} {', '.join(map(str, self.slow))}"
            parts.append(f"{which} stopped answering for {timeout_s:.0f}s (frozen?)" if frozen
                         else f"{which} did not answer within {timeout_s:.0f}s")
        super().__init__(f"while the attempt started ({phase}): {'; '.join(parts)}")

    def __reduce__(self):
        return (type(self), (self.phase, self.dead, self.slow, self.timeout_s, self.frozen))


class PlacementError(RayflexError):
    """The cluster cannot host the requested workers; the message names what is missing."""


class StorageError(RayflexError):
    """Object storage is unreachable, refuses the credentials, or lacks the bucket."""


class CheckpointError(RayflexError):
    """A checkpoint is missing, uncommitted or corrupt."""


class WorkerError(RayflexError):
    """A training worker raised. Carries the rank, node, step and the worker's traceback."""

    def __init__(self, rank: int, node_id: str, step: int, traceback: str):
        self.rank = rank
        self.node_id = node_id
        self.step = step
        self.traceback = traceback
        super().__init__(
            f"worker rank {rank} on node {node_id[:12] or '(unknown)'} failed at step {step}:\n{traceback}"
        )

    def __reduce__(self):
        return (type(self), (self.rank, self.node_id, self.step, self.traceback))


class RunFailed(RayflexError):
    """The run ended in FAILED; ``reason`` says why, ``cause`` is the underlying error text."""

    def __init__(self, name: str, reason: str):
        self.name = name
        self.reason = reason
        super().__init__(f"run {name!r} failed: {reason}")

    def __reduce__(self):
        return (type(self), (self.name, self.reason))
