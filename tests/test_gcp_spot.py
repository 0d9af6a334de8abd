"""GCP Spot: the cluster-launcher file passes Ray's validator, and the preemption notice
source reads GCP's metadata server as GCP really answers (a fake one on 127.0.0.1).

GCP's documented format: ``GET /computeMetadata/v1/instance/preempted`` with the header
``Metadata-Flavor: Google`` answers ``FALSE`` or ``TRUE`` as text (``TRUE`` about 30 s
before the VM is stopped), and every answer carries ``Metadata-Flavor: Google``; a request
without the header gets 403 Forbidden.
"""

import copy
import dataclasses
import logging
import pathlib
import re
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

from rayflex.config import ElasticConfig, apply_override
from rayflex.faults.preemption import GCP_NOTICE_S, GCP_PREEMPTED_URL, NoticeAgent

GCP_YAML = pathlib.Path(__file__).resolve().parent.parent / "examples" / "clusters" / "gcp-spot.yaml"
PREEMPTED_PATH = "/computeMetadata/v1/instance/preempted"


class _FakeGCPMetadata(BaseHTTPRequestHandler):
    """Answers instance/preempted like Compute Engine's metadata server (``server.preempted``)."""

    def _answer(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Metadata-Flavor", "Google")
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.headers.get("Metadata-Flavor") != "Google":
            self._answer(403, b"<html><body>Your client does not have permission to get URL "
                              b"<code>" + self.path.encode() + b"</code> from this server. "
                              b"Missing Metadata-Flavor:Google header.</body></html>", "text/html")
        elif self.path.split("?")[0] != PREEMPTED_PATH:
            self._answer(404, b"Not Found", "text/html")
        else:
            self._answer(200, b"TRUE" if self.server.preempted else b"FALSE", "application/text")

    def log_message(self, *args):
        pass


@pytest.fixture
def gcp_metadata():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeGCPMetadata)
    server.preempted = False
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server, f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_fake_server_answers_like_gcp(gcp_metadata):
    """The fake itself: text FALSE with the header, 403 naming the header without it."""
    _, base = gcp_metadata
    req = urllib.request.Request(base + PREEMPTED_PATH, headers={"Metadata-Flavor": "Google"})
    with urllib.request.urlopen(req, timeout=5) as r:
        assert (r.status, r.read(), r.headers["Metadata-Flavor"]) == (200, b"FALSE", "Google")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(base + PREEMPTED_PATH, timeout=5)
    assert err.value.code == 403 and b"Missing Metadata-Flavor:Google header" in err.value.read()


def test_false_is_no_notice_and_true_is_a_notice_30s_out(gcp_metadata, caplog):
    server, base = gcp_metadata
    agent = NoticeAgent(base + PREEMPTED_PATH, kind="gcp", timeout_s=5)
    with caplog.at_level(logging.WARNING, logger="rayflex.faults.preemption"):
        assert agent.check() is None
        server.preempted = True
        before = time.time()
        notice = agent.check()
        after = time.time()
    assert notice is not None and notice["node_id"] == "local"
    assert before + GCP_NOTICE_S <= notice["deadline"] <= after + GCP_NOTICE_S
    assert GCP_NOTICE_S == pytest.approx(30.0)
    assert not caplog.records  # ordinary answers are not warnings


def test_missing_header_is_a_403_the_source_names(gcp_metadata, caplog):
    """A GCP endpoint polled with the AWS settings sends no Metadata-Flavor header: the
    server refuses, and the warning says to switch metadata_kind rather than staying silent."""
    server, base = gcp_metadata
    server.preempted = True  # even a real notice cannot get through without the header
    agent = NoticeAgent(base + PREEMPTED_PATH, kind="aws", timeout_s=5)
    with caplog.at_level(logging.WARNING, logger="rayflex.faults.preemption"):
        assert agent.check() is None
        assert agent.check() is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings  # said once, not on every poll
    assert "HTTP 403" in warnings[0] and "metadata_kind='gcp'" in warnings[0]
    assert GCP_PREEMPTED_URL in warnings[0] and "127.0.0.1" in warnings[0]


def test_wrong_gcp_path_is_reported(gcp_metadata, caplog):
    _, base = gcp_metadata
    agent = NoticeAgent(base + "/computeMetadata/v1/instance/preemptd", kind="gcp", timeout_s=5)
    with caplog.at_level(logging.WARNING, logger="rayflex.faults.preemption"):
        assert agent.check() is None
    (message,) = [r.getMessage() for r in caplog.records]
    assert "404" in message and GCP_PREEMPTED_URL in message


def test_wait_for_change_in_the_url_is_reported(caplog):
    """The agent polls; a hanging ?wait_for_change=true request would time out every poll."""
    with caplog.at_level(logging.WARNING, logger="rayflex.faults.preemption"):
        NoticeAgent("http://127.0.0.1:9" + PREEMPTED_PATH + "?wait_for_change=true", kind="gcp")
    (message,) = [r.getMessage() for r in caplog.records]
    assert "wait_for_change" in message and GCP_PREEMPTED_URL in message


def test_gcp_yaml_validates_with_rays_validator():
    from ray.autoscaler._private.commands import prepare_config
    from ray.autoscaler._private.util import validate_config

    config = yaml.safe_load(GCP_YAML.read_text())
    validate_config(prepare_config(copy.deepcopy(config)))  # what `ray up` runs before launching


def test_gcp_yaml_has_on_demand_head_and_labelled_spot_gpu_workers():
    config = yaml.safe_load(GCP_YAML.read_text())
    assert config["provider"]["type"] == "gcp"
    zone = config["provider"]["availability_zone"]
    assert zone.startswith(config["provider"]["region"] + "-")
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["labels"]["ray.io/market-type"] == "on-demand"
    assert "scheduling" not in head["node_config"]  # standard provisioning
    spot = {n: t for n, t in types.items() if t.get("labels", {}).get("ray.io/market-type") == "spot"}
    assert len(spot) >= 2
    for t in spot.values():
        scheduling = t["node_config"]["scheduling"]
        assert scheduling["provisioningModel"] == "SPOT"
        assert scheduling["onHostMaintenance"] == "TERMINATE"  # GPU VMs cannot live-migrate
        assert t["node_config"]["machineType"].startswith(("a2-", "a3-", "g2-"))  # GPU machine types
        assert t["max_workers"] > t["min_workers"] >= 0
        assert t["labels"]["ray.io/availability-zone"] == zone
    assert len({t["labels"]["rack"] for t in spot.values()}) == len(spot)
    assert any(re.search(r'"torch==\d+\.\d+\.\d+"', cmd) for cmd in config["setup_commands"])


@pytest.mark.parametrize("breakage", ["typo", "number_label"])
def test_gcp_validator_rejects_a_broken_node_type(breakage):
    """The validation above can fail: a typo'd field, or a label written as a YAML number
    (`rack: 0` instead of `rack: "0"`), is refused by the same validator."""
    import jsonschema
    from ray.autoscaler._private.commands import prepare_config
    from ray.autoscaler._private.util import validate_config

    config = yaml.safe_load(GCP_YAML.read_text())
    node_type = config["available_node_types"]["spot-gpu-r0"]
    if breakage == "typo":
        node_type["max_worker"] = node_type.pop("max_workers")
    else:
        node_type["labels"]["rack"] = 0
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(config))


def test_the_documented_job_command_turns_on_the_gcp_notice():
    """The `--set elastic.*` flags in the file's header make a valid ElasticConfig for GCP."""
    text = GCP_YAML.read_text()
    sets = re.findall(r"--set (elastic\.\w+)=(\S+)", text)
    assert sets, "the header shows no --set elastic.* flags"
    cfg = ElasticConfig()
    for key, value in sets:
        cfg = apply_override(cfg, key.split(".", 1)[1], value)
    cfg = dataclasses.replace(cfg)  # re-validates
    assert (cfg.metadata_kind, cfg.metadata_url) == ("gcp", GCP_PREEMPTED_URL)
