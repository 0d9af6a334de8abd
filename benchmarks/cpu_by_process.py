"""Where a run's CPU goes, by process role and by thread, while it trains.

    python benchmarks/cpu_by_process.py [--interval 0.5] [--out FILE] -- COMMAND [ARG...]

Runs COMMAND and samples the CPU time (utime + stime, from /proc) of every process it
starts — the driver, Ray's daemons, the controller and worker actors, torchrun's agent and
ranks — and of each of their threads. Processes are grouped by role from their command line
(``ray::TrainWorker``, ``raylet``, ``gcs_server``, ``dashboard agent``, ...), threads by name.
The figures are rates (CPU-s per wall second) over the *training window*: the sampling
intervals in which the training processes (``ray::TrainWorker`` actors, or torchrun's
ranks) are busy — at least half their peak rate — so start-up and tear-down do not count.
On a saturated host every CPU-s/s spent outside the training processes in that window is
taken from the step. Prints one JSON object (stdout, and ``--out``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(__file__))
from common import emit  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
# (substring of the command line, role), first match wins.
ROLES = (("ray::TrainWorker", "train_worker"), ("compare_torchrun_worker", "train_worker"),
         ("ray::Controller", "controller"), ("ray::rayflex-controller", "controller"),
         ("ray::DashboardAgent", "dashboard_agent"), ("ray::RuntimeEnvAgent", "runtime_env_agent"),
         ("ray::IDLE", "ray_idle_worker"), ("ray::", "other_actor"), ("raylet", "raylet"), ("gcs_server", "gcs_server"),
         ("dashboard/agent.py", "dashboard_agent"), ("runtime_env/agent", "runtime_env_agent"),
         ("dashboard/dashboard.py", "dashboard"), ("log_monitor", "log_monitor"), ("monitor.py", "autoscaler_monitor"),
         ("torch.distributed.run", "torchrun_agent"), ("ThreadedMotoServer", "s3_endpoint"))
TRAINING = {"train_worker"}


MARK = "CPU_BY_PROCESS_RUN"  # set in the command's environment: every process it starts inherits it


def _marked(token: str, known: dict[int, bool]) -> list[int]:
    """The live processes whose environment carries ``MARK=token``: Ray's daemons and
    workers are not all descendants of the command (some are re-parented), but they all
    inherit its environment."""
    needle = f"{MARK}={token}".encode() + b"\0"
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        if pid not in known:
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    known[pid] = needle in f.read()
            except OSError:
                known[pid] = False
        if known[pid]:
            out.append(pid)
    return out


def _cpu_s(path: str) -> float:
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def _role(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "gone"
    for needle, role in ROLES:
        if needle in cmd:
            return role
    return "driver" if "python" in cmd else os.path.basename(cmd.split(" ", 1)[0]) or "other"


def _sample(token: str, known: dict[int, bool], roles: dict[int, str]) -> dict:
    """CPU seconds so far of each (pid, role) and each (role, thread name)."""
    procs, threads = {}, {}
    for pid in _marked(token, known):
        if roles.get(pid) not in TRAINING:  # a Ray worker is ray::IDLE until it hosts an actor
            roles[pid] = _role(pid)
        try:
            procs[pid] = _cpu_s(f"/proc/{pid}/stat")
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    name = f.read().strip()
                threads[(pid, int(tid), name)] = _cpu_s(f"/proc/{pid}/task/{tid}/stat")
        except (OSError, IndexError, ValueError):
            continue
    return {"t": time.monotonic(), "procs": procs, "threads": threads}


def _rates(a: dict, b: dict, roles: dict[int, str]) -> tuple[dict, dict]:
    dt = b["t"] - a["t"]
    by_role, by_thread = defaultdict(float), defaultdict(float)
    for pid, cpu in b["procs"].items():
        by_role[roles.get(pid, "other")] += (cpu - a["procs"].get(pid, 0.0)) / dt
    for key, cpu in b["threads"].items():
        pid, _, name = key
        by_thread[f"{roles.get(pid, 'other')}/{name}"] += (cpu - a["threads"].get(key, 0.0)) / dt
    return by_role, by_thread


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--interval", type=float, default=0.5)
    ap.add_argument("--out")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give the command to run after --")
    token = f"{os.getpid()}-{time.time_ns()}"
    proc = subprocess.Popen(command, stdout=sys.stderr, env={**os.environ, MARK: token})
    roles: dict[int, str] = {}
    known: dict[int, bool] = {}
    samples = [_sample(token, known, roles)]
    while proc.poll() is None:
        time.sleep(args.interval)
        samples.append(_sample(token, known, roles))
    intervals = [_rates(a, b, roles) for a, b in zip(samples, samples[1:])]
    busy = [sum(r for role, r in by_role.items() if role in TRAINING) for by_role, _ in intervals]
    peak = max(busy, default=0.0)
    window = [iv for iv, b in zip(intervals, busy) if peak > 0 and b >= 0.5 * peak]
    roles_out, threads_out = defaultdict(list), defaultdict(list)
    for by_role, by_thread in window:
        for role in set(roles.values()) | set(by_role):
            roles_out[role].append(by_role.get(role, 0.0))
        for name, r in by_thread.items():
            threads_out[name].append(r)
    n = max(len(window), 1)
    mean = {k: sum(v) / n for k, v in roles_out.items()}
    total = sum(mean.values())
    emit({"command": command, "exit_code": proc.returncode, "interval_s": args.interval,
          "training_window_s": round(len(window) * args.interval, 1),
          "cpu_s_per_s_in_window": {k: round(v, 3) for k, v in sorted(mean.items(), key=lambda kv: -kv[1]) if v > 0.001},
          "share_outside_training": round(1 - sum(mean.get(r, 0) for r in TRAINING) / total, 3) if total else None,
          "median_interval_rate_by_role": {k: round(statistics.median(v), 3) for k, v in roles_out.items()
                                           if statistics.median(v) > 0.001},
          "top_threads": {k: round(sum(v) / n, 3) for k, v in sorted(threads_out.items(), key=lambda kv: -sum(kv[1]))[:25]}},
         args.out)
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
