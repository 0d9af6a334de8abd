"""A TCP gate in front of the S3 endpoint that the chaos run can close and reopen.

While it is down, new connections are refused (the listener is closed, so clients see
"connection refused" as from a dead endpoint) and open ones are cut. While it is stalled,
connections are accepted and kept but no byte is passed on either way (an endpoint that
stops answering: requests hang until their read timeouts, or until it resumes and they
complete late). The object store's data is untouched, so the endpoint comes back with
everything it had.
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Optional

log = logging.getLogger(__name__)


class S3Gate:
    def __init__(self, upstream_host: str, upstream_port: int, host: str = "127.0.0.1"):
        self.upstream = (upstream_host, upstream_port)
        self.host = host
        self.port = 0
        self._listener: Optional[socket.socket] = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._flowing = threading.Event()
        self._flowing.set()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def is_up(self) -> bool:
        return self._listener is not None

    def start(self) -> "S3Gate":
        self.up()
        return self

    def up(self) -> None:
        """Accept connections again (on the same port)."""
        with self._lock:
            if self._listener is not None:
                return
            listener = socket.socket()
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((self.host, self.port))
            listener.listen(128)
            self.port = listener.getsockname()[1]
            self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True, name="s3-gate").start()

    def down(self) -> None:
        """Refuse new connections and cut the open ones."""
        with self._lock:
            listener, self._listener = self._listener, None
            conns, self._conns = self._conns, set()
        if listener is not None:
            _close(listener)
        for c in conns:
            _close(c)

    def stall(self) -> None:
        """Stop answering: keep every connection (and accept new ones) but pass no byte on."""
        self._flowing.clear()

    def resume(self) -> None:
        """Pass bytes on again: what the stalled requests sent meanwhile goes through now."""
        self._flowing.set()

    @property
    def is_stalled(self) -> bool:
        return not self._flowing.is_set()

    def close(self) -> None:
        self._closed = True
        self._flowing.set()  # a stalled pipe thread ends with its sockets
        self.down()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed by down()
            try:
                upstream = socket.create_connection(self.upstream, timeout=10)
                upstream.settimeout(None)
            except OSError:
                _close(client)
                continue
            with self._lock:
                if self._listener is not listener:  # went down meanwhile
                    _close(client)
                    _close(upstream)
                    return
                self._conns.update((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                self._flowing.wait()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                _close(s)
            with self._lock:
                self._conns.discard(src)
                self._conns.discard(dst)


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass
