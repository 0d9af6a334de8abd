"""Timing knobs (and retry counts), overridable through ``RAYFLEX_*`` environment variables.

Tests shrink them (e.g. ``RAYFLEX_POLL_INTERVAL_S=0.05``); production keeps the defaults.
Read through functions, not module constants, so a test can change the environment after
import and the controller (which may run in another process) sees the value it was given.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

@dataclass(frozen=True)
class Knob:
    """One knob's default and what a value must be: each constraint is declared here, once,
    and :func:`knob`, :func:`count_knob` and :func:`check_knobs` read it. ``minimum`` is
    exclusive at 0 for durations (``None``: > 0), inclusive otherwise; ``kind=int`` knobs count
    something (attempts, steps) and take whole numbers."""

    default: float
    minimum: Optional[float] = None
    maximum: Optional[float] = None
    kind: type = float

    def parse(self, var: str, raw: str) -> float:
        """``raw`` (the variable's text) as this knob's value; ValueError naming ``var`` and
        what it must be otherwise."""
        try:
            value = self.kind(raw)
        except ValueError:
            what = "a whole number" if self.kind is int else "a number"
            raise ValueError(f"{var}={raw!r} is not {what}") from None
        if not self.accepts(value):
            raise ValueError(f"{var}={raw!r} must be {self.bounds()}")
        return value

    def accepts(self, value: float) -> bool:
        low = value > 0 if self.minimum is None else value >= self.minimum
        return low and (self.maximum is None or value <= self.maximum)

    def bounds(self) -> str:
        low = "> 0" if self.minimum is None else f">= {self.minimum:g}"
        return low if self.maximum is None else f"{low} and <= {self.maximum:g}"

    def describe(self) -> str:
        """What to set, as a fix: ``a whole number >= 1``."""
        return f"{'a whole number' if self.kind is int else 'a number'} {self.bounds()}"


_KNOBS: dict[str, Knob] = {
    # How often the controller polls every worker: how soon a dead rank is named, and what
    # the controller and each rank spend on polls beside training (at 0.2 s: 20 calls a
    # second for 4 ranks, the controller's largest cost, ~2% of a saturated core).
    "POLL_INTERVAL_S": Knob(0.5),
    # Heartbeat age after which a live actor counts as stuck.
    "HEARTBEAT_TIMEOUT_S": Knob(30.0),
    # Floor of the hang timeout; the effective one is max(floor, k x median step time).
    "HANG_TIMEOUT_FLOOR_S": Knob(60.0),
    "HANG_TIMEOUT_STEP_MULTIPLE": Knob(10.0),
    # Until an attempt has finished a step the hang timeout is this many floors: the first
    # step does the attempt's one-off work (FSDP's lazy init, first allocations, compile),
    # which nothing has measured yet and which takes 3-4x longer on a slow host.
    "HANG_TIMEOUT_WARMUP_FLOORS": Knob(3.0),
    # How long a hang investigation waits for the ranks' flight records (a frozen rank
    # never answers; the others answer in milliseconds).
    "DIAGNOSIS_TIMEOUT_S": Knob(3.0),
    # Timeout of every torch.distributed collective (gloo/nccl process group).
    "COLLECTIVE_TIMEOUT_S": Knob(300.0),
    # Waiting for placement groups to be scheduled.
    "PLACEMENT_TIMEOUT_S": Knob(60.0),
    # How long survivors of a fault get to leave the failed attempt before being killed.
    "RELEASE_TIMEOUT_S": Knob(6.0),
    # Once the ranks that could leave have left, how much longer the others get: a rank
    # blocked on a peer that left is unblocked when that peer's sockets close (well under a
    # second); one still blocked after this waits on a frozen or dead process.
    "RELEASE_SETTLE_S": Knob(1.5),
    # A run-directory write still unfinished after this long counts as the store being
    # unavailable (a storage_unavailable event; the lines stay in memory).
    "STORAGE_STALL_S": Knob(5.0),
    # At the end of a run, how long to keep retrying to store the run directory (metrics,
    # events, result) while the object store is unreachable, and the pause between tries.
    "STORAGE_FINAL_WAIT_S": Knob(120.0),
    "STORAGE_FINAL_RETRY_INTERVAL_S": Knob(2.0),
    # The S3 client's timeouts: long enough for a busy store, short enough that a dead
    # endpoint surfaces as an error instead of a silent hang of a checkpoint upload; and
    # botocore's attempts per request.
    "STORAGE_CONNECT_TIMEOUT_S": Knob(10.0),
    "STORAGE_READ_TIMEOUT_S": Knob(60.0),
    "STORAGE_REQUEST_ATTEMPTS": Knob(3, minimum=1, kind=int),
    # The start-up storage probe's S3 client (one attempt: it fails fast).
    "STORAGE_PROBE_CONNECT_TIMEOUT_S": Knob(2.0),
    "STORAGE_PROBE_READ_TIMEOUT_S": Knob(5.0),
    # One logical storage operation (write a file, list a directory): attempts, and the
    # exponential backoff between them (first delay, cap).
    "STORAGE_RETRY_ATTEMPTS": Knob(5, minimum=1, kind=int),
    "STORAGE_RETRY_BASE_DELAY_S": Knob(0.2),
    "STORAGE_RETRY_MAX_DELAY_S": Knob(5.0),
    # How long a step waits for a row group another thread (the prefetcher, possibly of an
    # earlier attempt in a reused process) is reading before it reads the group itself: a
    # read stuck on a dead endpoint must not hold every later step.
    "DATA_PENDING_READ_WAIT_S": Knob(30.0),
    # Emergency-checkpoint duration assumed before the run has measured one.
    "EMERGENCY_CHECKPOINT_DEFAULT_S": Knob(10.0),
    # every_steps="auto": the training time a save is assumed to block before one is measured.
    "CHECKPOINT_COST_PRIOR_S": Knob(5.0),
    # every_steps="auto": the first save (which measures what a save costs) after this many steps.
    "CHECKPOINT_AUTO_FIRST_STEPS": Knob(5, minimum=1, kind=int),
    # Memory replicas (CheckpointConfig.memory_replicas): how long a rank waits for a
    # keeper's answer (an inventory, an emergency save's confirmed replica), and for the
    # byte ranges one restore reads from a keeper, before using storage instead.
    "REPLICA_TIMEOUT_S": Knob(10.0),
    "REPLICA_READ_TIMEOUT_S": Knob(60.0),
    # An emergency save handed to memory replicas: how long the controller waits for the
    # keepers' uploads before giving the step up (the restart then resumes from the last
    # committed one).
    "HANDOFF_UPLOAD_TIMEOUT_S": Knob(900.0),
    # CPU niceness of the checkpoint upload thread while the training loop runs (0 = as
    # training): uploads take the cycles training leaves idle. Saves after the loop (final,
    # stop, emergency) upload at the process's own priority.
    "UPLOAD_NICE": Knob(10, minimum=0, maximum=19, kind=int),
    # On an object store a rank's checkpoint shard is cut into objects of about this many MB,
    # each written in one PUT (checkpoint.dcp_io.CheckpointWriter.write_data).
    "CHECKPOINT_OBJECT_MB": Knob(64, minimum=1, kind=int),
    # Worker setup (rendezvous, model build, checkpoint load).
    "SETUP_TIMEOUT_S": Knob(300.0),
    # How long a worker started ahead of a growth restart may take to come up before the
    # growth is put off (and retried at the next capacity check).
    "WORKER_START_TIMEOUT_S": Knob(180.0),
    # Reserving one more bundle for a standby (short: a standby is an optimization, and
    # the controller's loop waits on this).
    "STANDBY_RESERVE_TIMEOUT_S": Knob(5.0),
    # The controller's cadences while a run trains: refreshing which nodes are alive,
    # reading spot notices, checking whether capacity returned, storing the run directory;
    # and while it waits for resources, how often it looks again.
    "NODES_REFRESH_S": Knob(0.5),
    "NOTICE_POLL_S": Knob(0.5),
    # Activation memory (bytes saved for backward) is measured on the first steps of each
    # attempt and every this many steps after: the autograd hooks cost ~9% of a small
    # model's forward-backward on CPU (benchmarks/compare.py), and the peak repeats
    # (0: the first steps only).
    "ACTIVATION_PROBE_EVERY": Knob(100, minimum=0, kind=int),
    "CAPACITY_CHECK_S": Knob(2.0),
    # How far back the straggler signal looks (faults.detector): a rank is named when it was
    # last in 80% of the steps of this window.
    "STRAGGLER_WINDOW_S": Knob(20.0),
    # A straggler is acted on (rayflex.control.stragglers) only once it has stayed slow this
    # long after it was named (a node slow for a while and then not is named, never
    # evicted), and, while kept, weighed again this often.
    "STRAGGLER_CONFIRM_S": Knob(10.0),
    "STRAGGLER_RECHECK_S": Knob(30.0),
    # A node held out of placement (it failed a health check, or was evicted as a
    # straggler) is checked again this long after (doubling each time it is held out
    # again); a check that has not run this long after it was started fails.
    "HEALTH_RECHECK_S": Knob(30.0),
    "HEALTH_PROBE_TIMEOUT_S": Knob(120.0),
    # On CPUs a round of checks is timed in one window this long after it starts: a check
    # begins in a new worker process (Ray and numpy imported, ~0.5 CPU-s; one that starts
    # later is timed outside the window and runs again: ``control/node_health.py``).
    "HEALTH_PROBE_LEAD_S": Knob(3.0),
    "RUNDIR_FLUSH_S": Knob(1.0),
    "RESOURCE_POLL_S": Knob(1.0),
    # How long survivors of a fault that killed no peer may take to commit a checkpoint
    # they are uploading before they leave the attempt.
    "RELEASE_CHECKPOINT_GRACE_S": Knob(3.0),
    # A single call to an actor (start the loop, arm a fault) that must answer quickly.
    "ACTOR_CALL_TIMEOUT_S": Knob(60.0),
    # A node all of whose ranks stopped answering is asked to run a no-op task; one that
    # does not within this long is left out of placement until it answers or Ray drops it
    # (Ray's own health check takes up to a minute to declare a frozen node dead).
    "NODE_PROBE_TIMEOUT_S": Knob(5.0),
    # After an attempt fails, how long its nodes are watched for Ray declaring one dead (its
    # health check takes up to a minute by default): one that goes in that time is named lost.
    "VANISHED_NODE_WINDOW_S": Knob(120.0),
}


def _raw(name: str) -> Optional[str]:
    if name not in _KNOBS:
        raise KeyError(f"unknown rayflex knob {name!r}; known: {sorted(_KNOBS)}")
    return os.environ.get(f"RAYFLEX_{name}")


def knob(name: str) -> float:
    """Return the value of knob ``name`` (``RAYFLEX_<name>`` overrides the default)."""
    raw = _raw(name)
    spec = _KNOBS[name]
    return spec.default if raw is None else spec.parse(f"RAYFLEX_{name}", raw)


def count_knob(name: str) -> int:
    """Return knob ``name`` that counts something (attempts, steps): a whole number."""
    if _KNOBS[name].kind is not int:
        raise KeyError(f"rayflex knob {name!r} is not a count; read it with knob()")
    return int(knob(name))


# RAYFLEX_* variables that are not knobs: the run report, the demo's and examples' inputs,
# the worker's advertised address, the test suite's CPU record and the fault-injection
# settings below (read where they are used; see each reader).
OTHER_VARIABLES = frozenset({"RUN_REPORT", "DEMO_STORAGE", "DEMO_DATA", "HF_MODEL_DIR", "NODE_IP", "SUITE_CPU",
                             "FAIL_AT", "COLLECTIVE_FAULT", "FAULT_LOG", "SLOW_UPLOAD"})


def check_knobs() -> tuple[list[tuple[str, str, str]], list[str]]:
    """Every ``RAYFLEX_*`` variable set here, checked before anything starts: ``(bad,
    unknown)``. ``bad``: ``(variable, problem, fix)`` per knob whose value its reader would
    refuse (it would otherwise fail only once the workers read it); ``unknown``: a line per
    variable rayflex does not know, with the nearest known name (a misspelled knob is
    otherwise silently ignored)."""
    import difflib

    bad, unknown = [], []
    for var in sorted(v for v in os.environ if v.startswith("RAYFLEX_")):
        name = var[len("RAYFLEX_"):]
        if name in _KNOBS:
            spec = _KNOBS[name]
            try:
                spec.parse(var, os.environ[var])
            except ValueError as e:
                bad.append((var, str(e)[len(var) + 1:],  # parse() says "RAYFLEX_X='v' must be ..."
                            f"set {spec.describe()} (the default is {spec.default:g}), or unset it"))
        elif name not in OTHER_VARIABLES:
            near = difflib.get_close_matches(name, [*_KNOBS, *OTHER_VARIABLES], n=1, cutoff=0.6)
            hint = f"did you mean RAYFLEX_{near[0]}?" if near else "the knobs are listed in rayflex/constants.py"
            unknown.append(f"{var} is not a rayflex setting and is ignored; {hint}")
    return bad, unknown


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


# ------------------------------------------------------------------ test-only settings
# Fault injection and test harness settings, also RAYFLEX_* variables so that actors get
# them through knob_env(); none is set in production.


@dataclass(frozen=True)
class SlowUpload:
    """``RAYFLEX_SLOW_UPLOAD="FROM_STEP:SECONDS[:TO_STEP]"``: delay every checkpoint upload
    from ``from_step`` on (up to ``to_step`` inclusive when given) by ``seconds``."""

    from_step: int
    seconds: float
    to_step: Optional[int] = None

    def applies_to(self, step: int) -> bool:
        return step >= self.from_step and (self.to_step is None or step <= self.to_step)


def slow_upload() -> Optional[SlowUpload]:
    """The slow-upload fault asked for in ``RAYFLEX_SLOW_UPLOAD``, or None."""
    raw = os.environ.get("RAYFLEX_SLOW_UPLOAD")
    if not raw:
        return None
    from_step, seconds, *to_step = raw.split(":")
    return SlowUpload(int(from_step), float(seconds), int(to_step[0]) if to_step else None)


def node_ip() -> Optional[str]:
    """``RAYFLEX_NODE_IP``: the address a worker advertises for rendezvous, when set."""
    return os.environ.get("RAYFLEX_NODE_IP")


def injected_failure_steps() -> dict[int, int]:
    """``RAYFLEX_FAIL_AT="RANK:STEP[,RANK:STEP...]"`` (tests): rank -> the step it raises at."""
    out: dict[int, int] = {}
    for item in filter(None, os.environ.get("RAYFLEX_FAIL_AT", "").split(",")):
        rank, _, step = item.partition(":")
        out.setdefault(int(rank), int(step))
    return out


def fault_log_path() -> Optional[str]:
    """``RAYFLEX_FAULT_LOG``: where a worker appends each injected failure it raised (chaos runs)."""
    return os.environ.get("RAYFLEX_FAULT_LOG") or None


def default_storage() -> str:
    """``RAYFLEX_DEMO_STORAGE``: where run directories go when no storage is named (the
    example and ``rayflex report NAME``), else ``./runs``."""
    return os.environ.get("RAYFLEX_DEMO_STORAGE") or "file://" + os.path.abspath("runs")


def set_node_ip(ip: str) -> None:
    """Make this process's workers advertise ``ip`` (local processes without Ray)."""
    os.environ["RAYFLEX_NODE_IP"] = ip


# Row groups the sampler shuffles together (DataConfig.shuffle_window, rayflex.data.sampler).
DEFAULT_SHUFFLE_WINDOW = 16

# The run's Controller actor: named after the run so other processes (``rayflex status``,
# a signal handler) can find it.
CONTROLLER_NAMESPACE = "rayflex"


def controller_name(run_name: str) -> str:
    return f"rayflex-controller:{run_name}"
