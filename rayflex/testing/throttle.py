"""A slow node on one machine: processes held to a fraction of a core by a CPU quota.

A cgroup-v1 ``cpu`` group of its own, created inside the group the first process is in
already (so a quota around the whole suite, ``make test-slow-host``, still holds), with
``cfs_quota_us`` set to the fraction; the processes are moved in, and back out when the
context ends, even on failure, and the group is removed. Needs root and the v1 ``cpu``
controller; :func:`throttle_problem` says why not, for a test to skip with.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from typing import Iterator, Optional, Sequence

ROOT = "/sys/fs/cgroup/cpu"
# The quota's period: short beside a step, so the process is slow evenly, like a slow node,
# not in bursts. At 100 ms (the kernel's default) a tenth of a core ran 10 ms and stopped
# for 90, inside a 0.2-0.4 s step: the stop often fell into the slow rank's own wait for
# its peers, so only 86% of its steps showed it the last to arrive, beside the straggler
# detector's 80% (CI failed once so); at 10 ms, 100% (31 of 31 steps).
PERIOD_US = 10_000


def throttle_problem() -> Optional[str]:
    """Why processes cannot be throttled here (None: they can)."""
    if os.geteuid() != 0:
        return "needs root (a cgroup of its own)"
    if not os.path.exists(f"{ROOT}/cgroup.procs"):
        return f"no cgroup-v1 cpu controller at {ROOT}"
    return None


def _group_of(pid: int) -> str:
    """The ``cpu`` cgroup ``pid`` is in, as a directory under ROOT."""
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if "cpu" in controllers.split(","):
                return ROOT + path.rstrip("/") if path != "/" else ROOT
    return ROOT


def _move(pid: int, group: str) -> None:
    try:
        with open(f"{group}/cgroup.procs", "w") as f:
            f.write(str(pid))
    except ProcessLookupError:  # gone meanwhile (a killed worker): nothing to move
        pass
    except OSError as e:
        if e.errno != errno.ESRCH:
            raise


@contextlib.contextmanager
def cpu_throttled(pids: Sequence[int], cores: float, name: str = "rayflex_throttle") -> Iterator[str]:
    """``pids`` together get ``cores`` of one core (e.g. 0.2) until the block ends."""
    problem = throttle_problem()
    if problem:
        raise RuntimeError(f"cannot throttle processes here: {problem}")
    if not pids or cores <= 0:
        raise ValueError(f"need processes and a positive share of a core, got {list(pids)} and {cores}")
    parents = {pid: _group_of(pid) for pid in pids}
    group = f"{parents[pids[0]]}/{name}_{os.getpid()}_{pids[0]}"
    os.mkdir(group)
    try:
        with open(f"{group}/cpu.cfs_period_us", "w") as f:
            f.write(str(PERIOD_US))
        with open(f"{group}/cpu.cfs_quota_us", "w") as f:
            f.write(str(max(1000, int(cores * PERIOD_US))))
        for pid in pids:
            _move(pid, group)
        yield group
    finally:
        for pid, parent in parents.items():
            _move(pid, parent)
        _remove(group, parents[pids[0]])


def _remove(group: str, parent: str, timeout_s: float = 30.0) -> None:
    """Remove ``group``, moving out anything still in it (a child started inside); a process
    that was killed stays in it until its parent reaps it, so wait for that (EBUSY)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with open(f"{group}/cgroup.procs") as f:
            for line in f:
                if line.strip():
                    _move(int(line), parent)
        try:
            os.rmdir(group)
            return
        except OSError as e:
            if e.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
        time.sleep(0.1)


def node_processes(cluster, node_id: str) -> list[int]:
    """Every process of one node of a ``ray.cluster_utils.Cluster``: its raylet and what
    the raylet started (workers, agents). Throttled together they make a slow machine:
    processes the raylet starts later (a task's new worker) are inside the quota too."""
    import psutil

    node = next(n for n in cluster.list_all_nodes() if n.node_id == node_id)
    from ray._private import ray_constants

    raylet = node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
    return [raylet] + [p.pid for p in psutil.Process(raylet).children(recursive=True)]
