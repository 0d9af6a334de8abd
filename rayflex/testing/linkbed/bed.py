"""A Ray cluster of emulated nodes inside this process's private network namespace.

Each node of the topology becomes a ``ray.cluster_utils.Cluster`` node on its own loopback
address (``links.node_address``), with the topology's labels, so the planner sees the same
racks and zones; the loopback device is shaped by ``links.tc_commands``. Every process of a
node runs with the connect shim preloaded (``bindshim.c``) and the node's address in
``LINKBED_NODE_IP``: its connections leave from its address and its host name is its
address, which is what tc and gloo need to tell the nodes apart.

``LinkBed`` assumes the namespace is private (``__main__`` makes one with ``unshare -n``);
everything it starts is torn down by ``stop``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional
from unittest import mock

from rayflex.errors import ConfigError
from rayflex.planning.topology import Topology
from rayflex.testing.linkbed.links import LinkPlan, bytes_by_link, plan_links, tc_change_commands, tc_commands

SHIM_SOURCE = Path(__file__).with_name("bindshim.c")
# Not a RAYFLEX_* name: those are knobs the driver hands to every actor it creates, and a
# worker on another node must keep its own node's address.
IP_VAR = "LINKBED_NODE_IP"


def build_shim(cache_dir: Optional[str] = None) -> str:
    """Compile the connect shim (once per source version) and return the library's path."""
    source = SHIM_SOURCE.read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:16]
    out = Path(cache_dir or Path(tempfile.gettempdir()) / "rayflex-linkbed") / f"bindshim-{digest}.so"
    if out.exists():
        return str(out)
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise ConfigError("linkbed", "no C compiler to build the bed's 2 kB connect shim",
                          "install one (Debian: apt install gcc) or run the bed where one exists")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(f".{os.getpid()}.tmp")
    subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(partial), str(SHIM_SOURCE), "-ldl"],
                   check=True, capture_output=True)
    os.replace(partial, out)
    return str(out)


def netns_inode(pid: str = "self") -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def processes_in_netns(inode: int) -> list[int]:
    """PIDs of the processes in the network namespace ``inode``, this one aside."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            with contextlib.suppress(OSError):
                if netns_inode(entry) == inode:
                    found.append(int(entry))
    return found


def kill_netns(inode: int) -> int:
    """SIGKILL every process left in the bed's namespace (all of them the bed's); how many."""
    pids = processes_in_netns(inode)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return len(pids)


def node_env(ip: str, shim: str):
    """This process's environment as a node's processes must inherit it, for a ``with``."""
    # Ray refuses several node addresses on one machine unless told
    return mock.patch.dict(os.environ, {IP_VAR: ip, "LD_PRELOAD": shim, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"})


class LinkBed:
    """The emulated cluster of ``topology`` shaped as ``plan`` says, started by ``start``."""

    def __init__(self, topology: Topology, plan: LinkPlan, shim: str, *, cpus_per_slot: float = 1.0,
                 system_config: Optional[dict] = None):
        self.topology = topology
        self.plan = plan
        self.shim = shim
        self.cpus_per_slot = cpus_per_slot
        self.system_config = system_config or {}
        self.cluster = None
        self._ray_nodes: dict[str, object] = {}

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> "LinkBed":
        from ray.cluster_utils import Cluster

        from rayflex.local_ray import head_node_args

        _run_all(tc_commands(self.plan))
        first, *rest = self.topology.nodes
        with node_env(self.plan.addresses[first.node_id], self.shim):
            head = head_node_args(first.slots * self.cpus_per_slot, node_ip_address=self.plan.addresses[first.node_id],
                                  labels=dict(first.labels), _system_config=self.system_config)
            self.cluster = Cluster(initialize_head=True, head_node_args=head)
        self._ray_nodes[first.node_id] = self.cluster.head_node
        for node in rest:
            self.add_node(node.node_id, wait=False)
        self.cluster.wait_for_nodes()
        return self

    def add_node(self, node_id: str, *, wait: bool = True):
        """Start the topology's node ``node_id`` (again, after ``remove_node``)."""
        node = self.topology.node(node_id)
        ip = self.plan.addresses[node_id]
        with node_env(ip, self.shim):
            self._ray_nodes[node_id] = self.cluster.add_node(node_ip_address=ip, num_cpus=node.slots * self.cpus_per_slot,
                                                             labels=dict(node.labels))
        if wait:
            self.cluster.wait_for_nodes()
        return self._ray_nodes[node_id]

    def rescale(self, scale: float) -> LinkPlan:
        """Every link at ``scale`` from now on (1.0: the topology's own speeds, which this
        machine's loopback cannot reach: effectively unshaped); the plan in force before."""
        before, self.plan = self.plan, plan_links(self.topology, scale)
        _run_all(tc_change_commands(self.plan))
        return before

    def remove_node(self, node_id: str) -> str:
        """Kill the emulated node ``node_id`` at once (its raylet and workers), as a lost
        machine; the Ray node id it had."""
        node = self._ray_nodes.pop(node_id)
        self.cluster.remove_node(node, allow_graceful=False)
        return node.node_id

    def ray_node_id(self, node_id: str) -> str:
        return self._ray_nodes[node_id].node_id

    def stop(self) -> None:
        from rayflex.local_ray import shut_down

        shut_down(self.cluster)
        self.cluster = None

    def __enter__(self) -> "LinkBed":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---------------------------------------------------------------- reading
    @property
    def address(self) -> str:
        return self.cluster.address

    def env(self, node_id: Optional[str] = None) -> dict:
        """The environment a process must have to run as part of node ``node_id`` (the
        head by default): a driver started with it connects from the node's address."""
        ip = self.plan.addresses[node_id or self.topology.nodes[0].node_id]
        return {**os.environ, IP_VAR: ip, "LD_PRELOAD": self.shim, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
                "RAY_ADDRESS": self.address}

    def counters(self) -> dict:
        """Bytes each link has carried since the bed started (``links.bytes_by_link``)."""
        out = subprocess.run(["tc", "-s", "class", "show", "dev", "lo"], capture_output=True, text=True, check=True)
        return bytes_by_link(self.plan, out.stdout)


def _run_all(cmds: list[list[str]]) -> None:
    for cmd in cmds:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")


def host_flops(seconds: float = 0.5) -> float:
    """This host's float32 matmul FLOP/s on one thread (what one rank of the bed computes
    with: tests and benchmarks pin ranks to one torch thread)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(256, 256), torch.randn(256, 256)
        a @ b  # warm
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            a @ b
            n += 1
        return n * 2 * 256 ** 3 / (time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)


def unshare_problem() -> Optional[str]:
    """None when this process can run the bed (make a private network namespace, shape it,
    build the shim), else why not."""
    if shutil.which("unshare") is None:
        return "util-linux's unshare is not installed"
    done = subprocess.run(["unshare", "-n", "true"], capture_output=True, text=True)
    if done.returncode != 0:
        return f"'unshare -n' failed ({done.stderr.strip() or done.returncode}): the bed needs root or CAP_SYS_ADMIN"
    if shutil.which("tc") is None:
        return "iproute2's tc is not installed"
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        return "no C compiler to build the connect shim (Debian: apt install gcc)"
    return None
