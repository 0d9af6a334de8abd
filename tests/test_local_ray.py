"""Port choice for every Ray rayflex starts (no cluster here: the choice itself)."""

import socket
import unittest.mock as mock

from rayflex import local_ray


def test_free_ports_are_never_what_the_kernel_hands_out_meanwhile():
    """A chosen port is bound later, often by another process; meanwhile every listener on
    port 0 and every outbound connection on the host takes a port the kernel picks. None of
    those can be a chosen one, so the caller's bind finds it still free."""
    chosen = set(local_ray.free_ports(8))
    assert len(chosen) == 8 and not chosen & local_ray.RAY_DEFAULT_PORTS
    taken = []
    try:
        for _ in range(300):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            taken.append(s)
            assert s.getsockname()[1] not in chosen
    finally:
        for s in taken:
            s.close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", min(chosen)))


def test_a_drawn_port_that_is_taken_is_drawn_again():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        busy, free = holder.getsockname()[1], local_ray.free_ports(1)[0]
        draws = iter([busy, busy, free])

        class Draw:
            def choice(self, _range):
                return next(draws)

        with mock.patch.object(local_ray, "_unassigned_port_range", return_value=range(1, 2)), \
                mock.patch.object(local_ray.random, "SystemRandom", Draw):
            assert local_ray.free_ports(1) == [free]


def test_free_ports_skip_rays_fixed_defaults(monkeypatch):
    """Where the kernel must choose (no room below its ephemeral range), a Ray default it
    hands out (52365 is inside Linux's ephemeral range) is never chosen, and the ports
    chosen differ."""
    monkeypatch.setattr(local_ray, "_unassigned_port_range", lambda: None)
    handed_out = iter([52365, 6379, 41001, 8265, 41002, 10001, 41003])

    class FakeSocket:
        def __init__(self, *args):
            self.port = None

        def bind(self, addr):
            assert addr == ("127.0.0.1", 0)
            self.port = next(handed_out)

        def getsockname(self):
            return ("127.0.0.1", self.port)

        def close(self):
            pass

    monkeypatch.setattr(local_ray.socket, "socket", FakeSocket)
    assert local_ray.free_ports(3) == [41001, 41002, 41003]


def test_every_port_with_a_default_is_pinned():
    head = local_ray.head_node_args(2, labels={"rack": "r0"})
    ports = [head["gcs_server_port"], head["dashboard_agent_listen_port"]]
    assert len(set(ports)) == 2 and not set(ports) & local_ray.RAY_DEFAULT_PORTS
    assert head["node_ip_address"] == "127.0.0.1" and head["labels"] == {"rack": "r0"}
    with socket.socket() as s:  # the chosen ports are really free
        s.bind(("127.0.0.1", ports[0]))


def test_lean_housekeeping_is_set_unless_the_user_chose(monkeypatch):
    """Every Ray rayflex starts gets LEAN_RAY_ENV; a value the user set is kept."""
    for key in local_ray.LEAN_RAY_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("REPORTER_UPDATE_INTERVAL_MS", "1234")
    local_ray.head_node_args(1)
    import os

    assert os.environ["REPORTER_UPDATE_INTERVAL_MS"] == "1234"
    assert os.environ["RAY_task_events_report_interval_ms"] == local_ray.LEAN_RAY_ENV["RAY_task_events_report_interval_ms"]
    assert os.environ["RAY_event_stats"] == "0"

