"""Aborting a rank's gloo connections fails collectives that can no longer complete.

After a peer dies, two survivors can each wait in a collective for data the other will
never send; gloo itself would keep them there until the collective timeout. Plain
processes, no Ray: ranks 1 and 2 wait on each other (each in its own recv); rank 1 aborts.
"""

import socket
import time

import pytest

from rayflex.testing.processes import ForkedContext
from rayflex.local_ray import free_ports

TIMEOUT_S = 60  # the collective timeout: an abort that does not work shows as a wait this long


def _rank(rank: int, world: int, port: int, abort_after_s, results):
    import datetime
    import threading

    import torch
    import torch.distributed as dist

    from rayflex.worker.gloo_abort import GlooSockets

    torch.set_num_threads(1)
    sockets = GlooSockets()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    extra = dist.new_group(backend="gloo")  # every group's connections are found, not just the default's
    sockets.register(dist.distributed_c10d._get_default_store(), rank, world)
    out = {"connections": len(sockets.connections())}
    dist.barrier(group=extra)
    if rank == 0:  # the bystander stays up so nothing closes by itself
        time.sleep(abort_after_s + 3)  # the pair fails and tears down well within that
        results.put((rank, out))
        return
    if rank == 1:
        threading.Timer(abort_after_s, lambda: out.__setitem__("aborted", sockets.abort())).start()
    t0 = time.time()
    try:
        dist.recv(torch.zeros(1), src=3 - rank)
        out["recv"] = "returned"
    except RuntimeError as e:
        out["recv"] = "raised"
        out["error"] = str(e)
    out["waited_s"] = time.time() - t0
    t0 = time.time()
    del extra
    dist.destroy_process_group()
    out["destroy_s"] = time.time() - t0
    results.put((rank, out))


@pytest.mark.multiproc
def test_abort_unblocks_both_ends_of_a_deadlocked_pair():
    ctx = ForkedContext()
    results = ctx.Queue()
    port, world, abort_after = free_ports(1)[0], 3, 2.0
    procs = [ctx.Process(target=_rank, args=(r, world, port, abort_after, results)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=TIMEOUT_S) for _ in range(world))
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]  # the aborting rank did not crash
    assert got[1]["aborted"] >= 2, got[1]  # both groups' connections to its peers
    for r in (1, 2):
        assert got[r]["recv"] == "raised", got[r]
        assert "closed" in got[r]["error"].lower(), got[r]["error"]
        # Failed at the abort, not at the collective timeout (the only other way out: the
        # abort fires 2 s in, the timeout 60 s in, whatever the host's speed).
        assert got[r]["waited_s"] < TIMEOUT_S / 2, got[r]
        assert got[r]["destroy_s"] < TIMEOUT_S / 2, got[r]


class _DictStore:
    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value.encode()

    def get(self, key):
        return self.data[key]


@pytest.mark.multiproc
def test_other_connections_are_left_alone():
    """Connections that are not a group's (Ray's gRPC, here a plain server and client) are
    never shut down, even when opened while the groups are being created."""
    from rayflex.worker.gloo_abort import GlooSockets

    server = socket.socket()  # a server that was up before (the raylet, another worker)
    server.bind(("127.0.0.1", 0))
    server.listen()
    sockets = GlooSockets()
    client = socket.create_connection(server.getsockname())  # opened during setup
    conn, _ = server.accept()
    try:
        sockets.register(_DictStore(), rank=0, world_size=1)
        assert sockets.own_listeners() == []
        assert sockets.connections() == []
        assert sockets.abort() == 0
        client.sendall(b"x")  # still connected both ways
        assert conn.recv(1) == b"x"
    finally:
        for s in (conn, client, server):
            s.close()
