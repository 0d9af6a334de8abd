"""The link bed: two emulated nodes in two racks, each on its own loopback address, the link
between them shaped to its tier. A pipeline-parallel run placed by the planner keeps its
FSDP traffic inside the nodes (the bytes tc counted per link prove it, against the bytes the
cost model's collectives predict), and a run that loses one emulated node goes on without it.

Skipped, saying why, where this process may not create network namespaces (not root)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rayflex.testing.linkbed.bed import unshare_problem

# The bed's two runs are one subprocess bounded by its own timeout (BED_TIMEOUT_S); pytest's
# default per test (300 s, pyproject) is shorter than that run inside the slow-host quota
# (283 s, then 300.08 s at 0.6 of one core), and the module fixture's time counts against
# the first test.
BED_TIMEOUT_S = 900
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(BED_TIMEOUT_S + 60)]

ROOT = Path(__file__).resolve().parent.parent
TOPOLOGY = ROOT / "examples" / "topologies" / "two_racks_small.yaml"
# Fixed, so the link rates do not follow a noisy FLOP/s measurement (1e-4: a rank here
# computes ~1e-4 of an H100's bf16 peak).
SCALE = 1e-4
HEALTH = {"health_check_period_ms": 1000, "health_check_timeout_ms": 2000, "health_check_failure_threshold": 5}


@pytest.fixture(scope="module")
def bed_run(tmp_path_factory):
    problem = unshare_problem()
    if problem:
        pytest.skip(f"the link bed cannot run here: {problem}")
    tmp = tmp_path_factory.mktemp("linkbed")
    out = tmp / "bed.json"
    env = {**os.environ, "LINKBED_TEST_DIR": str(tmp), "PYTHONPATH": str(ROOT / "tests"),
           "RAYFLEX_HEARTBEAT_TIMEOUT_S": "3", "RAYFLEX_RELEASE_TIMEOUT_S": "5"}
    done = subprocess.run([sys.executable, "-m", "rayflex.testing.linkbed", "--topology", str(TOPOLOGY),
                           "--scale", str(SCALE), "--ray-system-config", json.dumps(HEALTH), "--out", str(out),
                           "--call", "linkbed_scenarios:pipeline_then_node_lost"],
                          env=env, capture_output=True, text=True, timeout=BED_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


def test_the_planner_keeps_fsdp_inside_the_nodes_and_the_bytes_show_it(bed_run):
    run = bed_run["result"]["pipeline"]
    assert run["status"] == "finished"
    plan = run["events"][0]
    placed = [run["nodes"][n] for n in plan["rank_to_node"]]
    # pp=2 x dp=2: each stage's FSDP pair on one node, the stage boundary across the racks
    # (which stage gets which node is a tie: Ray lists the nodes in an order of its own)
    for layout in (placed, run["planned"]):
        assert layout[0] == layout[1] != layout[2] == layout[3], layout
    steps = run["steps"][1] - run["steps"][0]
    measured = {tier: n / steps for tier, n in run["traffic"]["by_tier"].items()}
    predicted = run["predicted_per_step"]
    print({"bytes_per_step": measured, "predicted": predicted})
    # FSDP's all-gathers and reduce-scatters, all inside the nodes, as many bytes as predicted
    assert measured["same_node"] == pytest.approx(predicted["same_node"], rel=0.1)
    # Over the slow link: the activations the model predicts, plus control traffic (the
    # controller's polls, the per-step control all-reduce) that is small beside what a
    # layout splitting the FSDP pairs would have sent there.
    assert predicted["same_zone"] <= measured["same_zone"] <= predicted["same_zone"] + 0.1 * predicted["same_node"]
    assert bed_run["plan"]["addresses"] == {"n0": "127.0.1.1", "n1": "127.0.2.1"}


def test_a_run_that_loses_an_emulated_node_goes_on_without_it(bed_run):
    run = bed_run["result"]["node_lost"]
    events = run["events"]
    # one line per event, as a string (pytest cuts a long list short)
    story = "\n".join(str((e["kind"], e.get("rank"), (e.get("node_id") or "")[:8],
                            (e.get("reason") or e.get("error") or "")[:160])) for e in events)
    assert run["status"] == "finished" and run["steps_completed"] == run["steps"], story
    first = next(e for e in events if e["kind"] == "plan_chosen")
    assert len(set(first["rank_to_node"])) == 2, "the run started on both nodes"
    # The killed node is named lost, whichever was seen first: its ranks' deaths, a survivor's
    # broken collective, or its ranks' silence while the others left (Ray declares the node
    # dead seconds after its ranks stop). Rank numbers change from one attempt to the next;
    # the node does not.
    lost_id = run["lost"]["node_id"]
    on_lost = sum(1 for n in first["rank_to_node"] if n == lost_id)
    named = [e for e in events if e["kind"] == "node_lost" and e["node_id"] == lost_id]
    assert on_lost == 2 and named, story
    sizes = [e["world_size"] for e in events if e["kind"] == "restarted"]
    assert sizes and sizes[-1] == 2, story
    last_plan = [e for e in events if e["kind"] == "plan_chosen"][-1]
    assert lost_id not in last_plan["rank_to_node"], story


def test_an_emulated_node_targets_nothing_outside_loopback():
    # Inside a private namespace whose only interface is lo, with a default route over it (so
    # the kernel would accept a datagram connect anywhere: only the shim can refuse it), a
    # process of an emulated node: a connect to a loopback address leaves from the node's
    # address, one to any other address (Ray probes 8.8.8.8:53 to learn its own) is refused
    # by the shim with ENETUNREACH before the kernel sees it.
    problem = unshare_problem()
    if problem:
        pytest.skip(f"the link bed cannot run here: {problem}")
    from rayflex.testing.linkbed.bed import build_shim

    probe = (
        "import errno, socket\n"
        "out = {}\n"
        "for family, addr in ((socket.AF_INET, ('8.8.8.8', 53)), (socket.AF_INET6, ('2001:4860:4860::8888', 53))):\n"
        "    s = socket.socket(family, socket.SOCK_DGRAM)\n"
        "    out[addr[0]] = s.connect_ex(addr)\n"
        "listener = socket.socket(); listener.bind(('127.0.0.1', 0)); listener.listen()\n"
        "c = socket.create_connection(listener.getsockname())\n"
        "out['source'] = c.getsockname()[0]\n"
        "print(out)\n")
    script = ("ip link set lo up && ip route add default dev lo && (ip -6 route add default dev lo || true) && "
              f"exec {sys.executable} -c \"$PROBE\"")
    done = subprocess.run(["unshare", "-n", "sh", "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PROBE": probe, "LD_PRELOAD": build_shim(),
                               "LINKBED_NODE_IP": "127.0.2.1"})
    assert done.returncode == 0, done.stderr[-2000:]
    import ast
    import errno

    got = ast.literal_eval(done.stdout.strip())
    assert got == {"8.8.8.8": errno.ENETUNREACH, "2001:4860:4860::8888": errno.ENETUNREACH, "source": "127.0.2.1"}
