"""``make gpu-kit``: the wheels a GPU machine without network needs for the GPU kit.

    python benchmarks/gpu_kit_wheels.py [--dest .gpu_kit/wheels] [--python-version 3.12]

The machine the kit is for has torch (CUDA build), triton, transformers, numpy, pandas,
pyarrow, aiohttp, grpcio, protobuf, tokenizers, safetensors, tensorboard and the like, but
no Ray, torchtitan or torchao, and no network. This fetches, for CPython
``--python-version`` on manylinux x86_64, each missing distribution **without its
dependencies** (``pip download --no-deps``: a dependency resolution would pull torch and
CUDA wheels), the needed ones named explicitly (:data:`WHEELS`). Ray's wheel is repacked
without what a single-node run never loads (:data:`RAY_DROP`: the Java jars, the
dashboard's web client, RLlib, Serve, LLM, tests), its RECORD rewritten to match; the
folder must stay under :data:`LIMIT_BYTES` (the device tool carries 64 MiB with the
working tree). Prints one JSON object: each wheel and its size, what trimming removed.

The GPU machine installs them with ``benchmarks/gpu_device.sh`` (pip ``--no-index
--find-links``, into a scratch ``--target`` put on ``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import base64
import csv
import glob
import hashlib
import io
import os
import subprocess
import sys
import zipfile

sys.path.insert(0, os.path.dirname(__file__))
from common import emit  # noqa: E402

RAY = "ray==2.60.0"
# What the GPU image lacks, each pinned or bounded as its dependant asks.
WHEELS = (
    RAY,
    # Ray's own needs the image lacks (click, filelock, msgpack, packaging, protobuf, pyyaml,
    # requests are there)
    "jsonschema==4.26.0", "jsonschema-specifications==2025.9.1", "referencing==0.37.0", "rpds-py==2026.9.1",
    # float8 (torch >= 2.11 for its kernels)
    "torchao==0.18.0",
    # torchtitan and its pure-Python needs (einops, tokenizers, safetensors, tensorboard, pillow
    # are in the image; wandb is imported only when asked for)
    "torchtitan==0.3.0", "spmd_types==0.2.3", "torchdata==0.11.0", "torch_checkpointing==0.1.1",
    "tyro==1.0.17", "docstring-parser==0.18.0", "typeguard==4.6.1",
    "datasets==4.7.0", "dill==0.4.0", "multiprocess==0.70.18",
)
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_24_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_28_x86_64")
# Parts of Ray's wheel a single-node ray.init + actors never load.
RAY_DROP = ("ray/jars/", "ray/dashboard/client/build/", "ray/rllib/", "ray/serve/", "ray/llm/", "ray/cpp/",
            "ray/tests/", "ray/tune/examples/", "ray/train/examples/")
RAY_DROP_PARTS = ("/tests/",)
LIMIT_BYTES = 64 * 2 ** 20


def download(specs: tuple[str, ...], dest: str, python_version: str) -> None:
    platforms = [flag for p in PLATFORMS for flag in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--python-version", python_version, "--implementation", "cp", *platforms,
                    "--dest", dest, *specs], check=True, stdout=sys.stderr)


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def record_of(z: zipfile.ZipFile) -> str:
    """The wheel's own RECORD (``<name>.dist-info/RECORD`` at the top; Ray vendors packages
    whose dist-info folders have RECORDs of their own deeper down)."""
    return next(n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/RECORD"))


def dropped(name: str) -> bool:
    return name.startswith(RAY_DROP) or any(part in name for part in RAY_DROP_PARTS)


def trim_wheel(path: str) -> dict:
    """Repack ``path`` in place without :func:`dropped` files; RECORD lists what remains."""
    tmp = path + ".tmp"
    removed = removed_bytes = 0
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        record_name = record_of(src)
        rows = []
        for info in src.infolist():
            if info.filename == record_name:
                continue
            if dropped(info.filename):
                removed += 1
                removed_bytes += info.compress_size
                continue
            data = src.read(info)
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
            rows.append((info.filename, _record_hash(data), str(len(data))))
        text = io.StringIO()
        csv.writer(text, lineterminator="\n").writerows(rows + [(record_name, "", "")])
        dst.writestr(record_name, text.getvalue())
    before = os.path.getsize(path)
    os.replace(tmp, path)
    return {"files_removed": removed, "compressed_bytes_removed": removed_bytes, "bytes_before": before,
            "bytes_after": os.path.getsize(path)}


def record_problems(path: str) -> list[str]:
    """Where a wheel's RECORD and its files disagree (missing, extra, wrong hash or size)."""
    problems = []
    with zipfile.ZipFile(path) as z:
        record_name = record_of(z)
        listed = {row[0]: row[1:] for row in csv.reader(io.StringIO(z.read(record_name).decode())) if row}
        names = set(z.namelist())
        problems += [f"listed but absent: {n}" for n in sorted(set(listed) - names)]
        problems += [f"present but not listed: {n}" for n in sorted(names - set(listed))]
        for name in sorted(names & set(listed)):
            digest, size = listed[name]
            if name == record_name:
                continue
            data = z.read(name)
            if digest != _record_hash(data) or size != str(len(data)):
                problems.append(f"hash or size differs: {name}")
    return problems


def fetch(dest: str, python_version: str, specs: tuple[str, ...] = WHEELS) -> dict:
    os.makedirs(dest, exist_ok=True)
    download(specs, dest, python_version)
    ray_wheels = glob.glob(os.path.join(dest, "ray-*.whl"))
    trimmed = {}
    for path in ray_wheels:
        with zipfile.ZipFile(path) as z:
            untrimmed = any(dropped(n) for n in z.namelist())
        if untrimmed:  # a second `make gpu-kit` finds it trimmed already
            trimmed[os.path.basename(path)] = trim_wheel(path)
    wheels = {os.path.basename(p): os.path.getsize(p) for p in sorted(glob.glob(os.path.join(dest, "*.whl")))}
    total = sum(wheels.values())
    return {"dest": dest, "python_version": python_version, "wheels": wheels, "total_bytes": total,
            "total_mib": total / 2 ** 20, "limit_mib": LIMIT_BYTES / 2 ** 20, "ray_trimmed": trimmed,
            "record_problems": {os.path.basename(p): record_problems(p) for p in ray_wheels}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", default=".gpu_kit/wheels")
    ap.add_argument("--python-version", default="3.12", help="the GPU machine's Python (3.12 there)")
    ap.add_argument("--only", default=None, help="comma-separated subset of the specs (e.g. the Ray wheel alone)")
    args = ap.parse_args(argv)
    specs = tuple(s for s in WHEELS if args.only is None or s.split("==")[0] in args.only.split(","))
    out = fetch(args.dest, args.python_version, specs)
    emit(out)
    if out["total_bytes"] > LIMIT_BYTES or any(out["record_problems"].values()):
        print(f"{args.dest}: {out['total_mib']:.1f} MiB (limit {out['limit_mib']:.0f}) or a RECORD mismatch",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
