"""`ray job submit` against a real Ray head with its job server, on loopback.

The head is started with ``ray start --head --block`` in its own session, in an isolated
temp dir, with every port chosen free (none of Ray's fixed defaults) and bound to 127.0.0.1, and with token
authentication (Ray 2.60) using a token of its own, so nothing else on the machine joins
it and it joins nothing. Teardown stops exactly the processes it started (never a bare
``ray stop``, which would stop every Ray on the machine).
"""

import contextlib
import functools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from rayflex.cli.main import main as rayflex_main
from rayflex.local_ray import LEAN_RAY_ENV, free_ports

from conftest import wait_for

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
WORKERS = 2  # two FSDP ranks: quick to start on a 2-core machine


# Job-server queries are HTTP calls to the head: polled every 0.5 s, not conftest's 0.1 s.
_wait_for = functools.partial(wait_for, interval_s=0.5)


def _pids_mentioning(marker: str) -> list[int]:
    """Processes whose command line or working directory names ``marker`` (our temp dir):
    the head's daemons, its workers and the job drivers (which run in the uploaded
    working dir under it): ours, and only ours."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(entry / "cwd") if marker not in cmd else ""
        except OSError:
            continue
        if marker in cmd or cwd.startswith(marker):
            out.append(int(entry.name))
    return out


class RayHead:
    """A `ray start --head` with the job server, its environment and its client commands."""

    def __init__(self, root: Path):
        self.root = root
        self.temp_dir = root / "ray"
        (gcs, dash, client, agent_http, agent_grpc, metrics, rt_env, nm, om) = free_ports(9)
        self.gcs_address = f"127.0.0.1:{gcs}"
        self.dashboard_url = f"http://127.0.0.1:{dash}"
        self.agent_url = f"http://127.0.0.1:{agent_http}"
        self.token_path = root / "auth_token"
        self.token_path.write_text(secrets.token_hex(32))
        self.token_path.chmod(0o600)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH"))}
        env.update({
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            # Token auth with our own token file: the head, the job drivers it spawns and
            # every client command below read it; ~/.ray/auth_token is never touched.
            "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token_path),
            # Job drivers inherit the head's PATH: `rayflex` and `python` are the venv's.
            "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}",
            "RAY_USAGE_STATS_ENABLED": "0",
        })
        # Ray's housekeeping that nothing here reads, made rarer, as in every Ray rayflex
        # starts (a value already set wins).
        env.update({k: v for k, v in LEAN_RAY_ENV.items() if k not in env})
        self.env = env
        self.cmd = [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
                    "--port", str(gcs), "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash),
                    "--ray-client-server-port", str(client), "--dashboard-agent-listen-port", str(agent_http),
                    "--dashboard-agent-grpc-port", str(agent_grpc), "--metrics-export-port", str(metrics),
                    "--runtime-env-agent-port", str(rt_env), "--node-manager-port", str(nm),
                    "--object-manager-port", str(om), "--num-cpus", "4", "--temp-dir", str(self.temp_dir),
                    "--disable-usage-stats"]
        self.proc = None

    def start(self, timeout_s: float = 90) -> "RayHead":
        self.log = open(self.root / "ray-start.log", "w")
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        _wait_for(lambda: self.proc.poll() is not None or (self.job_server_up() and self.job_agent_up()), timeout_s,
                  "the Ray job server and the head's job agent")
        if self.proc.poll() is not None:
            raise RuntimeError(f"ray start exited with {self.proc.returncode}:\n"
                               + (self.root / "ray-start.log").read_text()[-3000:])
        return self

    def job_server_up(self) -> bool:
        """The job server answers its REST API (polled over HTTP: a `ray job list` per poll
        would start a Python interpreter importing Ray, ~2 CPU-s, every half second)."""
        try:
            self._get("/api/jobs/")
        except OSError:  # refused, reset, or an HTTP error while the dashboard starts
            return False
        return True

    def job_agent_up(self) -> bool:
        """The head node's dashboard agent serves HTTP (it records its address for the job
        server right after). A job is submitted through it, and the job server waits only
        10 s for one (Ray's WAIT_AVAILABLE_AGENT_TIMEOUT): on a slow host the agent came up
        later than that after the job server, and the submission got "No available agent to
        submit job" (HTTP 500). Any HTTP answer means it is up; a refused connection, not."""
        try:
            with urllib.request.urlopen(f"{self.agent_url}/api/healthz", timeout=10):
                return True
        except urllib.error.HTTPError:
            return True
        except OSError:
            return False

    def ray(self, *args, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        cmd = [str(BIN / "ray"), *args]
        if args[0] == "job":
            cmd[3:3] = ["--address", self.dashboard_url]
        r = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
        return r

    def submit(self, working_dir: Path, entrypoint: list[str], env_vars: dict, submission_id: str) -> str:
        runtime_env = {"env_vars": {**env_vars, "RAY_JOB_STOP_WAIT_TIME_S": "60"}}
        self.ray("job", "submit", "--no-wait", "--submission-id", submission_id, "--working-dir", str(working_dir),
                 "--runtime-env-json", json.dumps(runtime_env), "--", *entrypoint, timeout=120)
        return submission_id

    def _get(self, path: str, method: str = "GET"):
        """A call to the job server's REST API with the token as a bearer header (what the
        `ray job` CLI sends; a CLI call costs seconds of Python start-up on this machine)."""
        req = urllib.request.Request(f"{self.dashboard_url}{path}", method=method,
                                     headers={"Authorization": f"Bearer {self.token_path.read_text().strip()}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    def job_info(self, job_id: str) -> dict:
        return self._get(f"/api/jobs/{job_id}")

    def wait_job(self, job_id: str, timeout_s: float, states=("SUCCEEDED", "FAILED", "STOPPED")) -> str:
        return _wait_for(lambda: (lambda s: s if s in states else None)(self.job_info(job_id)["status"]),
                         timeout_s, f"job {job_id} to reach {states}", interval_s=0.25)

    def stop_job(self, job_id: str) -> bool:
        """What `ray job stop --no-wait` sends (``JobSubmissionClient.stop_job``): its CLI
        costs ~2 CPU-s of start-up, while both ranks of the job train on."""
        return self._get(f"/api/jobs/{job_id}/stop", method="POST")["stopped"]

    def logs(self, job_id: str) -> str:
        """What `ray job logs` prints, from the same endpoint."""
        return self._get(f"/api/jobs/{job_id}/logs")["logs"]

    def stop(self) -> None:
        """Stop exactly what we started (what `ray stop` does, but only for the processes
        under our temp dir): SIGTERM, a grace period, then SIGKILL."""
        marker = str(self.temp_dir)
        pids = set(_pids_mentioning(marker))
        if self.proc is not None and self.proc.poll() is None:
            pids.add(self.proc.pid)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            _wait_for(lambda: not _pids_mentioning(marker), 3, "the head's processes to exit")
        for pid in _pids_mentioning(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        if getattr(self, "log", None):
            self.log.close()


@pytest.fixture(scope="module")
def ray_head():
    # A short root: Ray's socket paths live under the temp dir and must stay < 108 bytes.
    root = Path(tempfile.mkdtemp(prefix="rfjob-"))
    head = RayHead(root)
    try:
        yield head.start()
    finally:
        head.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def job_src(tmp_path_factory):
    """What a user uploads: a directory holding examples/gpt_small.py."""
    src = tmp_path_factory.mktemp("job-src")
    (src / "examples").mkdir()
    shutil.copy(REPO / "examples" / "gpt_small.py", src / "examples" / "gpt_small.py")
    return src


@pytest.fixture(scope="module")
def demo_env(tmp_path_factory):
    root = tmp_path_factory.mktemp("job-run")
    return {"RAYFLEX_DEMO_DATA": f"file://{root}/data", "RAYFLEX_DEMO_STORAGE": f"file://{root}/runs",
            "RAYFLEX_POLL_INTERVAL_S": "0.2"}, root


def _entrypoint(name: str, steps: int, *extra: str) -> list[str]:
    # min/max first: each --set is validated on its own (see the report on ScalingConfig).
    return ["rayflex", "run", "examples/gpt_small.py", "--steps", str(steps), "--name", name,
            "--set", f"scaling.min_workers={WORKERS}", "--set", f"scaling.num_workers={WORKERS}",
            "--set", f"scaling.max_workers={WORKERS}", *extra]


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def test_job_submit_stop_resubmit_runs_to_the_end(ray_head, job_src, demo_env, capsys):
    """A user's whole job lifecycle: submit, watch with `rayflex status`, `ray job stop`
    (the job server's stop call: a clean stop with a final checkpoint), resubmit the same
    name: it resumes and runs to the end, with its progress and result in the job's logs."""
    env, root = demo_env
    t0 = time.monotonic()

    def phase(what):  # shown with the output of a failing test: where the time went
        print(f"[{time.monotonic() - t0:6.1f}s] {what}", flush=True)

    name = "jobstop"
    run_dir = root / "runs" / name
    ckpts = f"file://{run_dir}/checkpoints"
    long = _entrypoint(name, 400, "--set", "checkpoint.every_steps=3")
    job = ray_head.submit(job_src, long, env, "rayflex-jobstop-1")
    phase("submitted")
    _wait_for(lambda: any(e["kind"] == "checkpoint_committed" for e in _jsonl(run_dir / "events.jsonl")),
              120, "a committed checkpoint", interval_s=0.5)

    phase("checkpoint committed")
    # `rayflex status` from another process finds the live run through its named Controller.
    status = subprocess.run([str(BIN / "rayflex"), "status", name, "--json"], capture_output=True, text=True,
                            timeout=60, env={**ray_head.env, "RAY_ADDRESS": ray_head.gcs_address})
    assert status.returncode == 0, status.stderr[-3000:]
    (row,) = json.loads(status.stdout)
    assert row["state"] == "RUNNING" and row["step"] >= 3 and row["target_steps"] == 400, row
    assert row["last_checkpoint"]["step"] >= 3 and 0 <= row["goodput"] <= 1

    phase("rayflex status answered")
    t_stop = time.monotonic()
    assert ray_head.stop_job(job) is True
    assert ray_head.wait_job(job, 60) == "STOPPED"
    # Within RAY_JOB_STOP_WAIT_TIME_S (60 s here, 3 s by default) of the stop request, so the
    # job server never had to SIGKILL the driver.
    assert time.monotonic() - t_stop < 60
    phase("job stopped")
    assert "SIGTERM: stopping run 'jobstop'" in ray_head.logs(job)
    # The driver stopped the run itself (SIGTERM handler): a final checkpoint, a result,
    # and no worker or placement group left behind.
    result = _wait_for(lambda: (run_dir / "result.json").exists() and
                       json.loads((run_dir / "result.json").read_text()), 30, "result.json")
    assert result["status"] == "stopped", result
    stopped_at = result["steps_completed"]
    events = _jsonl(run_dir / "events.jsonl")
    assert any(e["kind"] == "run_stopped" for e in events)
    _wait_for(lambda: _leftovers(ray_head) == {"actors": [], "placement_groups": []}, 60,
              "workers, controller and placement groups to be gone")

    phase("no leftovers")
    assert rayflex_main(["ckpt", "verify", ckpts]) == 0  # sizes and checksums of the newest commit
    assert f"ok: step {stopped_at}," in capsys.readouterr().out

    # Re-submit the same run name: it resumes from the stop checkpoint and finishes.
    job2 = ray_head.submit(job_src, _entrypoint(name, stopped_at + 3), env, "rayflex-jobstop-2")
    phase("resubmitted")
    state = ray_head.wait_job(job2, 150)
    phase(f"resubmitted job {state}")
    logs = ray_head.logs(job2)
    assert state == "SUCCEEDED", logs[-4000:]
    assert f"run '{name}' -> run directory" in logs and '"status": "finished"' in logs
    total = stopped_at + 3
    assert f"{name}: 100%" in logs and f"{total}/{total}" in logs  # the progress bar, in the job's logs
    events = _jsonl(run_dir / "events.jsonl")
    loaded = [e for e in events if e["kind"] == "checkpoint_loaded"]
    assert loaded and loaded[-1]["step"] == stopped_at
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "finished" and result["steps_completed"] == stopped_at + 3
    metrics = _jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, total + 1)), "every step once, across both jobs"
    assert metrics[-1]["loss"] < metrics[0]["loss"]


def _leftovers(head: RayHead) -> dict:
    """rayflex actors not DEAD and placement groups not REMOVED on the head: Ray's state API,
    from the dashboard's endpoints that ``ray.util.state.list_actors`` and
    ``list_placement_groups`` call (a fresh interpreter importing Ray for them cost ~1 CPU-s
    a poll)."""
    def listed(resource: str, never: str) -> list[dict]:
        query = urllib.parse.urlencode({"filter_keys": "state", "filter_predicates": "!=", "filter_values": never,
                                        "limit": 10000, "timeout": 30, "detail": "false"})
        reply = head._get(f"/api/v0/{resource}?{query}")
        assert reply["result"] is True, reply
        return reply["data"]["result"]["result"]

    actors = [a["class_name"] for a in listed("actors", "DEAD") if a["class_name"] in ("TrainWorkerActor", "Controller")]
    pgs = [p["placement_group_id"] for p in listed("placement_groups", "REMOVED")]
    return {"actors": actors, "placement_groups": pgs}
