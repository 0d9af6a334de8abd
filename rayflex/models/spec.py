"""The model contract: an ordered list of blocks plus a loss.

A pipeline stage is a contiguous slice of blocks and a block is the unit of
``fully_shard``. Each block is built from its global index with its own seed, so every
split of the model (any pp, any dp, one process) starts from identical weights, and
state-dict keys carry the global index (``blocks.3.attn.qkv.weight``) so a checkpoint loads
under any split.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from rayflex.models.meta import on_meta


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
    # Token ids the first block embeds (0: unknown); a prepared dataset whose tokenizer has
    # a larger vocabulary is refused before any actor starts.
    vocab_size: int = 0
    # What the model is besides its blocks, for tools that read it without building it:
    # ``{"hf": {...}}`` from :func:`rayflex.models.hf.causal_lm` (family, config to
    # export, sizes for the planners). Keep it JSON-able: it goes into the run's spec.json.
    metadata: dict = field(default_factory=dict, hash=False)

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
            if torch.device(device).type == "meta":
                with on_meta():
                    return self.build_block(index)
            with torch.device(device):
                return self.build_block(index)

    def param_counts(self) -> list[int]:
        """Parameters per block, computed on the meta device (no memory, no init cost)."""
        counts = []
        for i in range(self.num_blocks):
            with on_meta():
                b = self.build_block(i)
            counts.append(sum(p.numel() for p in b.parameters()))
        return counts

    @classmethod
    def from_module(cls, factory: Callable[[], nn.Module], blocks: str = "layers", **options) -> "ModelSpec":
        """Your own ``nn.Module`` whose body is an ``nn.ModuleList``, cut into blocks.

        ``factory`` (zero-argument: the class, or ``functools.partial(MyLM, cfg)``) builds
        the module; ``blocks`` is the path of its layer list (``"model.layers"`` works).
        Keyword options: ``loss_fn`` (required), ``pre=("embed",)`` and
        ``post=("norm", "lm_head")`` (the modules forward applies before and after the
        list, in order; a str for one), ``ignore=()`` (modules forward never calls),
        ``name`` (class name and depth), ``hidden_size`` (0: the embedding's width),
        ``init_seed=1234``, ``init="module"`` (weights of ``torch.manual_seed(init_seed);
        factory()``, one full CPU build per block) or ``"reset"`` (each layer's
        ``reset_parameters()``, per block), ``tp_plan`` (tensor parallelism, in transformers'
        notation: ``{"layers.*.attn.q_proj": "colwise", "layers.*.attn.o_proj": "rowwise",
        "embed": "rowwise_replicated_input", "lm_head": "colwise_gather_output"}``; styles in
        :mod:`rayflex.models.tp_plan`; None: the model cannot be split, ``tp`` must be 1) and
        ``tp_divides`` (``{"attention heads": 8}``: sizes ``tp`` must divide, checked before
        launch). Block 0 is ``pre`` chained, then one block per
        layer, then ``post``; keys keep your names (``blocks.0.embed.weight``,
        ``blocks.3.<layers[2]'s names>``) and
        :func:`rayflex.models.module_spec.to_module_state_dict` maps them back.
        Everything that cannot be cut is a ConfigError here; :mod:`rayflex.models.module_spec`
        says what and what each choice costs.
        """
        from rayflex.models.module_spec import module_spec_fields

        return cls(**module_spec_fields(factory, blocks, **options))


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
