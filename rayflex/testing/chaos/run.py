"""One chaos run: a 4-node loopback cluster, a real S3 endpoint behind a gate, a seeded
sequence of faults of every kind while a model trains, then the invariants.

    python -m rayflex.testing.chaos --seed 1 --faults 12

Needs ``moto[server]`` (the S3 endpoint; installed with ``rayflex[test]``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Optional
from unittest import mock

from rayflex.telemetry import events as ev
from rayflex.testing.chaos.injector import FaultTiming, Injector, corrupt_newest_file
from rayflex.testing.chaos.schedule import SLOW_NODE, plan_faults

log = logging.getLogger(__name__)

AWS_TEST_ENV = {"AWS_ACCESS_KEY_ID": "rayflex-chaos", "AWS_SECRET_ACCESS_KEY": "rayflex-chaos",
                "AWS_DEFAULT_REGION": "us-east-1"}


@dataclass
class ChaosConfig:
    seed: int = 0
    faults: int = 12
    workers: int = 4
    nodes: int = 4
    cpus_per_node: int = 2
    # The step budget per fault: the run ends once every fault is in and recovered from
    # (it is stopped then), so this only caps a run whose recoveries take many steps.
    steps_per_fault: int = 40
    checkpoint_every: int = 5
    heartbeat_timeout_s: float = 3.0
    # True: a restart runs at once with the workers that are up and grows back once the
    # replacements are warm (two restarts per fault, the elastic path end to end); False:
    # it waits for them (one restart per fault: what a short CI seed can afford).
    restart_while_warming: bool = True
    # "sequential": each fault hits a healthy run; "overlap": every second fault lands
    # while the run is still recovering from the one before (overlap.py).
    mode: str = "sequential"
    # CheckpointConfig.memory_replicas: restarts read what they can from the keepers'
    # copies (the invariants are the same: bitwise equal to the storage replay).
    memory_replicas: int = 0
    # The run's ParallelConfig (None: FSDP over the workers). ``ParallelConfig(dp_shard=2)``
    # with 4 workers is HSDP, whose restarts recover from the survivors' memory when every
    # shard survived (the invariants are the same).
    parallel: Optional[Any] = None
    # The run's CommConfig (None: the default). ``CommConfig(replicate="diloco")`` with
    # ``ParallelConfig(dp_shard=...)``: replicas that train apart, whose restarts read the
    # checkpoint (each replica's own model and inner state; the invariants are the same).
    comm: Optional[Any] = None
    # True: one of the faults is a slow machine (``slow_node``): a node's processes held to
    # a tenth of a core for ``timing.slow_node_s``; the straggler signal must name it, the
    # straggler policy weigh it, and nothing else be named a straggler. Needs >= 3 workers
    # (a slow rank is told from the others) and sequential mode. The run's straggler knobs
    # are shortened as in tests/test_straggler_cluster.py (SLOW_NODE_KNOBS).
    slow_node: bool = False
    timing: FaultTiming = field(default_factory=FaultTiming)
    workdir: str = ""
    timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        self.kinds()  # fails early on too few faults
        if self.slow_node and (self.workers < 3 or self.mode != "sequential"):
            raise ValueError(f"slow_node needs >= 3 workers in sequential mode (got workers={self.workers}, "
                             f"mode={self.mode!r}): a straggler is named against the other ranks' steps")
        from rayflex.testing.chaos.overlap import MODES

        if self.mode not in MODES:
            raise ValueError(f"chaos mode {self.mode!r}: use one of {', '.join(MODES)}")
        if self.workers < 2 or self.nodes < 3:
            raise ValueError("a chaos run needs >= 2 workers and >= 3 nodes (one removed, the head kept)")
        if self.workers <= self.cpus_per_node:
            # The planner packs ranks onto as few nodes as it can: all of them could sit on
            # the head, which node faults spare (it runs the driver), and they would hit nothing.
            raise ValueError(f"workers={self.workers} fit on one node of cpus_per_node={self.cpus_per_node}: "
                             "node faults could find no rank off the head; use more workers than cpus_per_node")

    def kinds(self) -> list[str]:
        return plan_faults(self.seed, self.faults, (SLOW_NODE,) if self.slow_node else ())

    @property
    def steps(self) -> int:
        """The run's target (and the LR schedule's length); it is usually stopped earlier."""
        return 20 + self.faults * self.steps_per_fault


KNOBS = {"RAYFLEX_POLL_INTERVAL_S": "0.1", "RAYFLEX_PLACEMENT_TIMEOUT_S": "30",
         "RAYFLEX_COLLECTIVE_TIMEOUT_S": "60", "RAYFLEX_HANG_TIMEOUT_FLOOR_S": "15"}
# A run with a slow node: the straggler rules on fewer seconds (production: a 20 s window,
# 10 s to confirm, re-checks after 30 s), so the slow spell fits between the other faults.
SLOW_NODE_KNOBS = {"RAYFLEX_STRAGGLER_WINDOW_S": "8", "RAYFLEX_STRAGGLER_CONFIRM_S": "3",
                   "RAYFLEX_HEALTH_RECHECK_S": "5"}


@contextlib.contextmanager
def _s3_endpoint():
    """moto's S3 server on loopback, and a gate in front of it; yields the gate."""
    try:
        from moto.server import ThreadedMotoServer
    except ImportError as e:
        raise RuntimeError("chaos runs need an S3 endpoint: pip install 'moto[server]' "
                           "(or rayflex[test])") from e
    from rayflex.testing.chaos.s3_gate import S3Gate

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    gate = None
    try:
        host, port = server.get_host_and_port()
        gate = S3Gate(host, port).start()
        yield gate
    finally:
        if gate is not None:
            gate.close()
        server.stop()


def _trainer(cfg: ChaosConfig, data_uri: str, storage: str, name: str):
    import rayflex as rf
    from rayflex.models import GPTConfig, gpt

    return rf.Trainer(
        model=gpt(GPTConfig(vocab_size=128, seq_len=32, d_model=32, n_layers=2, n_heads=2)),
        data=rf.DataConfig(uri=data_uri, seq_len=32, global_batch=12, log_samples=True),
        run=rf.RunConfig(name=name, storage=storage, steps=cfg.steps),
        parallel=cfg.parallel or rf.ParallelConfig(),
        comm=cfg.comm or rf.CommConfig(),
        scaling=rf.ScalingConfig(num_workers=cfg.workers, min_workers=2),
        checkpoint=rf.CheckpointConfig(every_steps=cfg.checkpoint_every, keep=4, memory_replicas=cfg.memory_replicas),
        elastic=rf.ElasticConfig(max_failures=4 * cfg.faults, max_preemptions=2 * cfg.faults,
                                 resource_wait_s=120, restart_while_warming=cfg.restart_while_warming))


def _read_lines(uri: str) -> list[dict]:
    from rayflex.storage import fs as rfs

    try:
        text = rfs.read_text(uri)
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _keep_evidence(run_dir: str, checkpoint_root: str, out: str) -> None:
    """Copy the run's line files and result, and the list of its checkpoint files, out of
    the object store (moto keeps them in memory only) into the workdir: what a failed
    invariant is debugged from after the endpoint is gone."""
    from rayflex.storage import fs as rfs

    os.makedirs(out, exist_ok=True)
    for name in ("events.jsonl", "samples.jsonl", "metrics.jsonl", "result.json", "spec.json"):
        try:
            text = rfs.read_text(f"{run_dir}/{name}")
        except (FileNotFoundError, OSError):
            continue
        with open(os.path.join(out, name), "w") as f:
            f.write(text)
    try:
        fs, path = rfs.resolve(checkpoint_root)
        listing = sorted(fs.find(path, detail=False))
    except (FileNotFoundError, OSError):
        listing = []
    with open(os.path.join(out, "checkpoint_files.txt"), "w") as f:
        f.write("\n".join(listing))


def run_chaos(cfg: ChaosConfig) -> dict:
    """Run, inject, check. Returns the report (``passed`` and one entry per invariant)."""
    from rayflex.data.dataset import TokenDataset, write_synthetic_dataset
    from rayflex.testing.chaos import invariants as inv
    from rayflex.testing.chaos.bounds import DetectionTiming
    from rayflex.testing.chaos.cluster import LocalCluster
    from rayflex.testing.chaos.replay import compare, first_divergence, replay, segments_from_events
    from rayflex.checkpoint.manifest import step_dir

    kinds = cfg.kinds()
    workdir = cfg.workdir or tempfile.mkdtemp(prefix="rayflex-chaos-")
    name = f"chaos-{cfg.mode}-seed{cfg.seed}" if cfg.mode != "sequential" else f"chaos-seed{cfg.seed}"
    report: dict = {"seed": cfg.seed, "mode": cfg.mode, "planned": kinds, "steps": cfg.steps, "workers": cfg.workers,
                    "nodes": cfg.nodes, "config": {k: v for k, v in asdict(cfg).items() if k != "workdir"}}
    t0 = time.time()
    fault_log = os.path.join(workdir, "injected_failures.jsonl")
    with _s3_endpoint() as gate, mock.patch.dict(os.environ, {**AWS_TEST_ENV, "AWS_ENDPOINT_URL_S3": gate.url,
                                       "RAYFLEX_HEARTBEAT_TIMEOUT_S": str(cfg.heartbeat_timeout_s),
                                       "RAYFLEX_FAULT_LOG": fault_log, **KNOBS,
                                       **(SLOW_NODE_KNOBS if cfg.slow_node else {})}):
        import boto3

        # A bucket of this run's own: moto keeps its objects in the process, not in the server,
        # so a second chaos run in one process (the same run name) would otherwise write beside
        # the first one's checkpoints and resume from them.
        bucket = f"chaos-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=gate.url).create_bucket(Bucket=bucket)
        data_uri = write_synthetic_dataset(f"file://{workdir}/data", num_samples=1024, seq_len=32,
                                           vocab_size=128, num_shards=3, seed=7)
        trainer = _trainer(cfg, data_uri, f"s3://{bucket}/runs", name)
        spec = trainer.spec
        root = spec.checkpoint_uri
        injector = None
        with LocalCluster(cfg.nodes, cfg.cpus_per_node) as cluster:
            handle = trainer.submit()
            injector = Injector(cluster, handle, gate, kinds, cfg.seed, workers=cfg.workers,
                                checkpoint_root=root, timing=cfg.timing, corrupt=corrupt_newest_file,
                                steps=cfg.steps, fault_log=fault_log, mode=cfg.mode,
                                growth=cfg.restart_while_warming)
            stopped = False
            try:
                deadline = time.time() + cfg.timeout_s
                while not handle.done() and time.time() < deadline:
                    injector.tick()
                    if not stopped and injector.settled():
                        # Training on to a fixed step count would either waste minutes or,
                        # when recoveries take more steps than planned (a quiet machine steps
                        # faster), run out before the last fault: end the run here instead.
                        log.info("chaos: every fault recovered from; stopping the run")
                        handle.stop(wait=False)
                        stopped = True
                    time.sleep(0.1)
                result = handle.wait(timeout_s=max(1.0, deadline - time.time()), raise_on_failure=False)
            finally:
                injector.cleanup()
                with contextlib.suppress(Exception):
                    if not handle.done():
                        handle.stop(timeout_s=30)
        report["run_s"] = time.time() - t0
        last = result.steps_completed if stopped else cfg.steps  # where the run ended (the replay's end)
        report["steps"] = last
        faults = [f.to_dict() for f in injector.injected]
        report["faults"] = faults
        if cfg.mode == "overlap":
            planned = [f for f in faults if f["detail"].get("overlap")]
            report["overlapped"] = {"planned": len(injector.overlaps), "landed_in_window":
                                    sum(1 for f in planned if f["detail"]["overlap"]["overlapped"]),
                                    "windows": sorted({f["detail"]["overlap"]["phase"] for f in planned})}
        _keep_evidence(spec.run.run_dir, root, os.path.join(workdir, "evidence"))
        events = _read_lines(f"{spec.run.run_dir}/events.jsonl")
        timeline = ev.Timeline.from_dicts(events)
        samples = _read_lines(f"{spec.run.run_dir}/samples.jsonl")
        checks: dict = {}

        ok, detail = len(faults) == len(kinds), f"{len(faults)} of {len(kinds)} planned faults injected"
        if not ok:
            detail += (f": the run reached step {injector.last_step} (the last that leaves room to recover) "
                       f"first; raise steps_per_fault ({cfg.steps_per_fault}) or use a less loaded machine")
        checks["every_fault_injected"] = {"ok": ok, "detail": detail}
        ok, detail = inv.all_steps_finished(result, last, stopped=stopped)
        checks["finished_every_step"] = {"ok": ok, "detail": detail}
        corrupted = {f["detail"]["step"]: f["time"] for f in faults if f["kind"] == "corrupt_checkpoint"}
        ok, detail = inv.checkpoints_verify(root, corrupted)
        checks["committed_checkpoints_verify"] = {"ok": ok, "detail": detail}
        sampler = TokenDataset(data_uri).sampler(spec.data)
        ok, detail = inv.samples_exact(samples, sampler, last)
        checks["samples_once_per_epoch"] = {"ok": ok, "detail": detail}
        timing = DetectionTiming.of_run(cfg.heartbeat_timeout_s, result.metrics)  # the knobs are still set here
        ok, rows = inv.faults_accounted(faults, timeline.events, timing)
        checks["faults_accounted"] = {"ok": ok, "detail": rows, "timing": {**asdict(timing), "slack_s": timing.slack_s}}
        ok, detail = inv.stragglers_only_on_slow_nodes(timeline.events, faults)
        checks["no_false_straggler"] = {"ok": ok, "detail": detail}
        report["world_sizes"] = [e.world_size for e in timeline.of(ev.PlanChosen)]
        report["restarts"] = len(timeline.of(ev.Restarted))
        # Where each restart after a failure took its state from (the survivors' memory or a checkpoint).
        report["recoveries"] = [{"step": e.step, "source": e.source, **({"why": e.reason} if e.source != "live_peers"
                                                                         else {"holders": e.holders})}
                                for e in timeline.of(ev.RecoveryChosen)]
        if cfg.memory_replicas:  # where each restore read its shard files from (summed over ranks)
            report["restore_sources"] = [{"step": e.step, **e.sources} for e in timeline.of(ev.CheckpointLoaded)]
        if checks["finished_every_step"]["ok"]:
            t1 = time.time()
            segments = segments_from_events(timeline.events, last)
            replay_root = replay(spec, segments, f"file://{workdir}/replay")
            try:
                cmp = compare(step_dir(root, last), step_dir(replay_root, last))
            except Exception as e:  # noqa: BLE001 - e.g. the run's last step has no checkpoint: a failed check
                cmp = {"bitwise_equal": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            ok = cmp.get("bitwise_equal", False)
            if not ok and "error" not in cmp:
                cmp["first_divergence"] = first_divergence(root, replay_root)
            checks["equals_fault_free_replay"] = {
                "ok": ok, "detail": {**cmp, "segments": [asdict(s) for s in segments],
                                     "replay_s": round(time.time() - t1, 1)}}
        else:
            checks["equals_fault_free_replay"] = {"ok": False, "detail": "not compared: the run did not finish"}
    report["checks"] = checks
    report["passed"] = all(c["ok"] for c in checks.values())
    report["wall_s"] = time.time() - t0
    return report
