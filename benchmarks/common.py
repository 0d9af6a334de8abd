"""Shared bits of the benchmarks: machine description, JSON output, logging to stderr."""

from __future__ import annotations

import json
import logging
import os
import platform
import sys


def machine() -> dict:
    import torch

    try:
        import ray

        ray_version = ray.__version__
    except ImportError:  # pragma: no cover
        ray_version = None
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__.split("+")[0], "ray": ray_version}


def emit(obj: dict, out: str | None = None) -> None:
    """The one JSON object on stdout (and in ``out``); everything else goes to stderr."""
    text = json.dumps(obj, indent=2, default=float)
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")


def setup_logging() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
