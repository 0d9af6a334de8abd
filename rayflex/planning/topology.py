"""What the cluster looks like to the planner: nodes, worker slots, and how far apart they are.

A ``Topology`` is a frozen snapshot. The controller takes one from Ray (``from_ray``) each
time it plans; tests, benchmarks and ``rayflex plan`` describe one in YAML or JSON
(``from_file``) so placement can be studied without a cluster.

Distance is a four-level tree, because that is how bandwidth falls off in the clusters we
target: ranks on one node talk over NVLink (or shared memory), nodes of one rack or
GPU domain over InfiniBand, racks of one availability zone over the datacenter Ethernet, and
zones over the region's backbone. ``LinkTier`` names the levels and ``Bandwidths`` gives
each a figure, defaulting to public numbers and overridable per cluster.

Labels follow Ray's conventions: ``ray.io/availability-zone`` (or a user ``zone`` label),
``rack`` (a user label; Ray's ``ray.io/gpu-domain`` when absent), ``ray.io/market-type``
(``spot`` or ``on-demand``). A node without a zone label is taken to share the single
unnamed zone with other unlabeled nodes (a cluster that does not say otherwise is one
zone); a node without a rack label forms its own domain (we never assume InfiniBand
between nodes nobody said share a fabric).
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

from rayflex.config import MARKET_LABEL
from rayflex.errors import ConfigError

ZONE_LABEL = "ray.io/availability-zone"
ZONE_LABEL_SHORT = "zone"
RACK_LABEL = "rack"
GPU_DOMAIN_LABEL = "ray.io/gpu-domain"
NODE_ID_LABEL = "ray.io/node-id"


class LinkTier(enum.IntEnum):
    """How far apart two ranks are. Larger values are slower links.

    SAME_NODE is faster than SAME_DOMAIN (one rack or GPU domain), which is faster than
    SAME_ZONE, which is faster than CROSS_ZONE. The integer value doubles as the level of
    the topology tree at which two nodes meet, which is what the planner computes with.
    """

    SAME_NODE = 0
    SAME_DOMAIN = 1
    SAME_ZONE = 2
    CROSS_ZONE = 3


@dataclass(frozen=True)
class Bandwidths:
    """Per-rank link bandwidth in bytes/s for each ``LinkTier``.

    Defaults are public figures for a current GPU cluster, per GPU, ignoring contention:
    NVLink 4 about 900 GB/s; one 400 Gb/s InfiniBand NDR NIC per GPU, about 50 GB/s;
    100 Gb/s datacenter Ethernet between racks, 12.5 GB/s; and 2 GB/s between availability
    zones (operators report 1.25-3 GB/s per instance). Only the ratios matter to the
    planner's choices; the absolute values make the modeled seconds readable.
    """

    same_node: float = 900e9
    same_domain: float = 50e9
    same_zone: float = 12.5e9
    cross_zone: float = 2e9

    def __post_init__(self):
        values = [getattr(self, f.name) for f in fields(self)]
        for f, v in zip(fields(self), values):
            if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                raise ConfigError(f"Bandwidths.{f.name}", f"must be a positive number, got {v!r}",
                                  "give bytes per second, e.g. 12.5e9 for 100 Gb/s")
        if any(a < b for a, b in zip(values, values[1:])):
            raise ConfigError("Bandwidths", f"tiers must not get faster with distance, got {values}",
                              "order them same_node >= same_domain >= same_zone >= cross_zone")

    def of(self, tier: LinkTier) -> float:
        """Bandwidth in bytes/s of a link of ``tier``."""
        return (self.same_node, self.same_domain, self.same_zone, self.cross_zone)[int(tier)]

    @classmethod
    def from_gbps(cls, overrides: Mapping[str, float]) -> "Bandwidths":
        """Defaults with some tiers overridden in gigabits per second (``{"same_zone": 100}``)."""
        names = {f.name for f in fields(cls)}
        unknown = set(overrides) - names
        if unknown:
            raise ConfigError("bandwidth_gbps", f"unknown tier(s) {sorted(unknown)}",
                              f"use some of {sorted(names)}")
        return cls(**{k: float(v) * 1e9 / 8 for k, v in overrides.items()})


@dataclass(frozen=True)
class NodeInfo:
    """One node as the planner sees it: how many workers fit and where it sits."""

    node_id: str
    ip: str = "127.0.0.1"
    slots: int = 0
    alive: bool = True
    draining: bool = False
    labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def zone(self) -> Optional[str]:
        return self.labels.get(ZONE_LABEL) or self.labels.get(ZONE_LABEL_SHORT) or None

    @property
    def rack(self) -> Optional[str]:
        return self.labels.get(RACK_LABEL) or self.labels.get(GPU_DOMAIN_LABEL) or None

    @property
    def market_type(self) -> Optional[str]:
        return self.labels.get(MARKET_LABEL) or None

    @property
    def usable(self) -> bool:
        """Alive and not draining: a node worth placing new workers on."""
        return self.alive and not self.draining

    def domain_key(self) -> Optional[tuple]:
        """Identity of this node's fast domain, or None when it has none but itself.

        The zone is part of the key: a rack never spans zones, so equal rack labels in two
        zones are two racks.
        """
        return None if self.rack is None else (self.zone, self.rack)


NodeRef = Union[str, NodeInfo]


@dataclass(frozen=True)
class Topology:
    """A frozen list of nodes plus the bandwidth of each link tier."""

    nodes: tuple = ()
    bandwidths: Bandwidths = field(default_factory=Bandwidths)

    def __post_init__(self):
        object.__setattr__(self, "nodes", tuple(self.nodes))
        seen = set()
        for n in self.nodes:
            if n.node_id in seen:
                raise ConfigError("Topology.nodes", f"node id {n.node_id!r} appears twice",
                                  "give every node a distinct id")
            seen.add(n.node_id)

    # ---- queries -----------------------------------------------------------------------
    @property
    def total_slots(self) -> int:
        return sum(n.slots for n in self.nodes)

    def usable(self) -> "Topology":
        """The nodes that are alive and not draining (where a new plan may put workers)."""
        return Topology(tuple(n for n in self.nodes if n.usable), self.bandwidths)

    def node(self, node_id: str) -> NodeInfo:
        for n in self.nodes:
            if n.node_id == node_id:
                return n
        raise KeyError(f"no node {node_id!r} in topology ({len(self.nodes)} nodes)")

    def tier(self, a: NodeRef, b: NodeRef) -> LinkTier:
        """The link tier between two nodes (ids or ``NodeInfo``)."""
        na = a if isinstance(a, NodeInfo) else self.node(a)
        nb = b if isinstance(b, NodeInfo) else self.node(b)
        return tier_between(na, nb)

    # ---- constructors ------------------------------------------------------------------
    @classmethod
    def from_dict(cls, spec: Mapping[str, Any]) -> "Topology":
        """Build from ``{nodes: [{id, slots, labels?, ip?, alive?, draining?}], bandwidth_gbps?}``.

        ``bandwidth_gbps`` overrides tiers in gigabits per second (``{same_zone: 100}``);
        ``bandwidth_bytes_per_s`` does the same in bytes per second.
        """
        if not isinstance(spec, Mapping) or not isinstance(spec.get("nodes"), Sequence):
            raise ConfigError("topology", "expected a mapping with a 'nodes' list",
                              "write {nodes: [{id: n0, slots: 8, labels: {rack: r0}}, ...]}")
        nodes = []
        for i, raw in enumerate(spec["nodes"]):
            where = f"topology.nodes[{i}]"
            if not isinstance(raw, Mapping):
                raise ConfigError(where, f"expected a mapping, got {raw!r}", "write {id: n0, slots: 8}")
            node_id = raw.get("id", raw.get("node_id"))
            if node_id is None:
                raise ConfigError(f"{where}.id", "missing", "give each node an id")
            slots = raw.get("slots")
            if not isinstance(slots, int) or isinstance(slots, bool) or slots < 0:
                raise ConfigError(f"{where}.slots", f"must be an integer >= 0, got {slots!r}",
                                  "say how many workers fit on the node, e.g. slots: 8")
            labels = raw.get("labels") or {}
            if not isinstance(labels, Mapping):
                raise ConfigError(f"{where}.labels", f"expected a mapping, got {labels!r}",
                                  "write labels: {rack: r0}")
            nodes.append(NodeInfo(node_id=str(node_id), ip=str(raw.get("ip", "127.0.0.1")),
                                  slots=slots, alive=bool(raw.get("alive", True)),
                                  draining=bool(raw.get("draining", False)),
                                  labels={str(k): str(v) for k, v in labels.items()}))
        bandwidths = Bandwidths()
        if spec.get("bandwidth_gbps"):
            bandwidths = Bandwidths.from_gbps(spec["bandwidth_gbps"])
        if spec.get("bandwidth_bytes_per_s"):
            bandwidths = Bandwidths(**{**bandwidths.__dict__, **spec["bandwidth_bytes_per_s"]})
        return cls(tuple(nodes), bandwidths)

    @classmethod
    def from_file(cls, path: Union[str, Path]) -> "Topology":
        """Read a described topology from YAML (``.yaml``/``.yml``) or JSON."""
        path = Path(path)
        text = path.read_text()
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            spec = yaml.safe_load(text)
        else:
            spec = json.loads(text)
        return cls.from_dict(spec)

    def to_dict(self) -> dict:
        return {"nodes": [{"id": n.node_id, "ip": n.ip, "slots": n.slots, "alive": n.alive,
                           "draining": n.draining, "labels": dict(n.labels)} for n in self.nodes],
                "bandwidth_bytes_per_s": dict(self.bandwidths.__dict__)}

    @classmethod
    def from_ray(cls, cpus_per_worker: float = 1.0, use_gpu: bool = False,
                 gpus_per_worker: float = 1, bandwidths: Optional[Bandwidths] = None) -> "Topology":
        """Snapshot the connected Ray cluster (``ray.init()`` must have been called).

        Slots come from each node's total resources (``floor(GPU / gpus_per_worker)`` with
        ``use_gpu``, else ``floor(CPU / cpus_per_worker)``): the plan is about where workers
        may go, and placement groups are what reserve them. Nodes keep Ray's order, which is
        no fixed one (``naive_plan`` orders them by address).
        """
        import ray

        draining = _draining_node_ids()
        nodes = []
        for raw in ray.nodes():
            resources = raw.get("Resources") or {}
            if use_gpu:
                slots = math.floor(resources.get("GPU", 0.0) / gpus_per_worker + 1e-9)
            else:
                slots = math.floor(resources.get("CPU", 0.0) / cpus_per_worker + 1e-9)
            node_id = raw["NodeID"]
            nodes.append(NodeInfo(node_id=node_id, ip=raw.get("NodeManagerAddress", ""),
                                  slots=int(slots), alive=bool(raw.get("Alive", False)),
                                  draining=node_id in draining,
                                  labels=dict(raw.get("Labels") or {})))
        return cls(tuple(nodes), bandwidths or Bandwidths())


def tier_between(a: NodeInfo, b: NodeInfo) -> LinkTier:
    """The link tier between two nodes; see the module docstring for missing labels."""
    if a.node_id == b.node_id:
        return LinkTier.SAME_NODE
    if a.zone != b.zone:
        return LinkTier.CROSS_ZONE
    da = a.domain_key()
    if da is not None and da == b.domain_key():
        return LinkTier.SAME_DOMAIN
    return LinkTier.SAME_ZONE


def _draining_node_ids() -> set:
    """Node ids Ray is draining (spot notices, scale-down); empty when the API is unavailable.

    ``get_draining_nodes`` is a private API; a Ray that moved it must not stop planning, it
    only loses the hint that lets the plan avoid nodes about to go.
    """
    try:
        from ray._private.state import state

        return set((state.get_draining_nodes() or {}).keys())
    except Exception:  # noqa: BLE001 - a missing private API degrades to "nothing draining"
        return set()
