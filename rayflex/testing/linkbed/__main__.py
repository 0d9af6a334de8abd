"""``python -m rayflex.testing.linkbed``: run a command (or a function) on an emulated cluster.

    python -m rayflex.testing.linkbed --topology examples/topologies/two_racks_small.yaml \\
        --out links.json -- python train.py

makes a private network namespace, starts one Ray node per topology node on its own
loopback address with every pair of nodes shaped to its tier's bandwidth times the scale,
runs the command with ``RAY_ADDRESS`` pointing at the bed (as the head node's process), and
writes the bytes each link carried. ``--call MODULE:FUNCTION`` runs ``FUNCTION(bed)`` in
the bed's own process instead (tests and benchmarks: it can remove a node) and writes what
it returns. Needs root (or CAP_SYS_ADMIN), ``unshare``, ``tc`` and a C compiler; nothing
leaves the namespace, which holds nothing but its own loopback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from typing import Optional

from rayflex.errors import ConfigError

INODE_FILE_VAR = "RAYFLEX_LINKBED_NETNS_FILE"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rayflex.testing.linkbed", description=__doc__.split("\n\n")[0])
    p.add_argument("--topology", required=True, help="topology YAML or JSON (examples/topologies/)")
    p.add_argument("--scale", type=float, default=None,
                   help="link speed multiplier; default: this host's FLOP/s per rank over --reference-tflops")
    p.add_argument("--reference-tflops", type=float, default=989.0,
                   help="the accelerator the topology's bandwidths go with (default: H100 bf16 dense, 989)")
    p.add_argument("--cpus-per-slot", type=float, default=1.0, help="Ray CPUs per topology slot (default 1)")
    p.add_argument("--ray-system-config", default="{}",
                   help="JSON of Ray _system_config for the head (e.g. faster node health checks)")
    p.add_argument("--out", default=None, help="write the plan, bytes per link and tier, and --call's result here")
    p.add_argument("--call", default=None, help="MODULE:FUNCTION to run with the LinkBed instead of a command")
    p.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS... to run on the bed")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    # A terminated bed still tears down: SIGTERM unwinds like Ctrl-C, through the finally
    # blocks that stop the cluster and kill what is left in the namespace.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    args = _parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        if bool(command) == bool(args.call):
            raise ConfigError("linkbed", "give either -- COMMAND or --call MODULE:FUNCTION", "give exactly one")
        return _inside(args, command) if args.inside else _outside(args, command)
    except ConfigError as e:
        print(f"linkbed: {e}", file=sys.stderr)
        return 2


def _plan(args):
    from rayflex.planning.topology import Topology
    from rayflex.testing.linkbed.bed import host_flops
    from rayflex.testing.linkbed.links import plan_links, scale_for

    topology = Topology.from_file(args.topology)
    scale = args.scale if args.scale is not None else scale_for(host_flops(), args.reference_tflops * 1e12)
    return topology, plan_links(topology, scale)


def _outside(args, command: list[str]) -> int:
    """Check everything, then run this module again inside a fresh network namespace; kill
    whatever the bed left in it."""
    from rayflex.testing.linkbed.bed import IP_VAR, build_shim, kill_netns, unshare_problem

    topology, plan = _plan(args)  # a bad topology or scale fails here, before any process starts
    try:
        json.loads(args.ray_system_config)
    except ValueError as e:
        raise ConfigError("--ray-system-config", f"is not JSON ({e})", "give a JSON object") from None
    problem = unshare_problem()
    if problem:
        raise ConfigError("linkbed", problem, "run as root on Linux with util-linux and iproute2")
    shim = build_shim()
    head_ip = plan.addresses[topology.nodes[0].node_id]
    fd, inode_file = tempfile.mkstemp(prefix="rayflex-linkbed-", suffix=".netns")
    os.close(fd)
    env = {**os.environ, "LD_PRELOAD": shim, IP_VAR: head_ip, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
           INODE_FILE_VAR: inode_file}
    argv = [sys.executable, "-m", "rayflex.testing.linkbed", "--inside", "--topology", args.topology,
            "--scale", repr(plan.scale), "--cpus-per-slot", str(args.cpus_per_slot),
            "--ray-system-config", args.ray_system_config]
    argv += ["--out", args.out] if args.out else []
    argv += ["--call", args.call] if args.call else ["--", *command]
    proc = subprocess.Popen(["unshare", "-n", *argv], env=env)
    try:
        return proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        text = open(inode_file).read().strip()
        os.unlink(inode_file)
        if text:
            left = kill_netns(int(text))
            if left:
                print(f"linkbed: killed {left} process(es) the bed left behind", file=sys.stderr)


def _inside(args, command: list[str]) -> int:
    from rayflex.testing.linkbed.bed import LinkBed, netns_inode
    from rayflex.testing.linkbed.links import subtract

    inode_file = os.environ.pop(INODE_FILE_VAR, None)
    if inode_file is None:
        raise ConfigError("--inside", "is for the bed's own use", "run without it")
    with open(inode_file, "w") as f:
        f.write(str(netns_inode()))
    topology, plan = _plan(args)
    bed = LinkBed(topology, plan, os.environ["LD_PRELOAD"], cpus_per_slot=args.cpus_per_slot,
                  system_config=json.loads(args.ray_system_config))
    result, rc = None, 0
    try:
        bed.start()
        before = bed.counters()
        if args.call:
            import ray

            module, _, name = args.call.partition(":")
            ray.init(address=bed.address)
            result = getattr(importlib.import_module(module), name)(bed)
        else:
            rc = subprocess.run(command, env=bed.env()).returncode
        traffic = subtract(bed.counters(), before)
    finally:
        bed.stop()
    report = {"plan": plan.to_dict(), "traffic": traffic, "result": result, "returncode": rc}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    print(json.dumps({"bytes_by_tier": traffic["by_tier"], "scale": plan.scale}), file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
