"""Rank 0's rendezvous port is held from the moment it is offered to the controller until
its store serves it: no other process on the node can take it in between (a port that was
only free when picked was taken once in CI, and the attempt's start failed, EADDRINUSE)."""

import errno
import socket
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest

from rayflex.worker.rendezvous import RendezvousPort, rendezvous_store


def test_the_offered_port_cannot_be_taken_before_the_store_serves_it():
    held = RendezvousPort()
    intruder = socket.socket()
    with pytest.raises(OSError) as err:
        intruder.bind(("", held.port))
    intruder.close()
    assert err.value.errno == errno.EADDRINUSE
    timeout = timedelta(seconds=20)
    with ThreadPoolExecutor(1) as pool:  # rank 0's store waits for rank 1 to join
        joining = pool.submit(rendezvous_store, "127.0.0.1", held.port, rank=1, world_size=2, timeout=timeout)
        server = rendezvous_store("127.0.0.1", held.port, rank=0, world_size=2, timeout=timeout, held=held)
        client = joining.result()
    client.set("from-rank-1", "hello")
    assert server.get("from-rank-1") == b"hello"
    assert held.take() is None, "the socket belongs to the store now"


def test_a_port_offered_for_an_attempt_that_never_started_is_let_go():
    held = RendezvousPort()
    port = held.port
    held.close()
    s = socket.socket()
    s.bind(("", port))  # free again
    s.close()
