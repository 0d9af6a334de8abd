"""A described cluster for the capacity planner: its devices (memory, FLOP/s) and topology.

``rayflex plan --cluster FILE`` and ``ParallelConfig(layout="auto", cluster=FILE)`` read one
(format: docs/capacity.md); ``ClusterDescription.uniform`` generates one for benchmarks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from rayflex.config import PRICE_LABEL, node_price
from rayflex.errors import ConfigError
from rayflex.planning.capacity.memory import GB, Runtime, fmt_bytes
from rayflex.planning.topology import Topology


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator: memory, dense peak FLOP/s in the compute dtype, achieved fraction."""

    memory_bytes: float
    flops: float
    mfu: float = 0.4
    name: str = "device"

    def __post_init__(self) -> None:
        for f in ("memory_bytes", "flops"):
            if not getattr(self, f) > 0:
                raise ConfigError(f"DeviceSpec.{f}", f"must be > 0, got {getattr(self, f)!r}",
                                  "give bytes and FLOP/s, e.g. memory_gb: 80, tflops: 989")
        if not 0 < self.mfu <= 1:
            raise ConfigError("DeviceSpec.mfu", f"must be in (0, 1], got {self.mfu!r}", "use e.g. 0.4")

    @classmethod
    def h100_80gb(cls, mfu: float = 0.4) -> "DeviceSpec":
        # H100 SXM: 80 GB HBM3, 989 TFLOP/s dense bf16
        return cls(memory_bytes=80 * GB, flops=989e12, mfu=mfu, name="H100-80GB")

    @classmethod
    def local_cpu(cls, workers: int) -> "DeviceSpec":
        """This host's memory shared by ``workers`` CPU ranks (about 20 GFLOP/s each)."""
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return cls(memory_bytes=total / max(1, workers), flops=20e9, mfu=1.0, name="cpu")


@dataclass(frozen=True, kw_only=True)
class ClusterDescription:
    """A described cluster: topology (nodes, slots, labels, bandwidths) plus its devices."""

    topology: Topology
    device: DeviceSpec
    memory_margin: float = 0.10  # fraction of device memory the plan keeps free
    runtime: Runtime = field(default_factory=Runtime.gpu)

    def __post_init__(self) -> None:
        if not 0 <= self.memory_margin < 1:
            raise ConfigError("ClusterDescription.memory_margin", f"must be in [0, 1), got {self.memory_margin!r}",
                              "use e.g. 0.1 to keep 10% of device memory free")

    @property
    def usable_bytes(self) -> float:
        return self.device.memory_bytes * (1 - self.memory_margin)

    @property
    def slots(self) -> int:
        return self.topology.usable().total_slots

    @classmethod
    def uniform(cls, *, nodes: int, devices_per_node: int, device: DeviceSpec, nodes_per_rack: int = 0,
                racks_per_zone: int = 0, memory_margin: float = 0.10, runtime: Runtime | None = None,
                bandwidth_gbps: Mapping[str, float] | None = None,
                price_per_hour: Optional[float] = None) -> "ClusterDescription":
        """``nodes`` identical nodes; ``nodes_per_rack`` share a fast domain (0: each node alone);
        ``price_per_hour``: what each node costs (its ``rayflex.io/price-per-hour`` label)."""
        spec: dict = {"nodes": [_node(i, devices_per_node, nodes_per_rack, racks_per_zone) for i in range(nodes)]}
        if price_per_hour is not None:
            for node in spec["nodes"]:
                node["labels"][PRICE_LABEL] = str(float(price_per_hour))
        if bandwidth_gbps:
            spec["bandwidth_gbps"] = dict(bandwidth_gbps)
        return cls(topology=Topology.from_dict(spec), device=device, memory_margin=memory_margin,
                   runtime=runtime or Runtime.gpu())

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ClusterDescription":
        """``{device: {memory_gb, tflops, mfu?, name?}, memory_margin?, overhead_gb?,
        nodes: [...] (Topology format) | uniform: {nodes, devices_per_node, nodes_per_rack?,
        racks_per_zone?}, bandwidth_gbps?}``."""
        if not isinstance(d, Mapping):
            raise ConfigError("cluster", "expected a mapping", "see docs/capacity.md for the format")
        dev = d.get("device")
        if not isinstance(dev, Mapping) or "memory_gb" not in dev or "tflops" not in dev:
            raise ConfigError("cluster.device", f"needs memory_gb and tflops, got {dev!r}",
                              "write device: {memory_gb: 80, tflops: 989, mfu: 0.4}")
        device = DeviceSpec(memory_bytes=float(dev["memory_gb"]) * GB, flops=float(dev["tflops"]) * 1e12,
                            mfu=float(dev.get("mfu", 0.4)), name=str(dev.get("name", "device")))
        runtime = Runtime.gpu(overhead_bytes=float(d.get("overhead_gb", 2.0)) * GB)
        margin = float(d.get("memory_margin", 0.10))
        if "uniform" in d:
            u = dict(d["uniform"])
            unknown = set(u) - {"nodes", "devices_per_node", "nodes_per_rack", "racks_per_zone", "price_per_hour"}
            if unknown:
                raise ConfigError("cluster.uniform", f"unknown keys {sorted(unknown)}",
                                  "use nodes, devices_per_node, nodes_per_rack, racks_per_zone, price_per_hour")
            price = u.get("price_per_hour")
            if price is not None and (isinstance(price, bool) or not isinstance(price, (int, float)) or price < 0):
                raise ConfigError("cluster.uniform.price_per_hour", f"must be dollars per node-hour >= 0, got {price!r}",
                                  "write e.g. price_per_hour: 31.2, or leave it out (no cost is printed)")
            return cls.uniform(device=device, memory_margin=margin, runtime=runtime,
                               bandwidth_gbps=d.get("bandwidth_gbps"), **u)
        topo = {k: d[k] for k in ("nodes", "bandwidth_gbps", "bandwidth_bytes_per_s") if k in d}
        return cls(topology=Topology.from_dict(topo), device=device, memory_margin=margin, runtime=runtime)

    @classmethod
    def from_file(cls, path: Union[str, Path]) -> "ClusterDescription":
        path = Path(path)
        if not path.exists():
            raise ConfigError("--cluster", f"no such file {str(path)!r}", "give a cluster description YAML")
        text = path.read_text()
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            return cls.from_dict(yaml.safe_load(text))
        import json

        return cls.from_dict(json.loads(text))

    @classmethod
    def local_cpu(cls, workers: int) -> "ClusterDescription":
        """One node with ``workers`` CPU slots sharing this host's memory."""
        return cls(topology=Topology.from_dict({"nodes": [{"id": "local", "slots": workers}]}),
                   device=DeviceSpec.local_cpu(workers), runtime=Runtime.cpu())

    def hourly_cost(self, world_size: int) -> Optional[tuple[float, int]]:
        """(dollars per hour, nodes) of the first nodes that hold ``world_size`` ranks (the
        planner fills nodes in order), by their ``rayflex.io/price-per-hour`` labels; None
        when one of them has no price."""
        total, used, left = 0.0, 0, world_size
        for node in self.topology.usable().nodes:
            if left <= 0:
                break
            price = node_price(node.labels, {})
            if price is None:
                return None
            total, used, left = total + price, used + 1, left - node.slots
        return (total, used) if left <= 0 else None

    def describe(self) -> str:
        n = len(self.topology.usable().nodes)
        return (f"{n} nodes, {self.slots} x {self.device.name} ({fmt_bytes(self.device.memory_bytes)}, "
                f"{self.device.flops / 1e12:.0f} TFLOP/s at {self.device.mfu:.0%} MFU), "
                f"{self.memory_margin:.0%} memory margin -> {fmt_bytes(self.usable_bytes)} usable per device")


def _node(i: int, slots: int, per_rack: int, racks_per_zone: int) -> dict:
    labels = {}
    if per_rack:
        rack = i // per_rack
        labels["rack"] = f"rack{rack}"
        if racks_per_zone:
            labels["zone"] = f"zone{rack // racks_per_zone}"
    return {"id": f"node{i:04d}", "slots": slots, "labels": labels}
