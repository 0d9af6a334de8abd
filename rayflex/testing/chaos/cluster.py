"""A Ray cluster of several loopback "nodes" on this machine, for chaos runs.

Nodes are removed and added from the caller's (main) thread: ``Cluster.add_node``
installs signal handlers, which only the main thread may do.
"""

from __future__ import annotations

import time


class LocalCluster:
    def __init__(self, nodes: int, cpus_per_node: int):
        self.nodes, self.cpus = nodes, cpus_per_node
        self.cluster = None

    def __enter__(self) -> "LocalCluster":
        import ray
        from ray.cluster_utils import Cluster

        from rayflex.local_ray import head_node_args

        try:
            self.cluster = Cluster(initialize_head=True, head_node_args=head_node_args(self.cpus))
            for _ in range(self.nodes - 1):
                self.add_node()
            self.cluster.wait_for_nodes()
            ray.init(address=self.cluster.address)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        from rayflex.local_ray import shut_down

        shut_down(self.cluster)
        self.cluster = None

    @property
    def address(self) -> str:
        return self.cluster.address

    @property
    def head_id(self) -> str:
        return self.cluster.head_node.node_id

    def add_node(self) -> str:
        node = self.cluster.add_node(node_ip_address="127.0.0.1", num_cpus=self.cpus)
        return node.node_id

    def remove_node(self, node_id: str) -> bool:
        node = next((n for n in self.cluster.worker_nodes if n.node_id == node_id), None)
        if node is None:
            return False
        self.cluster.remove_node(node)
        return True

    def processes(self, node_id: str) -> list[int]:
        """The node's raylet and everything it started (what a slow machine slows)."""
        from rayflex.testing.throttle import node_processes

        return node_processes(self.cluster, node_id)

    def drain(self, node_id: str, deadline_s: float, reason: str = "spot termination (chaos)") -> float:
        """A spot notice the way Ray's autoscaler sends one; returns the deadline (epoch s)."""
        import ray
        from ray.core.generated import autoscaler_pb2

        deadline = time.time() + deadline_s
        gcs = ray._raylet.GcsClient(address=self.address)
        ok, why = gcs.drain_node(node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                                 reason, int(deadline * 1000))
        if not ok:
            raise RuntimeError(f"drain of node {node_id[:8]} refused: {why}")
        return deadline
