"""ModelSummary: a ModelSpec as the control plane sees it.

The controller is a 0-CPU actor that plans meshes and placements; it needs a model's sizes
(blocks, parameters per block, hidden width, the GPT config or the metadata the capacity
planner reads)
but never its code. Unpickling a ModelSpec would import torch (its ``build_block`` lives in
a module that does), costing the controller seconds of start-up and hundreds of MB. The
driver, which has torch anyway, measures the sizes once and ships the spec itself as
bytes; a worker turns them back into the ModelSpec with :meth:`load`.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass(frozen=True)
class ModelSummary:
    name: str
    num_blocks: int
    hidden_size: int
    init_seed: int
    block_params: tuple[int, ...]
    # rayflex's GPT: its GPTConfig (torch-free), so the capacity planner describes it exactly.
    gpt_config: Optional[Any] = None
    payload: bytes = field(default=b"", repr=False)
    # ModelSpec.metadata (JSON-able): e.g. a Hugging Face model's family, exportable config
    # and sizes, which the capacity planner reads (rayflex.models.hf_families.hf_size_of).
    metadata: dict = field(default_factory=dict, hash=False)

    @classmethod
    def of(cls, spec) -> "ModelSummary":
        """Summarize a ModelSpec (on the driver: this builds each block on the meta device)."""
        import ray.cloudpickle as cloudpickle  # by value where pickle would need __main__

        from rayflex.models.gpt_config import gpt_config_of

        return cls(name=spec.name, num_blocks=spec.num_blocks, hidden_size=spec.hidden_size,
                   init_seed=spec.init_seed, block_params=tuple(spec.param_counts()), gpt_config=gpt_config_of(spec),
                   payload=cloudpickle.dumps(spec), metadata=dict(getattr(spec, "metadata", None) or {}))

    def param_counts(self) -> list[int]:
        return list(self.block_params)

    def load(self):
        """The ModelSpec itself (imports torch and the model's module)."""
        return pickle.loads(self.payload)

    # A TrainSpec accepts anything shaped like a ModelSpec; these load the real one.
    def build_block(self, index: int):
        return self.load().build_block(index)

    def loss_fn(self, output, targets):
        return self.load().loss_fn(output, targets)


def loaded(spec):
    """``spec`` (a TrainSpec) with its model a real ModelSpec again."""
    import dataclasses

    if isinstance(spec.model, ModelSummary):
        return dataclasses.replace(spec, model=spec.model.load())
    return spec


def summarized(spec):
    """``spec`` (a TrainSpec) with its model summarized for the torch-free control plane."""
    import dataclasses

    if isinstance(spec.model, ModelSummary):
        return spec
    return dataclasses.replace(spec, model=ModelSummary.of(spec.model))
