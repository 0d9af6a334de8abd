"""The size of rayflex's GPT (torch-free: the planners and the controller read it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        from rayflex.errors import ConfigError

        if self.d_model % self.n_heads:
            raise ConfigError("GPTConfig.d_model", f"d_model={self.d_model} is not divisible by "
                              f"n_heads={self.n_heads}", "pick d_model a multiple of n_heads")
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ConfigError(f"GPTConfig.{name}", "must be >= 1", "use a positive size")


def gpt_config_of(model) -> "GPTConfig | None":
    """The GPTConfig of a model made by :func:`rayflex.models.gpt` (a ModelSpec, whose
    ``build_block`` partial carries it, or a ModelSummary of one), else None."""
    import functools

    if hasattr(model, "gpt_config"):
        return model.gpt_config
    fn = getattr(model, "build_block", None)
    if isinstance(fn, functools.partial) and getattr(fn.func, "__name__", "") == "build_gpt_block" and fn.args:
        return fn.args[0]
    return None
