"""PreemptionWatcher: spot-termination notices from several sources, as typed notices.

Sources (each a small class with ``poll() -> list[Notice]``):

* :class:`RayDrainSource` — nodes Ray is draining with a deadline. Ray's autoscaler drains
  a spot node it is told will be terminated (reason PREEMPTION); ``ray drain-node`` does the
  same by hand. The deadline comes with the drain.
* :class:`MetadataSource` — a tiny agent actor on each node that hosts workers polls the
  cloud's instance metadata: AWS ``spot/instance-action`` (JSON with the termination time;
  404 while there is none; IMDSv2 token when available) or GCP ``instance/preempted``
  (``TRUE`` about 30 s before). The URL is configurable (``{node_id}`` / ``{node_ip}`` are
  substituted), so tests point it at a local HTTP server on 127.0.0.1. GCP's server answers
  403 to a request without ``Metadata-Flavor: Google``; a response that can carry no notice
  (403, 404, a body that is neither ``TRUE`` nor ``FALSE``) is logged as a warning that says
  what to change, since otherwise the source would sit silent until the VM is gone. The
  agent polls plain GETs rather than ``?wait_for_change=true``: a hanging GET without the
  last ``ETag`` misses a change made between two requests, and a poll every few hundred
  ms is well inside GCP's 30 s.
* :class:`NoticeFileSource` — a JSON file ``{"node_id": ..., "deadline": <epoch s>}`` (or a
  list of them) written by an operator or a test.

The watcher reports each node once; the controller decides what to do (checkpoint now, or
fall back to the last committed checkpoint when the deadline is too close).
"""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from typing import Optional

log = logging.getLogger(__name__)

GCP_NOTICE_S = 30.0  # GCP gives ~30 s between the preempted flag and the stop
# What to set on a GCE VM: ElasticConfig(metadata_kind="gcp", metadata_url=GCP_PREEMPTED_URL).
GCP_PREEMPTED_URL = "http://metadata.google.internal/computeMetadata/v1/instance/preempted"


@dataclass(frozen=True)
class Notice:
    node_id: str
    deadline: float  # epoch seconds
    source: str

    def seconds_left(self, now: Optional[float] = None) -> float:
        return self.deadline - (now or time.time())


class RayDrainSource:
    """Nodes Ray reports as draining (with a deadline in ms; 0 means none given)."""

    def __init__(self, default_notice_s: float = 30.0):
        self.default_notice_s = default_notice_s

    def poll(self) -> list[Notice]:
        try:
            from ray._private.state import state

            draining = state.get_draining_nodes()
        except Exception as e:  # noqa: BLE001 - an older/newer Ray without the accessor
            log.debug("draining nodes unavailable: %s", e)
            return []
        now = time.time()
        return [Notice(node_id=n, deadline=(ms / 1000.0) if ms else now + self.default_notice_s,
                       source="ray-drain") for n, ms in draining.items()]


def parse_metadata_response(kind: str, status: int, body: str, now: float) -> Optional[float]:
    """The termination deadline in a metadata response, or None when there is no notice."""
    if status != 200:
        return None
    if kind == "gcp":
        return now + GCP_NOTICE_S if body.strip().upper() == "TRUE" else None
    try:
        doc = json.loads(body)
    except json.JSONDecodeError:
        return None
    if doc.get("action") not in ("terminate", "stop", "hibernate"):
        return None
    when = doc.get("time")
    try:
        return datetime.fromisoformat(when.replace("Z", "+00:00")).timestamp() if when else now + 120.0
    except (AttributeError, ValueError):
        return now + 120.0


def metadata_problem(kind: str, url: str, status: int, body: str, flavor: str = "") -> Optional[str]:
    """Why a metadata response can never carry a notice, or None for an ordinary answer.

    ``flavor`` is the response's ``Metadata-Flavor`` header: GCP's server sends ``Google``,
    which tells a GCP endpoint polled with the AWS settings apart from a broken one.
    """
    where = f"metadata endpoint {url}"
    snippet = " ".join(body.split())[:160]
    if kind != "gcp" and flavor == "Google":
        return (f"{where} is GCP's metadata server (HTTP {status}) but metadata_kind is {kind!r}; "
                f"set ElasticConfig(metadata_kind='gcp', metadata_url='{GCP_PREEMPTED_URL}')")
    if kind != "gcp":
        return None
    if status == 200:
        if body.strip().upper() in ("TRUE", "FALSE"):
            return None
        return (f"{where} answered 200 with {snippet!r}, not TRUE or FALSE; "
                f"point metadata_url at {GCP_PREEMPTED_URL}")
    if status == 403:
        return (f"{where} answered 403 Forbidden ({snippet!r}): GCP's metadata server refuses requests "
                "without the header 'Metadata-Flavor: Google'. rayflex sends it with metadata_kind='gcp': "
                "check that no HTTP proxy sits between the node and the server (put "
                "metadata.google.internal in NO_PROXY) and that the endpoint is not disabled for this VM")
    if status == 404:
        return f"{where} answered 404: no such metadata key; use {GCP_PREEMPTED_URL}"
    return f"{where} answered HTTP {status} ({snippet!r}); spot notices from it are lost until it answers 200"


class NoticeAgent:
    """Runs on one node (a Ray actor pinned there); polls that node's metadata endpoint."""

    def __init__(self, url: str, kind: str = "aws", timeout_s: float = 0.5):
        import ray

        self.node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"
        ip = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        self.url = url.format(node_id=self.node_id, node_ip=ip)
        self.kind = kind
        self.timeout_s = timeout_s
        # The last problem logged: polls come every few hundred ms, so each is said once.
        self.problem: Optional[str] = None
        if kind == "gcp" and "wait_for_change" in self.url:
            # Each poll would hang past its timeout and report nothing (see the module docstring).
            self.problem = (f"metadata endpoint {self.url}: wait_for_change holds each request open longer "
                            f"than the {timeout_s} s poll timeout, so no answer arrives; "
                            f"drop the query and use {GCP_PREEMPTED_URL}")
            log.warning("node %s: %s", self.node_id, self.problem)

    def _token(self) -> Optional[str]:
        """IMDSv2 session token (AWS); None where the endpoint has no token API."""
        if self.kind != "aws":
            return None
        base = self.url.split("/latest/")[0] if "/latest/" in self.url else None
        if base is None:
            return None
        req = urllib.request.Request(f"{base}/latest/api/token", method="PUT",
                                     headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                return r.read().decode()
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def check(self) -> Optional[dict]:
        headers = {"Metadata-Flavor": "Google"} if self.kind == "gcp" else {}
        token = self._token()
        if token:
            headers["X-aws-ec2-metadata-token"] = token
        try:
            with urllib.request.urlopen(urllib.request.Request(self.url, headers=headers),
                                        timeout=self.timeout_s) as r:
                status, flavor = r.status, r.headers.get("Metadata-Flavor", "")
                body = r.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            status, flavor = e.code, (e.headers.get("Metadata-Flavor", "") if e.headers else "")
            try:
                body = e.read().decode(errors="replace")
            except OSError:
                body = ""
        except (urllib.error.URLError, OSError, ValueError):
            return None
        problem = metadata_problem(self.kind, self.url, status, body, flavor)
        if problem is not None and problem != self.problem:
            log.warning("node %s: %s", self.node_id, problem)
        self.problem = problem
        deadline = parse_metadata_response(self.kind, status, body, time.time())
        return None if deadline is None else {"node_id": self.node_id, "deadline": deadline}


class MetadataSource:
    """One NoticeAgent per node that hosts workers; polled asynchronously."""

    def __init__(self, url: str, kind: str = "aws"):
        self.url, self.kind = url, kind
        self.agents: dict[str, object] = {}
        self._inflight: dict[str, object] = {}

    def watch_nodes(self, node_ids: set[str]) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        for node in node_ids - set(self.agents):
            cls = ray.remote(num_cpus=0)(NoticeAgent)
            self.agents[node] = cls.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False)).remote(self.url, self.kind)

    def poll(self) -> list[Notice]:
        import ray

        for node, agent in self.agents.items():
            if node not in self._inflight:
                self._inflight[node] = agent.check.remote()
        ready, _ = ray.wait(list(self._inflight.values()), num_returns=len(self._inflight), timeout=0)
        out = []
        for node, ref in list(self._inflight.items()):
            if ref in ready:
                del self._inflight[node]
                try:
                    found = ray.get(ref)
                except Exception:  # noqa: BLE001 - the node (and its agent) may be gone already
                    continue
                if found:
                    out.append(Notice(node_id=found["node_id"], deadline=found["deadline"], source="metadata"))
        return out

    def close(self) -> None:
        from rayflex.group.actors import kill_quietly

        for agent in self.agents.values():
            kill_quietly(agent)
        self.agents.clear()


class NoticeFileSource:
    def __init__(self, path: str):
        self.path = path

    def poll(self) -> list[Notice]:
        try:
            with open(self.path) as f:
                doc = json.load(f)
        except (FileNotFoundError, json.JSONDecodeError):
            return []
        items = doc if isinstance(doc, list) else [doc]
        return [Notice(node_id=str(d["node_id"]), deadline=float(d.get("deadline") or time.time() + 30),
                       source=f"file:{os.path.basename(self.path)}") for d in items if "node_id" in d]


class PreemptionWatcher:
    """Polls every source; reports each node's first notice once."""

    def __init__(self, sources: list):
        self.sources = sources
        self.seen: set[str] = set()

    def watch_nodes(self, node_ids: set[str]) -> None:
        for s in self.sources:
            if hasattr(s, "watch_nodes"):
                s.watch_nodes(node_ids)

    def poll(self) -> list[Notice]:
        out = []
        for source in self.sources:
            for notice in source.poll():
                if notice.node_id not in self.seen:
                    self.seen.add(notice.node_id)
                    out.append(notice)
        return out

    def close(self) -> None:
        for s in self.sources:
            if hasattr(s, "close"):
                s.close()
