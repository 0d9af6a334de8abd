"""The links of an emulated cluster: each node's address, each pair's speed, and the tc rules.

Pure: a ``Topology`` and a scale in, a frozen ``LinkPlan`` out, and the ``tc`` command lines
that impose it on the loopback device of a private network namespace. Nothing here runs a
command.

Every node gets its own loopback address, ``127.0.<i+1>.1`` in the topology's order. Every
ordered pair of nodes (a node with itself included) gets one HTB class whose rate is the
tier between them (``Topology.tier``: same node, rack, zone, across zones) times the
sending node's slots times the scale: the cost model gives each rank its own link of the
tier's bandwidth (one NIC per GPU), so a node's ranks together send ``slots`` times that.
A u32 filter on the pair's source and destination addresses puts the pair's packets in its
class; anything else (a process outside the bed, a connection to 127.0.0.1) is not shaped.

The scale is what makes a CPU stand in for a GPU cluster: compute here is ~10^4 times
slower than an H100, so links are made as many times slower and a step spends the same
share of its time communicating as it would on the cluster the topology describes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

from rayflex.errors import ConfigError
from rayflex.planning.topology import LinkTier, Topology

# An H100 SXM's dense bf16 peak, FLOP/s: the accelerator the default Bandwidths describe.
H100_BF16_FLOPS = 989e12

# Below this, HTB's token bucket cannot hold one jumbo frame per tick and shapes badly; a
# scale that slows a tier further is refused.
MIN_RATE_BYTES_S = 16e3

# Loopback's frame size inside the bed: a jumbo frame, as on a cluster's fabric (lo's
# default 64 KiB makes every packet a burst larger than a slow class's bucket).
BED_MTU = 9000

MAX_NODES = 254


def node_address(index: int) -> str:
    """The loopback address of the ``index``-th node (0-based)."""
    if not 0 <= index < MAX_NODES:
        raise ConfigError("topology.nodes", f"the bed addresses at most {MAX_NODES} nodes, asked for #{index}",
                          "emulate a smaller cluster")
    return f"127.0.{index + 1}.1"


@dataclass(frozen=True)
class Link:
    """The traffic one node sends another (``src == dst``: between its own ranks)."""

    src: str
    dst: str
    tier: LinkTier
    rate_bytes_s: float
    classid: int  # the HTB class's minor number

    @property
    def tier_name(self) -> str:
        return self.tier.name.lower()


@dataclass(frozen=True)
class LinkPlan:
    """Addresses and links of an emulated cluster at ``scale``."""

    addresses: Mapping[str, str]
    links: tuple
    scale: float

    def link(self, src: str, dst: str) -> Link:
        for link in self.links:
            if (link.src, link.dst) == (src, dst):
                return link
        raise KeyError(f"no link {src} -> {dst}")

    def to_dict(self) -> dict:
        return {"scale": self.scale, "addresses": dict(self.addresses),
                "links": [{"src": l.src, "dst": l.dst, "tier": l.tier_name, "rate_bytes_s": l.rate_bytes_s}
                          for l in self.links]}


def scale_for(host_flops: float, reference_flops: float = H100_BF16_FLOPS) -> float:
    """The scale that keeps a step's compute-to-communication ratio: this host's FLOP/s per
    rank over the reference accelerator's."""
    if not (host_flops > 0 and reference_flops > 0):
        raise ConfigError("scale", f"FLOP/s must be positive, got host {host_flops!r}, reference {reference_flops!r}",
                          "measure the host again or give --scale")
    return min(1.0, host_flops / reference_flops)


def plan_links(topology: Topology, scale: float) -> LinkPlan:
    """Addresses and one link per ordered pair of ``topology``'s nodes, slowed by ``scale``."""
    if not (isinstance(scale, (int, float)) and 0 < scale <= 1):
        raise ConfigError("scale", f"must be in (0, 1], got {scale!r}",
                          "give the ratio of this host's FLOP/s to the accelerator's, e.g. 5e-5")
    nodes = topology.nodes
    if not nodes:
        raise ConfigError("topology.nodes", "empty", "list at least one node")
    addresses = {n.node_id: node_address(i) for i, n in enumerate(nodes)}
    links = []
    for src in nodes:
        for dst in nodes:
            tier = topology.tier(src, dst)
            rate = topology.bandwidths.of(tier) * max(1, src.slots) * scale
            if rate < MIN_RATE_BYTES_S:
                raise ConfigError("scale", f"{src.node_id} -> {dst.node_id} ({tier.name.lower()}) would carry "
                                  f"{rate:.0f} B/s at scale {scale:g}, below the {MIN_RATE_BYTES_S:.0f} B/s "
                                  "the shaper holds", "raise the scale or the topology's bandwidth_gbps")
            links.append(Link(src.node_id, dst.node_id, tier, rate, classid=0x10 + len(links)))
    return LinkPlan(addresses, tuple(links), float(scale))


def _class(verb: str, link: Link, device: str) -> list[str]:
    bits = f"{int(link.rate_bytes_s * 8)}bit"
    # The bucket: two frames, or a millisecond at the rate where that is more (HTB's timer
    # cannot refill a two-frame bucket fast enough to carry GB/s).
    burst = str(int(min(max(2 * BED_MTU, link.rate_bytes_s * 1e-3), 2 ** 30)))
    return ["tc", "class", verb, "dev", device, "parent", "1:", "classid", f"1:{link.classid:x}",
            "htb", "rate", bits, "ceil", bits, "burst", burst, "cburst", burst]


def tc_commands(plan: LinkPlan, device: str = "lo") -> list[list[str]]:
    """The commands that shape ``device`` as ``plan`` says (run in a fresh namespace)."""
    cmds = [["ip", "link", "set", device, "mtu", str(BED_MTU)],
            ["ip", "link", "set", device, "up"],
            # default 0: packets no filter claims are sent unshaped
            ["tc", "qdisc", "add", "dev", device, "root", "handle", "1:", "htb", "default", "0"]]
    for link in plan.links:
        cmds.append(_class("add", link, device))
        cmds.append(["tc", "filter", "add", "dev", device, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                     "match", "ip", "src", f"{plan.addresses[link.src]}/32",
                     "match", "ip", "dst", f"{plan.addresses[link.dst]}/32", "flowid", f"1:{link.classid:x}"])
    return cmds


def tc_change_commands(plan: LinkPlan, device: str = "lo") -> list[list[str]]:
    """The commands that give the classes ``tc_commands`` made the rates of ``plan`` (a plan
    of the same topology at another scale: the same classes)."""
    return [_class("change", link, device) for link in plan.links]


_CLASS = re.compile(r"class htb 1:([0-9a-f]+) .*?\n\s*Sent (\d+) bytes", re.S)


def class_bytes(tc_stats: str) -> dict[int, int]:
    """Bytes sent per class minor number, from ``tc -s class show dev lo``."""
    return {int(minor, 16): int(sent) for minor, sent in _CLASS.findall(tc_stats)}


def bytes_by_link(plan: LinkPlan, tc_stats: str) -> dict:
    """``{"by_tier": {tier: bytes}, "by_pair": {"src->dst": bytes}}`` from tc's counters."""
    sent = class_bytes(tc_stats)
    by_tier: dict[str, int] = {}
    by_pair: dict[str, int] = {}
    for link in plan.links:
        n = sent.get(link.classid, 0)
        by_tier[link.tier_name] = by_tier.get(link.tier_name, 0) + n
        by_pair[f"{link.src}->{link.dst}"] = n
    return {"by_tier": by_tier, "by_pair": by_pair}


def subtract(after: dict, before: dict) -> dict:
    """Bytes between two ``bytes_by_link`` readings."""
    return {key: {k: v - before[key].get(k, 0) for k, v in after[key].items()} for key in after}
