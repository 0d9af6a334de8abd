"""The Ray daemons rayflex starts run with its lean housekeeping (``LEAN_RAY_ENV``).

A file of its own: a test on the shared cluster leaves Ray connected in this process, which
the unit tests that run before the cluster tests must not find (``tests/conftest.py``)."""

import pytest

from rayflex import local_ray

pytestmark = pytest.mark.cluster


def test_the_started_daemons_run_with_it(two_node_cluster):
    import psutil

    raylets = [p for p in psutil.Process().children(recursive=True) if p.name() == "raylet"]
    assert len(raylets) == 2, raylets
    for raylet in raylets:
        env = raylet.environ()
        assert {k: env.get(k) for k in local_ray.LEAN_RAY_ENV} == local_ray.LEAN_RAY_ENV
