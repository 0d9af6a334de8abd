"""Shared fixtures: loopback Ray clusters, datasets, a small model, fast knobs.

Ray binds to 127.0.0.1 only. Every cluster a fixture starts is shut down in a finally
block, even when the test fails.
"""

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Control-plane knobs for tests (the controller and workers inherit them). The poll
# interval stays the production default (0.2 s): at 0.05 s the controller's polls were
# ~10% of a cluster test's CPU on this 2-core machine, for detection a few 0.1 s sooner.
os.environ.setdefault("RAYFLEX_POLL_INTERVAL_S", "0.2")
os.environ.setdefault("RAYFLEX_PLACEMENT_TIMEOUT_S", "30")
os.environ.setdefault("RAYFLEX_COLLECTIVE_TIMEOUT_S", "60")
# No run report (matplotlib, ~1 CPU-s of the controller) at the end of every cluster run:
# the report is tested in test_report.py, and whether a run draws it in test_controller_states.py.
os.environ.setdefault("RAYFLEX_RUN_REPORT", "0")
# Besides rayflex.local_ray.LEAN_RAY_ENV (every Ray rayflex starts), two Ray services no test
# reads: metrics (run metrics are tested without a cluster) and the memory monitor's 250 ms
# polls. Together they take an idle test cluster from 0.054 to 0.047 CPU-s/s, which a slow
# host pays for every second a cluster is up.
os.environ.setdefault("RAY_enable_metrics_collection", "0")
os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
# Nor worker processes started ahead of the first driver (one per CPU of the node it joins):
# no test's actor waits on a worker's start-up that matters beside torch's import, and each
# idle one wakes 100 times a second (Ray's signal check): 0.043 -> 0.026 CPU-s/s for an idle
# two-node cluster, besides ~0.5 CPU-s a prestarted worker for each cluster a test starts.
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")


def _own_ray_temp_dir() -> None:
    """A Ray temp dir for this pytest process alone (each xdist worker has one). A cluster
    records its address in ``<temp dir>/ray/ray_current_cluster``, and a process that joins
    "this machine's running cluster" (``rayflex.local_ray.ensure_ray``: ``rayflex run``, the
    GPU kit, a notebook) reads it there: with one shared /tmp/ray, a test's subprocess on one
    worker joined the cluster the other worker's test had up (the kit's run took the chaos
    run's nodes). Short: Ray's socket paths under it must fit in 107 bytes."""
    root = f"/tmp/rayflex-tests-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}"
    os.makedirs(root, exist_ok=True)
    stale = os.path.join(root, "ray", "ray_current_cluster")  # a previous session's cluster, long gone
    if os.path.exists(stale):
        os.remove(stale)
    os.environ["RAY_TMPDIR"] = root


_own_ray_temp_dir()

import pytest  # noqa: E402

pytest_plugins = ["s3_fixture", "cloud_fixtures", "suite_cpu"]

SEQ_LEN = 32


@pytest.fixture(scope="session")
def dataset_uri(tmp_path_factory):
    from rayflex.data.dataset import write_synthetic_dataset

    root = tmp_path_factory.mktemp("data")
    return write_synthetic_dataset(f"file://{root}/tokens", num_samples=1024, seq_len=SEQ_LEN,
                                   vocab_size=128, num_shards=3, seed=7)


def small_gpt(n_layers: int = 2):
    from rayflex.models import GPTConfig, gpt

    return gpt(GPTConfig(vocab_size=128, seq_len=SEQ_LEN, d_model=32, n_layers=n_layers, n_heads=2))


# Ray's node health check, faster than its default (a node that misses 5 checks 3 s apart,
# 10 s each, is dead): a frozen node is declared dead in ~5-15 s, not a minute.
FAST_HEALTH_CHECK = {"health_check_period_ms": 1000, "health_check_timeout_ms": 2000,
                     "health_check_failure_threshold": 5}
TWO_NODES = [{"num_cpus": 2, "labels": {"rack": "r0"}, "_system_config": FAST_HEALTH_CHECK},
             {"num_cpus": 2, "labels": {"rack": "r1"}}]


class SharedCluster:
    """One loopback cluster kept for the whole session by every module that asks for the
    same nodes (``two_node_cluster``): starting one costs ~6 s of this machine's 2 cores.
    A test that starts a cluster of its own, or a Ray of its own in this process, gets
    the shared one shut down first (one Ray connection per process). Tests are ordered
    so that this happens once (``pytest_collection_modifyitems``)."""

    def __init__(self):
        self._context = None
        self.cluster = None

    def get(self, nodes: list[dict]):
        if self.cluster is not None and not self._intact(len(nodes)):
            self.close()  # a failed test left a node missing, or actors behind: start clean
        if self.cluster is None:
            from rayflex.local_ray import loopback_cluster as start

            self._context = start(nodes)
            self.cluster = self._context.__enter__()
        return self.cluster

    def _intact(self, num_nodes: int, timeout_s: float = 30) -> bool:
        """Every node alive and every CPU free again (the previous run's actors and
        placement groups are gone; a test that removed a node has replaced it)."""
        import time

        import ray

        deadline = time.time() + timeout_s
        while time.time() < deadline:
            alive = sum(1 for n in ray.nodes() if n["Alive"])
            if alive == num_nodes and ray.available_resources().get("CPU", 0) >= \
                    ray.cluster_resources().get("CPU", 0) > 0:
                return True
            time.sleep(0.2)
        return False

    def close(self):
        context, self._context, self.cluster = self._context, None, None
        if context is not None:
            context.__exit__(None, None, None)


SHARED = SharedCluster()


def loopback_cluster(nodes: list[dict]):
    """A connected ``ray.cluster_utils.Cluster`` of the test's own on 127.0.0.1, always
    torn down; every port with a Ray default is chosen free (``rayflex.local_ray``).

    ``nodes``: one dict per node with ``num_cpus`` and optional ``labels``/``resources``;
    the first is the head.
    """
    from rayflex.local_ray import loopback_cluster as start

    SHARED.close()
    return start(nodes)


@pytest.fixture(scope="module")
def two_node_cluster():
    """2 nodes x 2 CPUs labelled with racks r0/r1, shared by every module that uses it."""
    return SHARED.get(TWO_NODES)


# `make test` runs two pytest-xdist workers that take whole files in the order below
# (``-n 2 --dist loadfile --no-loadscope-reorder``). The chaos run, a quarter of the
# suite's one-worker time and the most sensitive to a busy machine, goes first; while it
# runs, the other worker takes the unit tests and then the modules with clusters of their
# own, which mostly wait (spot notices, job submission, a kernel). The runs on the shared
# cluster, which keep both cores busy, come last and are split over both workers once
# the chaos run is over; each worker starts the shared cluster at most once.
LONGEST_FIRST = ("test_chaos_run.py",)


def pytest_configure(config):
    # Processes the tests start themselves (ranks without Ray, replays) are forked from a
    # server that imported these once (rayflex.testing.processes; ~2-4 CPU-s a process).
    from rayflex.testing.processes import preload

    preload(["rayflex.models.hf", "rayflex.checkpoint.checkpointer",
             "transformers.models.llama.modeling_llama", "transformers.models.gpt2.modeling_gpt2"])


def pytest_collection_modifyitems(items):
    """The chaos run first, then unit tests (fast feedback), then the tests that bring
    their own cluster, then every test on the shared cluster (it starts once per worker)."""
    def group(item):
        if item.path.name in LONGEST_FIRST:
            return -1
        if "two_node_cluster" in item.fixturenames:
            return 2
        return 1 if item.get_closest_marker("cluster") else 0
    items.sort(key=group)  # stable: the file order stays within a group


def pytest_runtest_setup(item):
    if item.get_closest_marker("cluster") and "two_node_cluster" not in item.fixturenames:
        SHARED.close()  # it may start a Ray of its own in this process


def pytest_sessionfinish(session, exitstatus):
    SHARED.close()


def run_events(tmp_path, name: str, file: str = "events.jsonl") -> list[dict]:
    """The typed events a run wrote to ``{tmp_path}/runs/{name}/events.jsonl`` (or the
    lines of another of its files: ``metrics.jsonl``)."""
    import json

    path = tmp_path / "runs" / name / file
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


def wait_then_end_frozen(handle, pid: int, timeout_s: float = 240):
    """The run's result once it ends; then the SIGSTOPped process ``pid`` is continued and
    killed whatever happened: a test never leaves a stopped process behind."""
    import os
    import signal

    try:
        return handle.wait(timeout_s=timeout_s)
    finally:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.1):
    """Poll ``predicate`` until it returns something truthy (returned), or fail naming ``what``."""
    import time

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
