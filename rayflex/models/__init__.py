"""Reference workloads, each a :class:`ModelSpec` (an ordered list of blocks plus a loss).

Names are resolved on first use, so ``rayflex.models.summary`` and ``gpt_config`` (what the
torch-free control plane reads) load without importing torch, and ``hf_causal_lm``
(:func:`rayflex.models.hf.causal_lm`, a Hugging Face decoder) imports transformers only
when it is used.
"""

from __future__ import annotations

import importlib

_WHERE = {"GPTConfig": "gpt_config", "gpt": "gpt_blocks", "ModelSpec": "spec", "Stage": "spec", "build_stage": "spec",
          "ModelSummary": "summary", "to_module_state_dict": "module_spec", "from_module_state_dict": "module_spec",
          "to_module_key": "module_spec",
          "hf_causal_lm": "hf", "to_hf_key": "hf_families", "from_hf_key": "hf_families"}
# Public names that differ from the attribute of their module.
_ATTR = {"hf_causal_lm": "causal_lm"}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'rayflex.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"rayflex.models.{_WHERE[name]}"), _ATTR.get(name, name))
    globals()[name] = value
    return value
