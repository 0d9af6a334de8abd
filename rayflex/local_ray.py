"""Ray on this machine: the embedded local Ray and loopback clusters, on safe ports.

Ray gives some of its components fixed default ports (the GCS of ``ray start`` 6379, the
dashboard 8265, the dashboard agent's HTTP server 52365, Ray Client 10001) and the others
random ones. A random choice may land on a fixed default, and then Ray refuses to start:
a ``ray.cluster_utils.Cluster`` head whose GCS drew 52365 fails with "Ray component
dashboard_agent_http is trying to use a port number 52365 that is used by other
components". So every Ray that rayflex, its tests, benchmarks and chaos harness start
gets each of those ports explicitly, from distinct ports that are free on loopback and
none of Ray's defaults.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import socket
from typing import Iterator, Optional

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


# Ray's housekeeping that nothing of a Ray started here reads, made rarer. The daemons and
# workers inherit these from the process that starts them; a value already set wins. An
# idle 2-node loopback cluster with 4 idle actors spent 0.078 CPU-s/s with Ray's defaults and
# 0.054 with these (its start: 8.6 -> 5.7 CPU-s), which a training step on a small host keeps:
# * the per-task timeline sent to the GCS every 1 s (the state API's task list, which rayflex
#   does not use; actors are listed from the GCS's actor table either way): every 10 s;
# * the node stats the dashboard agent gathers with psutil every 5 s (a dashboard's graphs;
#   these Rays start none): every 60 s;
# * the timing of every event-loop handler, kept for Ray's debug dumps: off;
# * the log monitor's search for new log files (every 0.1 s below 1,000 files: a glob of the
#   log directory that grows with every worker a long-lived cluster started): every 1 s. A
#   new worker's output reaches the driver up to 1 s later, none of it lost (a file found is
#   read from its start). With 235 files: 0.026 -> 0.011 CPU-s/s.
# Metrics (rayflex exports run metrics through Ray's) and the memory monitor (Ray's OOM
# killer) keep their defaults.
LEAN_RAY_ENV = {"RAY_task_events_report_interval_ms": "10000",
                "REPORTER_UPDATE_INTERVAL_MS": "60000",
                "RAY_event_stats": "0",
                "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
                "LOG_NAME_UPDATE_INTERVAL_S": "1"}


def _prepare_env() -> None:
    """Keep every Ray process on 127.0.0.1 (without this, Ray 2.60 may advertise the
    host's routable address, and nodes then fail to reach the GCS), with LEAN_RAY_ENV."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    for key, value in LEAN_RAY_ENV.items():
        os.environ.setdefault(key, value)

# Ports Ray components take when not told otherwise (ray_constants: GCS, dashboard,
# dashboard agent; `ray start`: Ray Client). A port chosen here is never one of them.
RAY_DEFAULT_PORTS = frozenset({6379, 8265, 10001, 52365})


# Ray workers take ports 10002-19999 (its min/max_worker_port defaults).
_RAY_WORKER_PORTS_END = 20000


def _unassigned_port_range() -> Optional[range]:
    """Ports neither Ray's workers nor the kernel take on their own: from the end of Ray's
    worker ports to the start of the kernel's ephemeral range (what ``bind(("", 0))`` and
    every outbound ``connect`` draw from). None where that gap is too small to draw from."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return range(_RAY_WORKER_PORTS_END, ephemeral_low) if ephemeral_low - _RAY_WORKER_PORTS_END >= 1000 else None


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on loopback now, none of them a Ray default.

    A port is free only until someone binds it, and the caller binds it later (often in
    another process). A port the kernel chose (``bind`` to port 0) lies in its ephemeral
    range, which it keeps handing out to other processes' listeners and outbound
    connections in the meantime: CI once lost a rendezvous that way (``EADDRINUSE`` on a
    port free a moment before). So ports are drawn at random below that range, where only
    another explicit choice can take them; the kernel's choice is the fallback where the
    range leaves no room. All sockets stay bound until every port is chosen, so the ``n``
    differ.
    """
    draw = _unassigned_port_range()
    rng = random.SystemRandom()  # per call from the OS: forked children do not draw alike
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        for _ in range(64 * n):
            if len(ports) == n:
                break
            port = rng.choice(draw) if draw is not None else 0
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((LOOPBACK, port))
            except OSError:  # taken: draw again
                s.close()
                continue
            held.append(s)
            port = s.getsockname()[1]
            if port not in RAY_DEFAULT_PORTS:
                ports.append(port)
        if len(ports) < n:
            raise RuntimeError(f"found {len(ports)} of {n} free loopback ports in {64 * n} tries")
        return ports
    finally:
        for s in held:
            s.close()


def head_node_args(num_cpus: float, **extra) -> dict:
    """Arguments of a ``ray.cluster_utils.Cluster`` head on loopback with every port
    that has a fixed default chosen explicitly (no dashboard: tests do not need one).
    Worker nodes need nothing of the kind: ``Cluster.add_node`` gives them random agent
    ports, and their other ports are random too."""
    _prepare_env()
    gcs, agent = free_ports(2)
    args = {"node_ip_address": LOOPBACK, "num_cpus": num_cpus, "include_dashboard": False,
            "gcs_server_port": gcs, "dashboard_agent_listen_port": agent}
    args.update(extra)
    return args


def init_local(num_cpus: int, *, log_to_driver: bool = True) -> None:
    """Start the embedded single-node Ray on loopback (no dashboard). ``ray.init`` has no
    argument for the GCS port; Ray reads it from ``RAY_GCS_SERVER_PORT``, set here for
    the call so the GCS cannot draw the dashboard agent's fixed port."""
    import ray

    _prepare_env()
    key = "RAY_GCS_SERVER_PORT"
    old = os.environ.get(key)
    os.environ[key] = str(free_ports(1)[0])
    try:
        ray.init(address="local", num_cpus=num_cpus, _node_ip_address=LOOPBACK, include_dashboard=False,
                 log_to_driver=log_to_driver)
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


@contextlib.contextmanager
def loopback_cluster(nodes: list[dict], connect: bool = True) -> Iterator:
    """A ``ray.cluster_utils.Cluster`` of several "nodes" on loopback, connected (unless
    ``connect=False``), always torn down. ``nodes``: one dict per node (``num_cpus``,
    optional ``labels``/``resources``/...); the first is the head."""
    _prepare_env()  # before Ray is imported: it reads the loopback switch then
    import ray
    from ray.cluster_utils import Cluster

    cluster: Optional[Cluster] = None
    try:
        head = dict(nodes[0])
        cluster = Cluster(initialize_head=True, head_node_args=head_node_args(head.pop("num_cpus", 1), **head))
        for spec in nodes[1:]:
            cluster.add_node(**{"node_ip_address": LOOPBACK, **spec})
        cluster.wait_for_nodes()
        if connect:
            ray.init(address=cluster.address)
        yield cluster
    finally:
        shut_down(cluster)


def shut_down(cluster) -> None:
    """Disconnect this process from Ray and stop ``cluster`` (a ``Cluster`` or None),
    whatever state either is in: teardown must not raise over the error that caused it."""
    import ray

    with contextlib.suppress(Exception):
        ray.shutdown()
    if cluster is not None:
        with contextlib.suppress(Exception):
            cluster.shutdown()


def _running_cluster_address() -> Optional[str]:
    """The address of a cluster started on this machine with ``ray start`` and still alive.

    Ray's own ``address="auto"`` connects to *any* GCS process it finds (another user's
    test cluster, a stale one); rayflex only joins the one named in Ray's bootstrap file,
    and only if a live GCS process actually serves it.
    """
    try:
        from ray._private import services

        bootstrap = services.find_bootstrap_address(None)
        if bootstrap and bootstrap in set(services.find_gcs_addresses()):
            return bootstrap
    except Exception:  # noqa: BLE001 - private API moved: fall back to a fresh local Ray
        log.debug("could not look for a running Ray cluster", exc_info=True)
    return None


def ensure_ray(min_cpus: float = 0, *, connect_only: bool = False) -> None:
    """Connect to RAY_ADDRESS or this machine's running cluster, else start a local Ray
    (unless ``connect_only``, where no cluster raises ConnectionError)."""
    import ray

    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS") or _running_cluster_address()
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    if connect_only:
        raise ConnectionError("no running Ray cluster on this machine and RAY_ADDRESS is not set")
    # The embedded default: a single-node Ray on loopback with at least one logical CPU
    # per worker (workers mostly wait on collectives; OMP threads are pinned to 1).
    init_local(max(os.cpu_count() or 1, int(min_cpus + 0.999)))
