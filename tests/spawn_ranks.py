"""Run a function in ``world`` forked processes (no Ray), each told its rank and a free
rendezvous port, and collect what each returned; a rank's exception fails the test with
its traceback."""

from __future__ import annotations

import traceback

from rayflex.testing.processes import ForkedContext

from rayflex.local_ray import free_ports


def run_ranks(target, world: int, *args, timeout_s: float = 60) -> dict:
    """``target(rank, world, port, *args)`` in ``world`` spawned processes; rank -> answer.
    ``target`` must be importable (a module-level function of a test module)."""
    ctx = ForkedContext()
    results = ctx.Queue()
    port = free_ports(1)[0]
    procs = [ctx.Process(target=_entry, args=(target, r, world, port, args, results)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=timeout_s) for _ in range(world))
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    errors = {r: a["exception"] for r, a in got.items() if isinstance(a, dict) and "exception" in a}
    assert not errors, "\n".join(f"rank {r}:\n{e}" for r, e in errors.items())
    return got


def _entry(target, rank, world, port, args, results) -> None:
    import torch

    torch.set_num_threads(1)
    try:
        out = target(rank, world, port, *args)
    except BaseException:  # noqa: BLE001 - reported to the test with its traceback
        out = {"exception": traceback.format_exc()}
    results.put((rank, out))


class JobPorts:
    """Rendezvous ports for a pool that runs several jobs in turn: rank 0 picks each job's
    port when the job starts and tells the job's other ranks. Ports picked up front can be
    taken by another process before a later job binds them (a loopback Ray cluster of a
    parallel test starts many): the job's ranks then reach that process instead ("Connection
    reset by peer") and the pool waits out its timeout."""

    def __init__(self, world: int) -> None:
        ctx = ForkedContext()  # run_ranks's: the queues travel to its processes
        self._queues = [ctx.Queue() for _ in range(world)]

    def port(self, rank: int, ranks: int, job: str, timeout_s: float = 120) -> int:
        """The port of ``job``, run by ranks ``0..ranks-1``."""
        if rank == 0:
            port = free_ports(1)[0]
            for q in self._queues[1:ranks]:
                q.put((job, port))
            return port
        got, port = self._queues[rank].get(timeout=timeout_s)
        assert got == job, f"rank {rank} expected the port of {job!r}, rank 0 sent {got!r}'s"
        return port

