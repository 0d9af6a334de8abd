"""Port choice for every Ray rayflex starts (no cluster here: the choice itself)."""

import socket

from rayflex import local_ray


def test_free_ports_skip_rays_fixed_defaults(monkeypatch):
    """Even when the OS hands out a Ray default (52365 is inside Linux's ephemeral
    range), it is never chosen, and the ports chosen differ."""
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

