"""Reference workloads, each a :class:`ModelSpec` (an ordered list of blocks plus a loss)."""

from rayflex.models.gpt import GPTConfig, gpt
from rayflex.models.spec import ModelSpec, Stage, build_stage

__all__ = ["GPTConfig", "ModelSpec", "Stage", "build_stage", "gpt"]
