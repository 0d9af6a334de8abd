"""Reference workloads, each a :class:`ModelSpec` (an ordered list of blocks plus a loss).

Names are resolved on first use, so ``rayflex.models.summary`` and ``gpt_config`` (what the
torch-free control plane reads) load without importing torch.
"""

from __future__ import annotations

import importlib

_WHERE = {"GPTConfig": "gpt_config", "gpt": "gpt_blocks", "ModelSpec": "spec", "Stage": "spec", "build_stage": "spec",
          "ModelSummary": "summary"}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'rayflex.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"rayflex.models.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
