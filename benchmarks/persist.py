"""Persist and restore speed on local disk or an S3 endpoint: the storage's floor, rayflex's
checkpoint path and torch DCP's own writer and reader, on the same bytes, in alternating rounds.

    python benchmarks/persist.py [--storage disk|s3] [--gb-per-rank 2] [--ranks 2] [--rounds 3]
                                 [--threads 1,2,4] [--dir /var/tmp] [--release-staging]
                                 [--out benchmarks/results/persist.json]

Each rank (a process; gloo process group) holds ``--gb-per-rank`` GB of float32 tensors
(64 MB each) and, per round and per system, in turn:

* ``floor_T``: writes those bytes to ``T`` files with ``T`` threads (large sequential writes
  straight from the tensors' memory), then reads them back into the tensors (``readinto``):
  what the disk gives a plain parallel writer and reader;
* ``rayflex_T``: ``AsyncCheckpointer.save`` (staging copy, DCP planning, ``T`` writer threads
  per rank, the checksum of every byte while it streams, the commit with its manifest) until
  the commit, then ``load_latest`` (which verifies the checkpoint against its manifest and
  then loads it) — ``CheckpointConfig.upload_threads=T``;
* ``dcp_T``: ``dcp.save`` with ``FileSystemWriter(thread_count=T)``, then ``dcp.load`` with
  ``FileSystemReader``: the peer.

With ``--storage s3`` the same three go to moto's S3 server on 127.0.0.1 (started here, in
this process; every rank talks HTTP to it): the floor is a plain boto3 PUT per 64 MB tensor from
each writer thread (copied to bytes as boto3 takes them; no request checksums; not multipart, which
moto assembles slowly in Python) and a GET per tensor read back into it; rayflex writes ``s3://``
through s3fs (objects of about 64 MB, each one PUT); DCP uses its
``FsspecWriter(thread_count=T)`` / ``FsspecReader`` (a multipart object per thread). moto keeps the bytes on this machine and
shares its 2 cores with the ranks, so the figures are this endpoint's, not a cloud bucket's:
what compares is the three systems against one endpoint. moto completes a multipart object in
Python, holding it twice in memory: at 2 GB a rank DCP's completions need ~10 GB beside the
ranks, which ``--release-staging`` makes room for (rayflex's staging freed after each save, so
each of its saves stages afresh — slower than a run's steady save).

Every restore reads into a second set of tensors of the same names (a new attempt's rank;
the first and last tensor are checked against the saved ones after each): a restore into
the saving state would re-create its optimizer's state dict, and each next rayflex save would
then rebuild its staging buffers — a run's first save after a restore, not its steady saves.

Every persist time ends with ``os.sync()`` on each rank (the bytes on disk, not in the page
cache: a local-disk checkpoint that a power loss takes is no checkpoint), and before every
restore the page cache is dropped (``/proc/sys/vm/drop_caches``, as root; the JSON says
whether it could). GB/s = all ranks' bytes / (the slowest rank's time, between barriers).
Prints one JSON object (medians over rounds, with min and max, and rayflex / floor and
rayflex / DCP ratios per round).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Optional

sys.path.insert(0, os.path.dirname(__file__))
from common import TENSOR_MB, emit, machine, rank_state, run_ranks, setup_logging, state_of_rank  # noqa: E402



def _drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _split(tensors: list, parts: int) -> list[list]:
    """``tensors`` in ``parts`` contiguous runs of about equal bytes."""
    out: list[list] = [[] for _ in range(parts)]
    for i, t in enumerate(tensors):
        out[i * parts // len(tensors)].append(t)
    return [p for p in out if p]


def _threads(fn, parts: list) -> None:
    """``fn(i, part)`` for every part, each in a thread of its own; returns when all are done."""
    workers = [threading.Thread(target=fn, args=(i, p)) for i, p in enumerate(parts)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def _floor_write(tensors: list, root: str, threads: int) -> None:
    def write(i: int, part: list) -> None:
        with open(os.path.join(root, f"part{i}"), "wb", buffering=0) as f:
            for t in part:
                f.write(memoryview(t.numpy()).cast("B"))

    _threads(write, _split(tensors, threads))


def _floor_read(tensors: list, root: str, threads: int) -> None:
    def read(i: int, part: list) -> None:
        with open(os.path.join(root, f"part{i}"), "rb", buffering=0) as f:
            for t in part:
                view = memoryview(t.numpy()).cast("B")
                got = 0
                while got < len(view):
                    got += f.readinto(view[got:])

    _threads(read, _split(tensors, threads))


BUCKET = "rayflex-bench"


def _s3():
    import boto3
    from botocore.config import Config

    # No request checksums (boto3's default computes one of every part in Python): the floor
    # is the transfer, and rayflex's own checksum is part of what it is measured doing.
    return boto3.client("s3", config=Config(max_pool_connections=32, request_checksum_calculation="when_required",
                                            response_checksum_validation="when_required"))


def _floor_upload(tensors: list, prefix: str, threads: int) -> None:
    """One PUT per 64 MB tensor, ``threads`` at a time. Not multipart: moto assembles a
    multipart object in Python (3 s to complete a 256 MB one here), which halved a writer's
    rate and measured moto rather than the transfer (0.08 GB/s multipart vs 0.17-0.20 GB/s
    in 64 MB PUTs, 2 threads, this endpoint)."""
    client = _s3()

    def upload(i: int, part: list) -> None:
        for n, t in enumerate(part):
            client.put_object(Bucket=BUCKET, Key=f"{prefix}/part{i}/{n}",
                              Body=memoryview(t.numpy()).cast("B").tobytes())  # boto3 takes bytes

    _threads(upload, _split(tensors, threads))


def _floor_download(tensors: list, prefix: str, threads: int) -> None:
    client = _s3()

    def download(i: int, part: list) -> None:
        for n, t in enumerate(part):
            view = memoryview(t.numpy()).cast("B")
            body = client.get_object(Bucket=BUCKET, Key=f"{prefix}/part{i}/{n}")["Body"]
            got = 0
            while got < len(view):
                chunk = body.read(min(8 << 20, len(view) - got))
                view[got:got + len(chunk)] = chunk
                got += len(chunk)

    _threads(download, _split(tensors, threads))


def _rank(rank: int, world: int, port: int, cfg: dict, results) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from rayflex.checkpoint.checkpointer import AsyncCheckpointer

    tensors, state = rank_state(rank, world, port, cfg["gb_per_rank"])
    # Restores go into a state of their own, as a new attempt's rank would: loading into the
    # saving state would re-create its optimizer state (``opt.state``) and make every next
    # save rebuild its staging buffers — a save after a restore, not a run's steady save.
    into, into_state = state_of_rank(rank, cfg["gb_per_rank"], fill=False)
    nbytes = sum(t.numel() * 4 for t in tensors)

    def restored_right() -> None:
        for i in (0, len(tensors) - 1):
            assert torch.equal(into[i], tensors[i]), f"rank {rank}: tensor {i} restored wrong"
            into[i].zero_()

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        os.sync()
        dist.barrier()
        return time.perf_counter() - t0

    s3 = cfg["storage"] == "s3"

    def fresh(path: str) -> str:
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path, exist_ok=True)
        return path

    def uri(system: str) -> str:
        return f"s3://{BUCKET}/persist/{system}" if s3 else f"file://{os.path.join(cfg['dir'], system)}"

    def remove(system: str) -> None:
        if s3:
            import fsspec

            fs = fsspec.filesystem("s3")
            if fs.exists(f"{BUCKET}/persist/{system}"):
                fs.rm(f"{BUCKET}/persist/{system}", recursive=True)
        else:
            shutil.rmtree(os.path.join(cfg["dir"], system), ignore_errors=True)

    # One checkpointer for the whole run, as a training run keeps one: a save reuses its
    # staging buffers and save plan (what a run's first save builds, in an untimed save here);
    # each rayflex_T row sets its writer threads. (One per thread count held 2 GB of staging
    # each: with the state and the restore target, 10 GB a rank of this host's 24, which
    # left the page cache too little for every system.)
    ckpt = None
    for system in cfg["systems"]:
        kind, threads = system.rsplit("_", 1)
        if kind == "rayflex" and ckpt is None:
            ckpt = AsyncCheckpointer(uri("rayflex-warmup"), rank=rank, use_async=True, keep=1, upload="thread",
                                     upload_threads=int(threads))
            ckpt.save(state, step=1)
            ckpt.wait()
            dist.barrier()
            if rank == 0 and not s3:  # every rank's bytes, not one copy of names the ranks share
                on_disk = sum(os.path.getsize(os.path.join(d, f))
                              for d, _, files in os.walk(os.path.join(cfg["dir"], "rayflex-warmup")) for f in files)
                assert on_disk >= world * nbytes, f"the checkpoint holds {on_disk} bytes of {world} x {nbytes}"
            # Read back as every timed restore is, by a new attempt's checkpointer (the saving
            # one drops its staging when it loads).
            AsyncCheckpointer(uri("rayflex-warmup"), rank=rank, use_async=False).load_latest(into_state)
    # And one untimed restore each (DCP's too): a process's first load imports DCP's loading
    # modules, which the cache drops before every timed restore would make each round's first
    # system read from disk (0.19x the floor in round 1 otherwise, 1.26-1.31x after).
    warm = os.path.join(cfg["dir"], "dcp-warmup")
    if not s3:
        from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

        dcp.save({"t": tensors[0]}, storage_writer=FileSystemWriter(warm))
        dcp.load({"t": tensors[0]}, storage_reader=FileSystemReader(warm))
    os.sync()  # the warm-ups' bytes on disk now, not in the first timed write's sync
    dist.barrier()
    rows = []
    for rnd in range(cfg["rounds"]):
        for system in cfg["systems"]:
            kind, threads = system.rsplit("_", 1)
            threads = int(threads)
            root = os.path.join(cfg["dir"], system)  # shared by the ranks: one checkpoint
            if rank == 0:
                if s3:
                    remove(system)
                else:
                    fresh(root)  # emptied and made again
            dist.barrier()
            blocked = None
            if kind == "floor" and s3:
                prefix = f"persist/{system}/rank{rank}"
                write_s = timed(lambda: _floor_upload(tensors, prefix, threads))
                read_fn = lambda: _floor_download(into, prefix, threads)  # noqa: E731
            elif kind == "floor":
                mine = fresh(os.path.join(root, f"rank{rank}"))
                write_s = timed(lambda: _floor_write(tensors, mine, threads))
                read_fn = lambda: _floor_read(into, mine, threads)  # noqa: E731
            elif kind == "rayflex":
                ckpt.upload_threads = threads
                ckpt.root = uri(system)  # this round's own directory: the cache drop makes it cold
                saved: dict = {}

                def save():
                    # As a save after the training loop ("final"): nothing trains beside it, so
                    # its upload runs at the process's priority, as DCP's does (a periodic
                    # save's yields to the steps beside it: save_backlog.py measures those).
                    ckpt.save(state, step=rnd + 2, reason="final")
                    [report] = ckpt.wait()
                    assert report.get("committed") or rank != 0, report
                    saved["blocked_s"] = report.get("blocked_s")
                write_s = timed(save)
                blocked = saved.get("blocked_s")
                if cfg["release_staging"]:
                    ckpt.close()  # its next save stages afresh: a run's first save, not a steady one
                # A restore is a new attempt's: its own checkpointer (the saving one keeps its staging).
                read_fn = lambda: AsyncCheckpointer(uri(system), rank=rank, use_async=False).load_latest(into_state)  # noqa: E731,E501
            else:
                from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
                from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

                sd = {f"r{rank}.w{i}": t for i, t in enumerate(tensors)}  # each rank's own entries
                sd_into = {f"r{rank}.w{i}": t for i, t in enumerate(into)}
                writer, reader = (FsspecWriter, FsspecReader) if s3 else (FileSystemWriter, FileSystemReader)
                path = uri(system) if s3 else root
                write_s = timed(lambda: dcp.save(sd, storage_writer=writer(
                    path, thread_count=threads, single_file_per_rank=True, sync_files=False)))
                read_fn = lambda: dcp.load(sd_into, storage_reader=reader(path))  # noqa: E731
            dist.barrier()
            dropped = (None if s3 else _drop_caches()) if rank == 0 else None
            read_s = timed(read_fn)
            restored_right()
            if rank == 0:
                rows.append({"round": rnd, "system": system, "write_s": write_s, "read_s": read_s,
                             "blocked_s": blocked, "cache_dropped": dropped})
                print(f"[persist] round {rnd + 1}: {system}: write {world * nbytes / write_s / 1e9:.2f} GB/s, "
                      f"read {world * nbytes / read_s / 1e9:.2f} GB/s", file=sys.stderr, flush=True)
            dist.barrier()
            if rank == 0:
                remove(system)
    if ckpt is not None:
        ckpt.close()
        if rank == 0:
            remove("rayflex-warmup")
    if rank == 0:
        results.put({"bytes_per_rank": nbytes, "rows": rows})
    dist.destroy_process_group()


def _summary(rows: list[dict], total_bytes: int) -> dict:
    out = {}
    for system in dict.fromkeys(r["system"] for r in rows):
        mine = [r for r in rows if r["system"] == system]
        entry = {}
        for key, label in (("write_s", "persist_gb_s"), ("read_s", "restore_gb_s")):
            rates = [total_bytes / r[key] / 1e9 for r in mine]
            entry[label] = {"median": statistics.median(rates), "min": min(rates), "max": max(rates),
                            "rounds": rates}
        blocked = [r["blocked_s"] for r in mine if r["blocked_s"] is not None]
        if blocked:
            entry["blocked_s_median"] = statistics.median(blocked)
        out[system] = entry
    return out


def _ratios(rows: list[dict], total_bytes: int, ours: str, theirs: str) -> dict:
    """``ours`` / ``theirs`` GB/s, round by round (the same round's runs)."""
    out = {}
    for key, label in (("write_s", "persist"), ("read_s", "restore")):
        per = [next(r[key] for r in rows if r["round"] == k and r["system"] == theirs)
               / next(r[key] for r in rows if r["round"] == k and r["system"] == ours)
               for k in sorted({r["round"] for r in rows})]
        out[label] = {"median": statistics.median(per), "min": min(per), "max": max(per), "rounds": per}
    return out


def _fio(root: str, ranks: int, gb_per_rank: float, rounds: int) -> Optional[list[dict]]:
    """``fio``'s sequential write (``ranks`` jobs of ``gb_per_rank`` GB each, 8 MB blocks,
    fsync at the end, as the other systems' ``os.sync``) and read (page cache dropped first) of
    the same bytes in the same directory, ``rounds`` times: the disk's own floor. None where
    fio is not installed (Debian: ``apt-get install fio``)."""
    import shutil as sh
    import subprocess

    if sh.which("fio") is None:
        return None
    out = []
    size = f"{int(gb_per_rank * 1024)}m"
    common = ["fio", "--name=seq", f"--directory={root}", f"--numjobs={ranks}", f"--size={size}", "--bs=8m",
              "--ioengine=psync", "--group_reporting", "--output-format=json"]
    for _ in range(rounds):
        t0 = time.perf_counter()
        subprocess.run([*common, "--rw=write", "--end_fsync=1"], check=True, capture_output=True)
        write_s = time.perf_counter() - t0
        dropped = _drop_caches()
        t0 = time.perf_counter()
        subprocess.run([*common, "--rw=read"], check=True, capture_output=True)
        read_s = time.perf_counter() - t0
        for f in os.listdir(root):
            if f.startswith("seq."):
                os.remove(os.path.join(root, f))
        total = gb_per_rank * ranks * (1 << 30)
        out.append({"write_gbps": total / write_s / 1e9, "read_gbps": total / read_s / 1e9, "cache_dropped": dropped})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--storage", choices=("disk", "s3"), default="disk",
                    help="local disk (--dir), or moto's S3 server started here on 127.0.0.1")
    ap.add_argument("--gb-per-rank", type=float, default=2.0)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", default="1,2,4", help="writer threads per rank to try, for every system")
    ap.add_argument("--dir", default=None, help="where the files go (default: a new directory under /var/tmp)")
    ap.add_argument("--release-staging", action="store_true",
                    help="free rayflex's staging buffers after each of its saves (each save then stages afresh, "
                         "as a run's first save does): with --storage s3 at 2 GB a rank, room for moto to "
                         "assemble DCP's multipart objects beside the ranks on a 24 GB host")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    setup_logging()

    threads = [int(t) for t in args.threads.split(",")]
    systems = [f"{kind}_{t}" for t in threads for kind in ("floor", "rayflex", "dcp")]
    root = tempfile.mkdtemp(prefix="rayflex-persist-", dir=args.dir or "/var/tmp")
    cfg = {"gb_per_rank": args.gb_per_rank, "rounds": args.rounds, "systems": systems, "dir": root,
           "storage": args.storage, "release_staging": args.release_staging}
    server = None
    try:
        if args.storage == "s3":
            from checkpoint import start_s3

            _, server = start_s3()  # the ranks inherit its AWS_* environment
        got = run_ranks(_rank, args.ranks, cfg)
        fio = _fio(root, args.ranks, args.gb_per_rank, args.rounds) if args.storage == "disk" else None
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if server is not None:
            server.stop()
    total = got["bytes_per_rank"] * args.ranks
    rows = got["rows"]
    best = {kind: max((s for s in systems if s.startswith(kind)),
                      key=lambda s: statistics.median(total / r["write_s"] for r in rows if r["system"] == s))
            for kind in ("floor", "rayflex", "dcp")}
    emit({"benchmark": "persist", "machine": machine(), "command": " ".join(sys.argv),
          "workload": {"ranks": args.ranks, "bytes_per_rank": got["bytes_per_rank"], "tensor_mb": TENSOR_MB,
                       "storage": ("moto S3 server on 127.0.0.1 in the benchmark's process" if args.storage == "s3"
                                   else f"local disk ({root.rsplit('/', 1)[0]})"),
                       "rounds": args.rounds, "rayflex_staging_released_after_each_save": args.release_staging,
                       "cache_dropped_before_restore": (None if args.storage == "s3"
                                                        else all(r["cache_dropped"] for r in rows))},
          "results": _summary(rows, total),
          # fio after the rounds above (not between them): the disk's sequential speed, process-start costs aside.
          "fio": None if fio is None else {
              "write_gbps": statistics.median(r["write_gbps"] for r in fio),
              "read_gbps": statistics.median(r["read_gbps"] for r in fio), "rounds": fio},
          "best_persist": best,
          "ratios": {"rayflex_vs_floor": _ratios(rows, total, best["rayflex"], best["floor"]),
                     "rayflex_vs_dcp": _ratios(rows, total, best["rayflex"], best["dcp"])}},
         args.out)


if __name__ == "__main__":
    main()
