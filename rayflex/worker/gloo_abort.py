"""Abort for gloo process groups: shut down the TCP connections they own.

Gloo has no working abort: ``ProcessGroupGloo.abort()``/``shutdown()`` and
``destroy_process_group`` do not unblock a collective that is already waiting, and a
group's destructor waits for its pending work. After a peer dies, two survivors can be
left in *different* pending collectives (FSDP issues several asynchronously), each
waiting on data the other will never send; neither errors until the collective timeout
(minutes). Shutting the sockets down is the abort gloo lacks: every pending read/write on
them fails at once, here and in the peers at the other end.

Which sockets are gloo's: every group opens a listener while it is created, and every
connection of the group either was accepted on one of those listeners or connects to a
peer's. ``GlooSockets`` notes the sockets that exist before the groups are created, then
publishes this rank's new listeners in the rendezvous store and reads everyone's. Ray's
own connections (gRPC to the raylet, GCS and other workers) never match, so aborting
leaves the actor reachable.

Which groups are gloo (``worker/process_groups.py``): on CPU every group of an attempt
(the default one, the device mesh's, the checkpoint group); on GPU the control and
checkpoint groups, created after NCCL's default group, so the snapshot is taken between
the two and NCCL's own sockets (created lazily, after ``register``) are never counted.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from typing import Iterable

log = logging.getLogger(__name__)

_LISTEN = "0A"
_CLOSED_STATES = {"07"}  # TCP_CLOSE: nothing left to shut down
_STORE_PREFIX = "rayflex/gloo_listeners/"


def _socket_fds() -> dict[int, int]:
    """inode -> fd for this process's sockets."""
    out: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:  # no /proc (not Linux): nothing to abort, collectives end at their timeout
        return out
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed while listing
            continue
        if target.startswith("socket:["):
            out[int(target[8:-1])] = int(name)
    return out


def _parse_addr(hex_addr: str) -> tuple[str, int]:
    ip_hex, port_hex = hex_addr.split(":")
    raw = bytes.fromhex(ip_hex)
    if len(raw) == 4:
        ip = socket.inet_ntop(socket.AF_INET, raw[::-1])
    else:  # /proc/net/tcp6 prints four little-endian 32-bit words
        words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
        ip = socket.inet_ntop(socket.AF_INET6, words)
        if ip.startswith("::ffff:"):
            ip = ip[7:]
    return ip, int(port_hex, 16)


def _tcp_table() -> dict[int, tuple[tuple[str, int], tuple[str, int], str]]:
    """inode -> (local, remote, state) for every TCP socket in this network namespace."""
    table = {}
    for path in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(path) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) < 10:
                continue
            table[int(cols[9])] = (_parse_addr(cols[1]), _parse_addr(cols[2]), cols[3])
    return table


def _wildcard(ip: str) -> bool:
    return ip in ("0.0.0.0", "::")


class GlooSockets:
    """The TCP connections of the gloo groups this process creates after construction."""

    def __init__(self):
        self._before = set(_socket_fds())
        self._listeners: set[tuple[str, int]] = set()  # every rank's, after register()
        self._own_ports: set[int] = set()  # fixed at register(): later listeners (nccl's) are not gloo's

    def own_listeners(self) -> list[tuple[str, int]]:
        fds = _socket_fds()
        table = _tcp_table()
        return sorted({table[i][0] for i in fds if i not in self._before and i in table and table[i][2] == _LISTEN})

    def register(self, store, rank: int, world_size: int) -> None:
        """Publish this rank's listeners and learn everyone's (a barrier over ``store``)."""
        own = self.own_listeners()
        self._own_ports = {port for _, port in own}
        store.set(f"{_STORE_PREFIX}{rank}", json.dumps(own))
        for peer in range(world_size):
            for ip, port in json.loads(store.get(f"{_STORE_PREFIX}{peer}")):
                self._listeners.add((ip, port))

    def _is_gloo(self, local: tuple[str, int], remote: tuple[str, int]) -> bool:
        if local[1] in self._own_ports:
            return True  # accepted on one of our listeners (or the listener itself)
        for ip, port in self._listeners:
            if remote[1] == port and (_wildcard(ip) or remote[0] == ip):
                return True
        return False

    def connections(self) -> list[int]:
        """File descriptors of this process's live gloo sockets."""
        fds = _socket_fds()
        table = _tcp_table()
        out = []
        for inode, fd in fds.items():
            if inode in self._before or inode not in table:
                continue
            local, remote, state = table[inode]
            # Listeners are left alone: gloo's event loop does not survive a failed accept().
            if state != _LISTEN and state not in _CLOSED_STATES and self._is_gloo(local, remote):
                out.append(fd)
        return out

    def abort(self) -> int:
        """Shut every gloo connection down: pending collectives here and in the peers fail
        now. The descriptors stay open (gloo still owns them); returns how many."""
        return shutdown_fds(self.connections())


def shutdown_fds(fds: Iterable[int]) -> int:
    n = 0
    for fd in fds:
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            sock.shutdown(socket.SHUT_RDWR)
            n += 1
        except OSError:  # not connected (a listener) or already gone
            pass
        finally:
            sock.detach()  # gloo owns the descriptor; closing it here could hit a reused fd
    return n
