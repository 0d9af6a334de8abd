"""The model contract: an ordered list of blocks plus a loss.

A pipeline stage is a contiguous slice of blocks and a block is the unit of
``fully_shard``. Each block is built from its global index with its own seed, so every
split of the model (any pp, any dp, one process) starts from identical weights, and
state-dict keys carry the global index (``blocks.3.attn.qkv.weight``) so a checkpoint loads
under any split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """What rayflex needs to know about a model.

    ``build_block(i)`` returns block ``i`` as an ``nn.Module`` whose ``forward`` takes one
    tensor and returns one tensor: block 0 takes int64 token ids ``[batch, seq_len]``, each
    next block takes its predecessor's output, the last returns the logits.
    ``loss_fn(output, targets)`` returns the mean loss of a microbatch as a scalar tensor
    (``targets``: int64 ``[batch, seq_len]``). ``Trainer`` checks all of this on the meta
    device before any actor starts (:mod:`rayflex.models.contract`).

    Both may be any callables: top-level functions, ``functools.partial``, lambdas or
    closures. The spec travels to the workers pickled with ``ray.cloudpickle``
    (:mod:`rayflex.models.summary`): lambdas, closures and anything defined in ``__main__``
    (a script, a notebook) go by value, with what they capture, so keep that small;
    functions of an importable module go by reference, so that module must be importable
    on the workers too.
    """

    name: str
    num_blocks: int
    build_block: Callable[[int], nn.Module]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    # Activation width of the tensors passed between blocks (for the comm/capacity model).
    hidden_size: int = 0
    # Seed of the per-block initialisation; independent of the data seed.
    init_seed: int = 1234

    def __post_init__(self) -> None:
        from rayflex.errors import ConfigError

        if not isinstance(self.num_blocks, int) or self.num_blocks < 1:
            raise ConfigError("ModelSpec.num_blocks", f"must be >= 1, got {self.num_blocks!r}",
                              "return at least one block")
        if not callable(self.build_block) or not callable(self.loss_fn):
            raise ConfigError("ModelSpec.build_block", "build_block and loss_fn must be callables",
                              "pass functions, functools.partial objects, lambdas or closures")

    def block(self, index: int, device: torch.device | str = "cpu") -> nn.Module:
        """Build block ``index`` deterministically (same weights in every process)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.init_seed * 1_000_003 + index)
            with torch.device(device):
                return self.build_block(index)

    def param_counts(self) -> list[int]:
        """Parameters per block, computed on the meta device (no memory, no init cost)."""
        counts = []
        for i in range(self.num_blocks):
            with torch.device("meta"):
                b = self.build_block(i)
            counts.append(sum(p.numel() for p in b.parameters()))
        return counts


class Stage(nn.Module):
    """A contiguous slice of blocks, keyed by global block index.

    ``blocks`` is a ModuleDict keyed ``"0".."N-1"`` by *global* index, so the state-dict
    keys of a stage are a subset of the full model's keys whatever the split.
    """

    def __init__(self, blocks: dict[int, nn.Module]):
        super().__init__()
        self.indices = sorted(blocks)
        self.blocks = nn.ModuleDict({str(i): blocks[i] for i in self.indices})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in self.indices:
            x = self.blocks[str(i)](x)
        return x


def build_stage(spec: ModelSpec, indices: list[int], device: torch.device | str = "cpu") -> Stage:
    return Stage({i: spec.block(i, device) for i in indices})
