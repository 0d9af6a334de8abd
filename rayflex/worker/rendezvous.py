"""Rank 0's rendezvous port: held from the moment it is offered until its store serves it.

The controller asks rank 0 for an address (``TrainWorker.node_info``) and hands it to
every rank's ``setup``. A port that was merely free when rank 0 picked it can be taken by
any process on the node before rank 0's store binds it (``EADDRINUSE``; seen once in CI,
where it failed the attempt's start). So rank 0 binds and listens at once, and its
TCPStore adopts that very socket (``master_listen_fd``): the port is never free between.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any, Optional


class RendezvousPort:
    """A listening socket on a port the kernel chose, until a store takes it over."""

    def __init__(self) -> None:
        self._sock: Optional[socket.socket] = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("", 0))
        self._sock.listen(512)
        self.port: int = self._sock.getsockname()[1]

    def take(self) -> Optional[int]:
        """The socket's file descriptor, handed over (the store closes it); None if taken."""
        sock, self._sock = self._sock, None
        return None if sock is None else sock.detach()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def rendezvous_store(master_addr: str, master_port: int, *, rank: int, world_size: int, timeout: timedelta,
                     held: Optional[RendezvousPort] = None) -> Any:
    """This rank's TCPStore for the attempt: rank 0 serves it on the port it holds (else
    binds ``master_port`` itself), the others connect to it."""
    import torch.distributed as dist

    fd = held.take() if rank == 0 and held is not None and held.port == master_port else None
    if fd is not None:
        return dist.TCPStore(master_addr, master_port, world_size, True, timeout, master_listen_fd=fd)
    return dist.TCPStore(master_addr, master_port, world_size, rank == 0, timeout)
