"""Timing knobs, overridable through ``RAYFLEX_*`` environment variables.

Tests shrink them (e.g. ``RAYFLEX_POLL_INTERVAL_S=0.05``); production keeps the defaults.
Read through functions, not module constants, so a test can change the environment after
import and the controller (which may run in another process) sees the value it was given.
"""

from __future__ import annotations

import os

_DEFAULTS: dict[str, float] = {
    # How often the controller polls every worker.
    "POLL_INTERVAL_S": 0.2,
    # A worker whose poll() has not answered for this long counts as unresponsive.
    "POLL_TIMEOUT_S": 10.0,
    # Heartbeat age after which a live actor counts as stuck.
    "HEARTBEAT_TIMEOUT_S": 30.0,
    # Floor of the hang timeout; the effective one is max(floor, k x median step time).
    "HANG_TIMEOUT_FLOOR_S": 60.0,
    "HANG_TIMEOUT_STEP_MULTIPLE": 10.0,
    # Timeout of every torch.distributed collective (gloo/nccl process group).
    "COLLECTIVE_TIMEOUT_S": 300.0,
    # Waiting for placement groups to be scheduled.
    "PLACEMENT_TIMEOUT_S": 60.0,
    # How long survivors of a fault get to leave the failed attempt before being killed.
    "RELEASE_TIMEOUT_S": 6.0,
    # Once the ranks that could leave have left, how much longer the others get: a rank
    # blocked on a peer that left is unblocked when that peer's sockets close (well under a
    # second); one still blocked after this waits on a frozen or dead process.
    "RELEASE_SETTLE_S": 1.5,
    # A run-directory write still unfinished after this long counts as the store being
    # unavailable (a storage_unavailable event; the lines stay in memory).
    "STORAGE_STALL_S": 5.0,
    # At the end of a run, how long to keep retrying to store the run directory (metrics,
    # events, result) while the object store is unreachable.
    "STORAGE_FINAL_WAIT_S": 120.0,
    # Emergency-checkpoint duration assumed before the run has measured one.
    "EMERGENCY_CHECKPOINT_DEFAULT_S": 10.0,
    # CPU niceness of the checkpoint upload thread (0 = as training): uploads take the
    # cycles training leaves idle.
    "UPLOAD_NICE": 10.0,
    # Worker setup (rendezvous, model build, checkpoint load).
    "SETUP_TIMEOUT_S": 300.0,
    # How long a worker started ahead of a growth restart may take to come up before the
    # growth is put off (and retried at the next capacity check).
    "WORKER_START_TIMEOUT_S": 180.0,
}


def knob(name: str) -> float:
    """Return the value of timing knob ``name`` (``RAYFLEX_<name>`` overrides the default)."""
    if name not in _DEFAULTS:
        raise KeyError(f"unknown rayflex knob {name!r}; known: {sorted(_DEFAULTS)}")
    raw = os.environ.get(f"RAYFLEX_{name}")
    if raw is None:
        return _DEFAULTS[name]
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"RAYFLEX_{name}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"RAYFLEX_{name}={raw!r} must be > 0")
    return value


def knob_env() -> dict[str, str]:
    """The RAYFLEX_* variables set in this process, to hand to the actors it creates."""
    return {k: v for k, v in os.environ.items() if k.startswith("RAYFLEX_")}


def adopt_knobs(knobs: dict[str, str] | None) -> None:
    """Install the creator's RAYFLEX_* values in this (actor) process.

    Passed as a constructor argument rather than a Ray ``runtime_env``: an actor with a
    runtime_env of its own cannot use Ray's prestarted worker processes, which costs
    seconds per worker at every (re)start.
    """
    for k, v in (knobs or {}).items():
        if k.startswith("RAYFLEX_"):
            os.environ[k] = v


# The run's Controller actor: named after the run so other processes (``rayflex status``,
# a signal handler) can find it.
CONTROLLER_NAMESPACE = "rayflex"


def controller_name(run_name: str) -> str:
    return f"rayflex-controller:{run_name}"
