"""Float8 training of a stage's linear layers (``PrecisionConfig(float8=True)``).

torchao's float8 training swaps each chosen ``nn.Linear`` for a ``Float8Linear`` whose
matmuls cast their inputs to float8 with dynamic scales and keep the weights (and so the
optimizer's master weights and every checkpoint key) as they were. As in torchtitan the
swap happens per block on the model as built, before tensor parallelism, checkpointing,
compile and ``fully_shard`` (:func:`rayflex.worker.parallelize.shard_stage`): FSDP2 then
shards the float8 modules' plain weights like any other.

Two kinds of linear stay as they are: the output head (its logits feed the loss, and
float8 there costs accuracy for little speed: torchtitan leaves it out too) and any
linear with a dimension not divisible by 16 (float8 tensor cores need it).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from rayflex.errors import ConfigError
from rayflex.models.spec import ModelSpec, Stage

log = logging.getLogger(__name__)

MIN_CAPABILITY = (8, 9)  # Ada / Hopper: the first GPUs with float8 tensor cores
FIELD = "PrecisionConfig.float8"


def torchao_float8():
    """torchao's float8 module, or a ConfigError saying how to install it."""
    try:
        import torchao.float8 as float8
    except ImportError as e:
        raise ConfigError(FIELD, f"float8 training uses torchao, which cannot be imported here ({e})",
                          "pip install torchao (a release built for this torch), or drop float8") from e
    return float8


def check_device(device: torch.device, *, tp: int = 1) -> None:
    """Refuse float8 where this rank cannot run it: a CPU, a GPU older than compute
    capability 8.9, tensor parallelism (float8 needs its own TP styles), no torchao."""
    if device.type != "cuda":
        raise ConfigError(FIELD, f"float8 training needs a GPU of compute capability 8.9 or newer; this rank "
                          f"trains on {device.type}", "run on H100 / H200 / L4-class GPUs, or drop float8")
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ConfigError(FIELD, f"{name} has compute capability {capability[0]}.{capability[1]}, and float8 "
                          "matmuls need 8.9 or newer", "run on H100 / H200 / L4-class GPUs, or drop float8")
    if tp != 1:
        raise ConfigError(FIELD, f"float8 with tensor parallelism (tp={tp}) is not supported",
                          "use tp=1 (FSDP and pipeline stages work with float8), or drop float8")
    torchao_float8()


def is_head(linear: nn.Linear, block_index: int, spec: ModelSpec) -> bool:
    """The output head: a linear of the model's last block that produces the vocabulary
    (every linear of the last block when the spec does not say its vocabulary size)."""
    if block_index != spec.num_blocks - 1:
        return False
    return not spec.vocab_size or linear.out_features == spec.vocab_size


def convertible(linear: nn.Linear) -> bool:
    """Float8 tensor cores need both dimensions divisible by 16."""
    return linear.in_features % 16 == 0 and linear.out_features % 16 == 0


def convert_stage(stage: Stage, spec: ModelSpec) -> list[str]:
    """Swap the stage's eligible linears for torchao's ``Float8Linear``, block by block, in
    place (works on the meta device). Returns the converted modules' names in the stage
    (``blocks.3.mlp.fc``)."""
    float8 = torchao_float8()
    from torchao.float8.float8_linear import Float8Linear

    config = float8.Float8LinearConfig()
    converted: list[str] = []
    for i in stage.indices:
        def choose(module: nn.Module, fqn: str, i=i) -> bool:
            return isinstance(module, nn.Linear) and convertible(module) and not is_head(module, i, spec)

        block = float8.convert_to_float8_training(stage.blocks[str(i)], module_filter_fn=choose, config=config)
        stage.blocks[str(i)] = block  # the same module unless a block is a bare Linear
        converted += [f"blocks.{i}.{name}" if name else f"blocks.{i}"
                      for name, m in block.named_modules() if isinstance(m, Float8Linear)]
    log.info("float8: %d linear layers converted in blocks %s", len(converted), stage.indices)
    return converted
