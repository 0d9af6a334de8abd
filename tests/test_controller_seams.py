"""The seams the controller acts through (``rayflex/control/seams.py``): the real cluster and
the tests' fakes provide every member, with parameters a caller of the seam can use, so
the controller tests drive what production drives."""

from __future__ import annotations

import inspect

import pytest

from rayflex.control import seams
from rayflex.control.cluster import RayCluster
from rayflex.group.reservation import RunPlacement
from rayflex.group.standby import StandbyPool
from rayflex.group.worker_group import RayWorkerGroup

from controller_fakes import FakeCluster, FakeGroup, FakeReservation, FakeStandbyPool

SEAMS = [(seams.Cluster, [RayCluster, FakeCluster]), (seams.WorkerGroup, [RayWorkerGroup, FakeGroup]),
         (seams.Reservation, [RunPlacement, FakeReservation]), (seams.StandbyPool, [StandbyPool, FakeStandbyPool])]


def _methods(protocol) -> dict:
    return {name: fn for name, fn in vars(protocol).items() if inspect.isfunction(fn) and not name.startswith("_")}


def _problems(protocol, cls) -> list[str]:
    out = []
    for name, declared in _methods(protocol).items():
        impl = inspect.getattr_static(cls, name, None)
        if impl is None:
            out.append(f"{cls.__name__}.{name} is missing")
            continue
        fn = impl.__func__ if isinstance(impl, (staticmethod, classmethod)) else impl
        want = [p for p in inspect.signature(declared).parameters.values() if p.name != "self"]
        have = {p.name: p for p in inspect.signature(fn).parameters.values() if p.name != "self"}
        variadic = any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in have.values())
        missing = [p.name for p in want if p.name not in have and p.kind is not p.VAR_POSITIONAL and not variadic]
        extra = [n for n, p in have.items() if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD,
                 p.KEYWORD_ONLY) and n not in {w.name for w in want}]
        if missing or extra:
            out.append(f"{cls.__name__}.{name}{inspect.signature(fn)} vs the seam's {inspect.signature(declared)}")
    return out


@pytest.mark.parametrize("protocol, implementations", SEAMS, ids=[p.__name__ for p, _ in SEAMS])
def test_the_cluster_and_its_fake_provide_every_member_of_the_seam(protocol, implementations):
    problems = [p for cls in implementations for p in _problems(protocol, cls)]
    assert not problems, "\n".join(problems)


def test_a_drifted_fake_is_caught():
    class Drifted:
        def topology(self, extra_required):  # a parameter callers of the seam never pass
            return None

    problems = _problems(seams.Cluster, Drifted)
    assert any("topology" in p for p in problems) and any("alive_nodes is missing" in p for p in problems)
