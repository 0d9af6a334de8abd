"""Shared fixtures: loopback Ray clusters, datasets, a small model, fast knobs.

Ray binds to 127.0.0.1 only. Every cluster a fixture starts is shut down in a finally
block, even when the test fails.
"""

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Fast control-plane knobs for tests (the controller and workers inherit them).
os.environ.setdefault("RAYFLEX_POLL_INTERVAL_S", "0.05")
os.environ.setdefault("RAYFLEX_PLACEMENT_TIMEOUT_S", "30")
os.environ.setdefault("RAYFLEX_COLLECTIVE_TIMEOUT_S", "60")

import contextlib  # noqa: E402

import pytest  # noqa: E402

pytest_plugins = ["s3_fixture"]

SEQ_LEN = 32


@pytest.fixture(scope="session")
def dataset_uri(tmp_path_factory):
    from rayflex.actors.data import write_synthetic_dataset

    root = tmp_path_factory.mktemp("data")
    return write_synthetic_dataset(f"file://{root}/tokens", num_samples=1024, seq_len=SEQ_LEN,
                                   vocab_size=128, num_shards=3, seed=7)


def small_gpt(n_layers: int = 2):
    from rayflex.models import GPTConfig, gpt

    return gpt(GPTConfig(vocab_size=128, seq_len=SEQ_LEN, d_model=32, n_layers=n_layers, n_heads=2))


@contextlib.contextmanager
def loopback_cluster(nodes: list[dict]):
    """Start a ray.cluster_utils.Cluster on 127.0.0.1, connect, and always tear it down.

    ``nodes``: one dict per node with ``num_cpus`` and optional ``labels``/``resources``;
    the first is the head.
    """
    import ray
    from ray.cluster_utils import Cluster

    cluster = None
    try:
        head = dict(nodes[0])
        head.setdefault("node_ip_address", "127.0.0.1")
        head.setdefault("include_dashboard", False)
        cluster = Cluster(initialize_head=True, head_node_args=head)
        for spec in nodes[1:]:
            spec = dict(spec)
            spec.setdefault("node_ip_address", "127.0.0.1")
            cluster.add_node(**spec)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        yield cluster
    finally:
        with contextlib.suppress(Exception):
            ray.shutdown()
        if cluster is not None:
            with contextlib.suppress(Exception):
                cluster.shutdown()


@pytest.fixture(scope="module")
def two_node_cluster():
    """2 nodes x 2 CPUs, labelled with racks: reused by the tests of one module."""
    with loopback_cluster([{"num_cpus": 2, "labels": {"rack": "r0"}},
                           {"num_cpus": 2, "labels": {"rack": "r1"}}]) as c:
        yield c


def run_events(tmp_path, name: str) -> list[dict]:
    """The typed events a run wrote to ``{tmp_path}/runs/{name}/events.jsonl``."""
    import json

    path = tmp_path / "runs" / name / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_until_running(handle, step: int, timeout_s: float = 120, committed: int = 0):
    """Block until the run is RUNNING past ``step`` with a checkpoint of at least
    ``committed`` committed; returns its status."""
    import time

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        st = handle.status()
        last = (st.get("last_checkpoint") or {}).get("step") or 0
        if st["step"] >= step and st["state"] == "RUNNING" and last >= committed:
            return st
        time.sleep(0.1)
    raise AssertionError(f"run not running at step {step} after {timeout_s}s")
