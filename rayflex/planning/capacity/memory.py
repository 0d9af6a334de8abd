"""Memory per rank: what a pp x dp x tp mesh with FSDP2 (or HSDP) inside each stage holds
on one device.

The model follows what rayflex actually runs (``worker/parallelize.py``,
``worker/train_worker.py``, torch's pipelining schedules), so its terms are the tensors a rank really allocates:

* **Tensor parallelism** (``tp`` > 1, Megatron-style): a rank holds ``1/tp`` of every
  block's matrices (q/k/v and MLP up by columns, o_proj and MLP down by rows; embedding
  and head split over the vocabulary); norms, row-parallel biases and a learned position
  table stay whole (:func:`tp_replicated_params`). Activations inside the split (q/k/v,
  attention output, MLP intermediates) are ``1/tp``; the block's input and norm outputs,
  which every tp rank needs whole (no sequence parallelism), are not, and neither are the
  logits: the head gathers them (``colwise_gather_output``, ``rayflex.models.tp_plan``) so
  the loss sees the whole vocabulary. Every term below is then of the rank's shard
  (``ModelDescription.split_over_tp``).
* **Sharded state** (whole run): each parameter's ``1/dp_shard`` shard (``dp_shard = dp``
  for plain FSDP; HSDP keeps a whole copy per replica of ``dp_shard`` ranks), its AdamW states
  (``optimizer_states`` of them) and, from the reduce-scatter to the next step's
  ``zero_grad(set_to_none=True)``, its sharded gradient. With ``master_weights`` the
  shards, gradients and states are fp32 while compute runs in ``param_bytes`` (FSDP2's
  MixedPrecisionPolicy); without, everything is in the parameter dtype.
* **Gathered parameters**: pp > 1 uses ``reshard_after_forward=False``, so a rank's whole
  stage (all its virtual stages when interleaved) is gathered from its first forward to
  its last backward. pp == 1 reshards after forward: one block is gathered in forward,
  two in backward (FSDP2 prefetches the next block's all-gather).
* **Unsharded gradients**: torch's pipeline stages run every backward but the last with
  ``set_requires_gradient_sync(False)``, and rayflex's pp == 1 accumulation does the same
  for all passes but the last, so FSDP2 accumulates *unsharded* gradients of the whole
  stage (pp > 1) or of the whole model (pp == 1, accumulation > 1) in the reduce dtype
  (fp32 with master weights) until the last microbatch's reduce-scatter.
* **Activations**: bytes autograd saves per microbatch per block (see
  :func:`block_activation_bytes`), times the microbatches the schedule keeps in flight.
  The schedule is simulated op by op per rank, in torch's own order: GPipe runs all ``m``
  forwards first, so it holds ``m`` microbatches; 1F1B runs ``min(m, pp - i)`` warm-up
  forwards on pp rank ``i`` and then alternates backward/forward, so rank ``i`` holds at most
  ``pp - i`` microbatches of its own blocks (stage 0 holds ``pp``, i.e. one microbatch
  through all ``L`` layers). Interleaved 1F1B with ``v`` virtual stages per rank warms up
  ``w_i = (v - 1) * r + 2 * (pp - 1 - i)`` chunk-forwards (``r = m / max(1, m // pp)``
  microbatches per round, ``r = pp`` when ``pp`` divides ``m``), then runs a forward before
  each backward, so it peaks at ``w_i + 1`` chunk-microbatches of ``L / (pp * v)`` layers
  each. On rank 0 that is ``L/pp * (pp + (pp - 1)/v)`` layer-microbatches, ``1 + (pp - 1) /
  (pp * v)`` times what 1F1B holds (Narayanan et al. 2021), in exchange for a bubble ``v``
  times smaller.
* **Activation checkpointing** (``MemoryConfig.activation_checkpointing``; a block with
  ``recompute``): the block keeps only its input for backward (the token ids for the
  embedding; for the head also what the loss saves, which runs outside the block) and
  replays its forward when backward reaches it, so during that block's backward its full
  activations exist once more: the recompute peak, added to its backward working set.
* **Pipeline buffers** (torch's ``PipelineStage``): a non-first stage allocates one
  receive buffer per microbatch (``m`` of them, kept across steps), and its memory grows by
  one input gradient per finished backward until the step ends (measured; the gradients
  wait in the send path); a non-last stage allocates ``m``
  gradient-receive buffers and keeps each in-flight microbatch's output in its forward
  cache; the last stage would keep every microbatch's logits in ``output_chunks`` until
  the next step with torch's default ``return_outputs=True`` (rayflex passes False:
  ``Runtime.keeps_outputs``).
* **Backward working set**: gradients of intermediate tensors while one block runs its
  backward (about ``(mlp_ratio - 1)`` hidden-widths per token for a transformer block,
  logits plus log-softmax gradients for the head).
* **Runtime overhead**: a configurable constant (CUDA context, NCCL/gloo buffers,
  allocator slack).

The peak of a rank is the largest of three phases: setup (rayflex builds a stage's
blocks unsharded, then ``fully_shard``s them), forward/backward (the op-by-op
simulation above) and the optimizer step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from typing import Iterable, Optional, Sequence

from rayflex.errors import ConfigError, PlacementError
from rayflex.mesh.plan import MeshPlan
from rayflex.mesh.stage_split import stage_split
from rayflex.planning.capacity.schedules import (in_flight_peak, schedule_ops, schedule_peak,  # noqa: F401
                                                 schedule_peak_linear)
from rayflex.models.gpt_config import gpt_config_of
from rayflex.models.hf_families import hf_size_of

GB = 1e9
KINDS = ("embedding", "transformer", "head", "other")


class CapacityError(PlacementError):
    """The request cannot fit: the message carries the numbers that prove it."""


# ------------------------------------------------------------------------------ precision
def replicate_state_copies(comm_config) -> int:
    """Shard-sized fp32 tensors a rank keeps for its ``CommConfig`` (charged as optimizer
    states): DiLoCo's anchor and outer momentum; int8's error feedback (the residual of its
    shard and, for the chunk it owns, of the mean: at most one more shard, padding included).
    ``"auto"`` is charged as either: whatever the planner then picks fits."""
    replicate = getattr(comm_config, "replicate", "allreduce")
    return 2 if replicate in ("diloco", "int8", "auto") else 0


# ------------------------------------------------------------------------------ precision
@dataclass(frozen=True, kw_only=True)
class Precision:
    """Bytes per element of each kind of tensor.

    ``param_bytes`` is the compute dtype (gathered parameters, activations, pipeline
    buffers): 4 for fp32, 2 for bf16/fp16. ``master_weights`` keeps the sharded
    parameters, their gradients and optimizer states in fp32 and reduces gradients in
    fp32 (FSDP2 ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``).
    """

    param_bytes: int = 4
    master_weights: bool = False
    optimizer_states: int = 2  # AdamW: exp_avg and exp_avg_sq
    # Bytes per element gradients are reduced and accumulated in (FSDP2's reduce_dtype);
    # None: 4 with master weights, else the parameter dtype.
    reduce_bytes: Optional[int] = None

    def __post_init__(self) -> None:
        if self.param_bytes not in (1, 2, 4, 8):
            raise ConfigError("Precision.param_bytes", f"got {self.param_bytes!r}", "use 4 (fp32) or 2 (bf16)")
        if self.reduce_bytes is not None and self.reduce_bytes not in (2, 4, 8):
            raise ConfigError("Precision.reduce_bytes", f"got {self.reduce_bytes!r}",
                              "use 4 (fp32), 2 (bf16) or None (follow master_weights)")
        if not isinstance(self.optimizer_states, int) or self.optimizer_states < 0:
            raise ConfigError("Precision.optimizer_states", f"got {self.optimizer_states!r}",
                              "use 2 for Adam/AdamW, 1 for momentum SGD, 0 for plain SGD")

    @property
    def sharded_bytes(self) -> int:
        """Bytes per element of a parameter shard, its gradient and each optimizer state."""
        return 4 if self.master_weights else self.param_bytes

    @property
    def accum_grad_bytes(self) -> int:
        """Bytes per element of an unsharded gradient accumulated without sync."""
        if self.reduce_bytes is not None:
            return self.reduce_bytes
        return 4 if self.master_weights else self.param_bytes

    @classmethod
    def from_config(cls, config) -> "Precision":
        """What a rayflex run with ``config`` (a :class:`rayflex.config.PrecisionConfig`)
        holds. Workers build the model in fp32 and FSDP2 keeps the shards in it, so any
        mixed policy has fp32 master weights; FSDP2 reduces and accumulates the unsharded
        gradients in ``reduce_dtype``."""
        size = {"fp32": 4, "bf16": 2}
        if not config.mixed:
            return cls()
        param, reduce = size[config.param_dtype], size[config.reduce_dtype]
        return cls(param_bytes=param, master_weights=True, reduce_bytes=None if reduce == 4 else reduce)

    @classmethod
    def named(cls, name: str) -> "Precision":
        presets = {"fp32": cls(param_bytes=4), "bf16": cls(param_bytes=2),
                   "bf16-master": cls(param_bytes=2, master_weights=True),
                   "fp16-master": cls(param_bytes=2, master_weights=True)}
        if name not in presets:
            raise ConfigError("precision", f"unknown precision {name!r}", f"use one of {sorted(presets)}")
        return presets[name]


# ------------------------------------------------------------------------------ the model
@dataclass(frozen=True, kw_only=True)
class BlockDescription:
    """One block (the unit of ``fully_shard`` and of a pipeline cut)."""

    kind: str
    params: int
    # Measured bytes autograd saves per token (replaces the formula when set).
    activation_bytes_per_token: Optional[float] = None
    # Activation checkpointing: keep only the input, recompute the block in backward.
    recompute: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError("BlockDescription.kind", f"unknown kind {self.kind!r}", f"use one of {KINDS}")
        if self.params < 0:
            raise ConfigError("BlockDescription.params", f"got {self.params}", "use a count >= 0")


@dataclass(frozen=True, kw_only=True)
class ModelDescription:
    """What the memory model needs to know about a model; no weights, no torch.

    Build one with :meth:`transformer` (a GPT-style stack described by its sizes),
    :meth:`from_hf` (a Hugging Face decoder from its config's sizes), :meth:`from_spec`
    (a rayflex ``ModelSpec``; parameter counts on the meta device) or :meth:`from_dict`
    (YAML).

    The fields after ``ffn_hidden`` shape the activation formula of a transformer block
    (:func:`decoder_activation_bytes_per_token`); their defaults are rayflex's GPT.
    """

    name: str
    blocks: tuple
    hidden_size: int
    seq_len: int
    vocab_size: int
    num_heads: int = 1
    ffn_hidden: int = 0  # 0: 4 * hidden_size
    precision: Precision = field(default_factory=Precision)
    num_kv_heads: int = 0  # 0: num_heads (grouped-query attention keeps fewer K/V heads)
    head_dim: int = 0  # 0: hidden_size // num_heads
    # Tensors of width ffn_hidden a block's MLP saves per token: 2 for fc -> GELU (fc out,
    # GELU out), 4 for SwiGLU (gate, SiLU(gate), up, their product), 5 for GPT-2's
    # composite tanh GELU (fc out, 0.5x, tanh, 1 + tanh, GELU out).
    ffn_saved_widths: float = 2.0
    norm: str = "layer"  # "layer" (LayerNorm) | "rms" (RMSNorm computed in fp32, as HF's)
    # "learned": a position table of seq_len rows (rayflex's GPT: it grows with seq_len);
    # "learned_fixed": a table of fixed size (GPT-2's n_positions); "rotary": none, each
    # layer computes cos/sin.
    positions: str = "learned"
    qk_norm: bool = False  # an RMSNorm over head_dim on q and on k (Qwen3)
    # Tensor parallelism the model supports: the sizes tp must divide (``(("attention
    # heads", 64), ...)``, the ``divides`` of ``ModelSpec.metadata["tp"]``), or None when it
    # has no TP plan; ``tp_unsupported`` then says why (rules.tp_problem reads both).
    tp_divides: Optional[tuple] = None
    tp_unsupported: str = ""
    # 1: the whole model. k > 1: the view of one rank of a k-way tp group (block params are
    # its shard; the activation formulas split accordingly), made by split_over_tp.
    tp_split: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "blocks", tuple(self.blocks))
        if not self.blocks:
            raise ConfigError("ModelDescription.blocks", "no blocks", "describe at least one block")
        for name in ("hidden_size", "seq_len", "vocab_size", "num_heads"):
            if getattr(self, name) < 1:
                raise ConfigError(f"ModelDescription.{name}", f"must be >= 1, got {getattr(self, name)}",
                                  "give the model's size")
        if not self.ffn_hidden:
            object.__setattr__(self, "ffn_hidden", 4 * self.hidden_size)
        if not self.num_kv_heads:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if not self.head_dim:
            object.__setattr__(self, "head_dim", max(1, self.hidden_size // self.num_heads))
        if self.norm not in ("layer", "rms"):
            raise ConfigError("ModelDescription.norm", f"unknown norm {self.norm!r}", "use 'layer' or 'rms'")
        if self.positions not in ("learned", "learned_fixed", "rotary"):
            raise ConfigError("ModelDescription.positions", f"unknown positions {self.positions!r}",
                              "use 'learned', 'learned_fixed' or 'rotary'")

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    # cached: the search reads them for every candidate (the fields are frozen)
    @cached_property
    def block_params(self) -> tuple:
        return tuple(b.params for b in self.blocks)

    @cached_property
    def total_params(self) -> int:
        return sum(self.block_params)

    @cached_property
    def recompute_mask(self) -> tuple:
        """Which blocks recompute in backward (activation checkpointing), block by block."""
        return tuple(b.recompute for b in self.blocks)

    @property
    def num_layers(self) -> int:
        return sum(1 for b in self.blocks if b.kind == "transformer")

    def with_precision(self, precision: Precision) -> "ModelDescription":
        return replace(self, precision=precision)

    def tp_metadata(self) -> dict:
        """``ModelSpec.metadata``'s "tp" entry as ``rules.tp_problem`` reads it."""
        if self.tp_divides is None:
            return {"tp": {"unsupported": self.tp_unsupported}} if self.tp_unsupported else {}
        return {"tp": {"plan": "megatron", "divides": dict(self.tp_divides)}}

    def tp_problem(self, tp: int):
        """Why this model cannot run tp-way tensor parallel (a ConfigError), or None."""
        from rayflex.mesh.rules import tp_problem

        return tp_problem(self.tp_metadata(), tp, model=self.name)

    def split_over_tp(self, tp: int) -> "ModelDescription":
        """One rank's view of the model split over ``tp`` ranks (module docstring)."""
        if tp == 1 or self.tp_split == tp:
            return self
        if self.tp_split != 1:
            raise ValueError(f"{self.name} is already split over tp={self.tp_split}")
        views = self.__dict__.setdefault("_tp_views", {})  # the search asks once per candidate
        if tp not in views:
            views[tp] = self._split(tp)
        return views[tp]

    def _split(self, tp: int) -> "ModelDescription":
        e = self.precision.param_bytes
        blocks = []
        for b in self.blocks:
            whole = tp_replicated_params(self, b)
            measured = b.activation_bytes_per_token
            if measured is not None:  # its input (one hidden width) is whole, the rest split
                keep = min(measured, self.hidden_size * e)
                measured = keep + (measured - keep) / tp
            blocks.append(replace(b, params=whole + (b.params - whole) / tp, activation_bytes_per_token=measured))
        return replace(self, blocks=tuple(blocks), tp_split=tp)

    def with_checkpointing(self, memory) -> "ModelDescription":
        """Blocks recomputed as ``memory`` (a :class:`rayflex.config.MemoryConfig`) selects
        them; the same rule (``MemoryConfig.checkpointed``) the workers follow."""
        return replace(self, blocks=tuple(replace(b, recompute=memory.checkpointed(i))
                                          for i, b in enumerate(self.blocks)))

    def for_run(self, precision_config=None, memory_config=None, comm_config=None) -> "ModelDescription":
        """This model as a run with these rayflex configs executes it (None: the default)."""
        model = self
        if precision_config is not None:
            model = model.with_precision(Precision.from_config(precision_config))
        extra = replicate_state_copies(comm_config)
        if extra:
            model = model.with_precision(replace(model.precision, optimizer_states=model.precision.optimizer_states
                                                 + extra))
        if memory_config is not None:
            model = model.with_checkpointing(memory_config)
        return model

    def with_seq_len(self, seq_len: int) -> "ModelDescription":
        """Same model at another sequence length (a position table of ``seq_len`` rows
        grows too; a fixed table or rotary positions do not)."""
        if self.positions != "learned":
            return replace(self, seq_len=seq_len)
        blocks = tuple(replace(b, params=b.params + (seq_len - self.seq_len) * self.hidden_size)
                       if b.kind == "embedding" else b for b in self.blocks)
        return replace(self, seq_len=seq_len, blocks=blocks)

    # ---- constructors -------------------------------------------------------------
    @classmethod
    def transformer(cls, name: str, *, n_layers: int, d_model: int, n_heads: int, vocab_size: int,
                    seq_len: int, ffn_hidden: int = 0, precision: Precision | None = None,
                    tp_divides: Optional[tuple] = None) -> "ModelDescription":
        """rayflex's GPT block structure (``models/gpt.py``) at any size: learned token and
        position embeddings, pre-norm blocks with a biased QKV/proj and a two-matrix GELU
        MLP, an untied head. ``tp_divides``: see the field (None: no TP plan)."""
        h, f = d_model, ffn_hidden or 4 * d_model
        layer = 4 * h * h + 2 * h * f + 9 * h + f  # qkv+proj (w, b), fc+out (w, b), 2 LayerNorms
        blocks = ([BlockDescription(kind="embedding", params=(vocab_size + seq_len) * h)]
                  + [BlockDescription(kind="transformer", params=layer) for _ in range(n_layers)]
                  + [BlockDescription(kind="head", params=vocab_size * h + 2 * h)])
        return cls(name=name, blocks=tuple(blocks), hidden_size=h, seq_len=seq_len, vocab_size=vocab_size,
                   num_heads=n_heads, ffn_hidden=f, precision=precision or Precision(), tp_divides=tp_divides)

    @classmethod
    def from_gpt(cls, cfg, precision: Precision | None = None) -> "ModelDescription":
        """From a :class:`rayflex.models.GPTConfig`."""
        return cls.transformer(f"gpt-{cfg.n_layers}x{cfg.d_model}", n_layers=cfg.n_layers, d_model=cfg.d_model,
                               n_heads=cfg.n_heads, vocab_size=cfg.vocab_size, seq_len=cfg.seq_len,
                               ffn_hidden=cfg.mlp_ratio * cfg.d_model, precision=precision)

    @classmethod
    def from_hf(cls, size, *, name: str, seq_len: int, precision: Precision | None = None) -> "ModelDescription":
        """A Hugging Face decoder (:class:`rayflex.models.hf_families.HFSize`, what
        ``causal_lm`` records in ``ModelSpec.metadata``) as rayflex splits it: embeddings,
        one block per layer, final norm + an untied ``lm_head``."""
        blocks = ([BlockDescription(kind="embedding", params=size.embedding_params())]
                  + [BlockDescription(kind="transformer", params=size.layer_params()) for _ in range(size.num_layers)]
                  + [BlockDescription(kind="head", params=size.head_params())])
        saved = 4.0 if size.gated_mlp else {"gelu_new": 5.0}.get(size.activation, 2.0)
        return cls(name=name, blocks=tuple(blocks), hidden_size=size.hidden_size, seq_len=seq_len,
                   vocab_size=size.vocab_size, num_heads=size.num_heads, ffn_hidden=size.intermediate_size,
                   precision=precision or Precision(), num_kv_heads=size.num_kv_heads, head_dim=size.head_dim,
                   ffn_saved_widths=saved, norm="layer" if size.layer_norm else "rms",
                   positions="learned_fixed" if size.learned_positions else "rotary", qk_norm=size.qk_norm)

    @classmethod
    def from_spec(cls, spec, *, seq_len: int, precision: Precision | None = None,
                  activation_bytes_per_token: Sequence[float] | None = None) -> "ModelDescription":
        """From a rayflex ``ModelSpec``.

        A spec made by :func:`rayflex.models.gpt` is described exactly (its config is in
        the ``build_block`` partial), and so is one made by
        :func:`rayflex.models.hf.causal_lm` (its sizes are in ``spec.metadata``). Any other
        spec gets parameter counts from the meta device and needs
        ``activation_bytes_per_token`` per block, e.g. from :func:`measure_activation_bytes`
        on this host.
        """
        tp = _tp_support(getattr(spec, "metadata", None))
        cfg = gpt_config_of(spec)
        if cfg is not None and activation_bytes_per_token is None:
            # parameters from the model's config (its position table), activations at the
            # data's sequence length
            return replace(cls.from_gpt(cfg, precision), name=spec.name, seq_len=seq_len, **tp)
        hf = hf_size_of(spec)
        if hf is not None and activation_bytes_per_token is None:
            return replace(cls.from_hf(hf, name=spec.name, seq_len=seq_len, precision=precision), **tp)
        if activation_bytes_per_token is None:
            raise ConfigError("ModelDescription.from_spec",
                              f"model {spec.name!r} is not a rayflex GPT, so its activation sizes are unknown",
                              "pass activation_bytes_per_token=measure_activation_bytes(spec, seq_len)")
        counts = spec.param_counts()
        if len(activation_bytes_per_token) != len(counts):
            raise ConfigError("activation_bytes_per_token", f"{len(activation_bytes_per_token)} values for "
                              f"{len(counts)} blocks", "give one figure per block")
        blocks = tuple(BlockDescription(kind="other", params=c, activation_bytes_per_token=float(a))
                       for c, a in zip(counts, activation_bytes_per_token))
        return cls(name=spec.name, blocks=blocks, hidden_size=spec.hidden_size or 1, seq_len=seq_len,
                   vocab_size=1, precision=precision or Precision(), **tp)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelDescription":
        """``{name, n_layers, d_model, n_heads, vocab_size, seq_len, ffn_hidden?, precision?}``
        (a GPT-style stack), or ``{name, blocks: [{kind, params, activation_bytes_per_token?}],
        hidden_size, seq_len, vocab_size, num_heads?, precision?}``. ``precision`` is a preset
        name (``fp32``, ``bf16``, ``bf16-master``) or ``{param_bytes, master_weights}``.
        ``tp``: ``{divides: {attention heads: 64, ...}}`` if the model can be split
        Megatron-style, ``false`` if not; a GPT-style stack without it is assumed splittable
        over divisors of ``n_heads`` (like the presets), a ``blocks`` list is not."""
        d = dict(d)
        prec = d.pop("precision", None)
        precision = (Precision.named(prec) if isinstance(prec, str)
                     else Precision(**prec) if isinstance(prec, dict) else Precision())
        tp = d.pop("tp", None)
        if tp not in (None, False) and not (isinstance(tp, dict) and isinstance(tp.get("divides", {}), dict)):
            raise ConfigError("model description.tp", f"expected {{divides: {{...}}}} or false, got {tp!r}",
                              "write tp: {divides: {attention heads: 64}} or tp: false")
        try:
            if "blocks" in d:
                blocks = tuple(BlockDescription(**b) for b in d.pop("blocks"))
                divides = None if not tp else tuple(sorted(tp.get("divides", {}).items()))
                return cls(blocks=blocks, precision=precision, tp_divides=divides, **d)
            if tp is None:
                divides = (("attention heads", d.get("n_heads", 1)),)
            else:
                divides = None if tp is False else tuple(sorted(tp.get("divides", {}).items()))
            return cls.transformer(d.pop("name", "model"), precision=precision, tp_divides=divides, **d)
        except TypeError as e:
            raise ConfigError("model description", str(e), "see ModelDescription.from_dict for the fields") from None

    def to_dict(self) -> dict:
        out = asdict(self)
        out["total_params"] = self.total_params
        return out


def describe_model(model, seq_len: int, precision: Precision | None = None) -> ModelDescription:
    """A ModelDescription from a ModelSpec (measured on CPU when it is not a rayflex GPT);
    a ModelDescription passes through (at ``seq_len``). For a run's precision and
    activation checkpointing, follow with :meth:`ModelDescription.for_run`."""
    if isinstance(model, ModelDescription):
        return model if model.seq_len == seq_len else model.with_seq_len(seq_len)
    if gpt_config_of(model) is not None or hf_size_of(model) is not None:
        return ModelDescription.from_spec(model, seq_len=seq_len, precision=precision)
    # Not a rayflex GPT: activations are measured by running its blocks. A ModelSummary (the
    # controller's torch-free view) must load the model for that, importing torch.
    spec = model.load() if hasattr(model, "load") else model
    return ModelDescription.from_spec(model, seq_len=seq_len, precision=precision,
                                      activation_bytes_per_token=measure_activation_bytes(spec, seq_len))


# The two famous sizes used by the docs and the CLI (``--model 7b|70b``): rayflex's GPT
# block structure at LLaMA-like widths, bf16 compute with fp32 master weights.
PRESETS = {
    "7b": dict(name="gpt-7b", n_layers=32, d_model=4096, n_heads=32, ffn_hidden=16384, vocab_size=32000,
               seq_len=2048),
    "70b": dict(name="gpt-70b", n_layers=80, d_model=8192, n_heads=64, ffn_hidden=36864, vocab_size=32000,
                seq_len=1024),
}


# Both are assumed splittable Megatron-style; tp must divide their attention heads and the
# 8 key/value heads of the LLaMA models whose widths they take (GQA), so that a tp chosen
# for the preset is one the real model takes too.
PRESET_KV_HEADS = 8


def preset(name: str, precision: Precision | None = None) -> ModelDescription:
    key = name.lower()
    if key not in PRESETS:
        raise ConfigError("--model", f"unknown model {name!r}", f"use one of {sorted(PRESETS)} or a YAML file")
    divides = (("attention heads", PRESETS[key]["n_heads"]), ("kv heads", PRESET_KV_HEADS))
    return ModelDescription.transformer(precision=precision or Precision.named("bf16-master"), tp_divides=divides,
                                        **PRESETS[key])


def _tp_support(metadata) -> dict:
    """``tp_divides`` / ``tp_unsupported`` from a ModelSpec's metadata (the model contract:
    ``metadata["tp"] = {"plan": ..., "divides": {...}}``; no plan, no TP)."""
    info = (metadata or {}).get("tp")
    if info and info.get("plan"):
        return {"tp_divides": tuple(sorted((str(k), int(v)) for k, v in (info.get("divides") or {}).items()))}
    return {"tp_divides": None, "tp_unsupported": str((info or {}).get("unsupported") or "")}


def tp_replicated_params(model: ModelDescription, block: BlockDescription) -> float:
    """Parameters of ``block`` every tp rank keeps whole: norm weights (and LayerNorm
    biases), the row-parallel biases of rayflex's GPT (o_proj, MLP down: added after the
    all-reduce), q/k norms, a learned position table, the head's final norm. The matrices,
    the column-parallel biases and the vocabulary split."""
    h = model.hidden_size
    norm = 2 * h if model.norm == "layer" else h  # weight (+ bias) of one norm
    if block.kind == "transformer":
        row_biases = 2 * h if model.norm == "layer" else 0  # rayflex's GPT is biased, HF's Llama is not
        qk = 2 * model.head_dim if model.qk_norm else 0
        whole = 2 * norm + row_biases + qk
    elif block.kind == "embedding":
        whole = model.seq_len * h if model.positions == "learned" else 0
    elif block.kind == "head":
        whole = norm
    else:
        whole = 0
    return min(float(block.params), float(whole))


# ------------------------------------------------------------------------------ activations
def transformer_activation_bytes_per_token(h: int, ffn: int, heads: int, e: int) -> float:
    """Bytes one rayflex transformer block saves for backward, per token.

    Korthikanti et al. 2022 count ``s*b*h*(34 + 5*a*s/h)`` bytes per layer in fp16 without
    recomputation: 34 = 2-byte tensors (input, LN outputs, QKV, attention output, two MLP
    tensors of 4h each, ...) plus two 1-byte dropout masks, and ``5*a*s/h`` for the
    attention scores, softmax and its dropout mask. rayflex's block has no dropout and
    uses fused (flash) attention, which saves only q, k, v, the output and a per-head
    logsumexp, so per token it keeps ``(8 + 2 * ffn/h)`` hidden-widths in the compute dtype
    (x, LN1 out, q/k/v, attention out, x after attention, LN2 out, fc out and GELU out of
    ``ffn`` each) plus fp32 LN statistics (4 values) and logsumexp (one per head). For
    ffn = 4h in fp16 that is 32 bytes * h: Korthikanti's 34 without the masks.
    Measured on CPU for rayflex's GPT it is exact (16.03 * 4 * h bytes at h = 128, 256).
    """
    return (8 * h + 2 * ffn) * e + (4 + heads) * 4


def decoder_activation_bytes_per_token(model: ModelDescription, e: int, micro_batch: int = 1) -> float:
    """Bytes one transformer block of ``model`` saves for backward, per token: the formula
    above generalised to grouped-query attention, RMSNorm, gated MLPs, rotary positions
    and q/k norms (Hugging Face's Llama, Qwen, Mistral, GPT-2 layers). For rayflex's GPT
    (the description's defaults) it is exactly :func:`transformer_activation_bytes_per_token`.

    * attention: q and the attention output (``num_heads * head_dim`` each), k and v
      (``num_kv_heads * head_dim`` each: SDPA takes them grouped), a logsumexp per head;
    * norms: LayerNorm keeps its input and output (and fp32 mean and rstd); HF's RMSNorm
      upcasts, so it keeps an fp32 input, the normalised and the scaled output, one rstd;
    * MLP: ``ffn_saved_widths`` tensors of ``ffn_hidden``;
    * rotary: cos and sin (``head_dim`` each), one row per position, shared by the batch;
    * q/k norms: RMSNorms over the q and k widths.

    Measured on CPU for tiny Llama, Qwen3 and GPT-2 layers in fp32 and bf16 it is exact
    to within a few bytes per token. On one rank of a tp group (``model.tp_split``) the
    attention, MLP and q/k-norm terms are its heads' and columns' share; the norms' inputs
    and outputs stay whole.
    """
    h, f, t = model.hidden_size, model.ffn_hidden, model.tp_split
    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    # split over tp ranks (their heads and their columns of the MLP): attention, MLP, q/k norms
    attn = (2 * q + 2 * kv) * e + 4 * model.num_heads
    split = attn + model.ffn_saved_widths * f * e
    if model.qk_norm:
        split += (4 + e) * (q + kv) + 4 * (model.num_heads + model.num_kv_heads)
    # whole on every tp rank: the norms' inputs and outputs (the residual stream), rotary tables
    if model.norm == "rms":
        whole = 2 * (4 * h + 2 * h * e + 4)
    else:
        whole = 2 * (2 * h * e + 8)
    if model.positions == "rotary":
        whole += 2 * model.head_dim * e / max(1, micro_batch)
    return whole + split / t


def block_activation_bytes(model: ModelDescription, block: BlockDescription, tokens: int,
                           micro_batch: int) -> float:
    """Bytes a block saves for backward for one microbatch of ``tokens`` tokens."""
    if block.recompute:
        return recomputed_block_kept_bytes(model, block, tokens)
    return _saved_bytes(model, block, tokens, micro_batch)


def recomputed_block_kept_bytes(model: ModelDescription, block: BlockDescription, tokens: int) -> float:
    """Bytes a recomputed block keeps through backward: its input (token ids for the
    embedding, one hidden-width otherwise); the head also keeps what the loss after it
    saves (fp32 log-softmax output and int64 targets), since the loss is not recomputed."""
    h, e = model.hidden_size, model.precision.param_bytes
    if block.kind == "embedding":
        return 8 * tokens
    if block.kind == "head" and block.activation_bytes_per_token is None:
        return (h * e + 4 * model.vocab_size + 8) * tokens
    return h * e * tokens


def _saved_bytes(model: ModelDescription, block: BlockDescription, tokens: int, micro_batch: int) -> float:
    """Bytes a block saves for backward without recomputation."""
    if block.activation_bytes_per_token is not None:
        return block.activation_bytes_per_token * tokens
    h, e = model.hidden_size, model.precision.param_bytes
    if block.kind == "transformer":
        return decoder_activation_bytes_per_token(model, e, micro_batch) * tokens
    if block.kind == "embedding":
        # token ids (int64) and the position ids (one row per microbatch; rotary models
        # make their positions in every layer)
        if model.positions == "rotary":
            return 8 * tokens
        return 8 * tokens + 8 * (tokens // max(1, micro_batch))
    if block.kind == "head":
        # LayerNorm input and output, fp32 log-softmax output (the loss upcasts), int64
        # targets, fp32 LN statistics (RMSNorm: fp32 input, normalised and scaled output,
        # one fp32 rstd)
        if model.norm == "rms":
            return (4 * h + 2 * h * e + 4 * model.vocab_size + 8 + 4) * tokens
        return (2 * h * e + 4 * model.vocab_size + 8 + 8) * tokens
    return 2 * h * e * tokens


def block_backward_workspace(model: ModelDescription, block: BlockDescription, tokens: int,
                             micro_batch: int = 1) -> float:
    """Transient bytes while one block runs its backward (gradients of its intermediates);
    a recomputed block has its activations again on top (the recompute peak)."""
    work = _gradient_workspace(model, block, tokens)
    if block.recompute:
        work += max(0.0, _saved_bytes(model, block, tokens, micro_batch)
                    - recomputed_block_kept_bytes(model, block, tokens))
    return work


def _gradient_workspace(model: ModelDescription, block: BlockDescription, tokens: int) -> float:
    h, e, t = model.hidden_size, model.precision.param_bytes, model.tp_split
    if block.kind == "transformer":
        width = model.ffn_hidden / t - h  # the MLP intermediate's gradient, net of what backward frees
        if t > 1:  # at least the (whole) input gradient being all-reduced over the tp group
            width = max(width, h)
        return width * e * tokens
    if block.kind == "head":  # the head gathers whole logits over the tp group (tp_plan)
        return model.vocab_size * (4 + e) * tokens
    return h * e * tokens


# ------------------------------------------------------------------------------ runtime
@dataclass(frozen=True, kw_only=True)
class Runtime:
    """Properties of the training runtime that move the peak, with rayflex's current values.

    * ``overhead_bytes``: per-process constant (CUDA context and NCCL buffers on GPU, about
      1-2 GB; on CPU it is below the measurement noise, see :meth:`cpu`).
    * ``keeps_outputs``: the last stage keeps every microbatch's logits until the next step
      (``schedule.step(..., return_outputs=True)``, torch's default; rayflex passes False).
    * ``leaks_inference_graph``: the worker's activation probe (``saved_tensors_hooks``
      whose packed objects hold the saved tensor with its ``grad_fn``) makes a reference
      cycle through autograd's C++ graph; a graph whose backward never runs is then never
      freed. torch's pipelining runs one such forward on the first stage for shape
      inference at the first step, so stage 0 keeps one microbatch of its activations for
      the whole run. (Packing ``t.detach()`` in ``ActivationCounter.pack`` would fix it.)
    * ``materializes_stage``: setup builds each local stage unsharded before
      ``fully_shard`` (in ``sharded_bytes`` per parameter); a meta-device build would
      remove this setup peak.
    * ``foreach_optimizer``: AdamW's foreach path allocates temporaries the size of all
      local shards; the per-parameter loop only the largest parameter's. rayflex's default
      kernel is fused (``OptimizerConfig.implementation``), which needs neither: both
      settings over-count it, the GPU one by the shards' size (a safe side to err on).
    """

    overhead_bytes: float = 0.0
    keeps_outputs: bool = False
    leaks_inference_graph: bool = False
    materializes_stage: bool = True
    foreach_optimizer: bool = False

    @classmethod
    def gpu(cls, overhead_bytes: float = 2 * GB) -> "Runtime":
        return cls(overhead_bytes=overhead_bytes, foreach_optimizer=True)

    @classmethod
    def cpu(cls, overhead_bytes: float = 0.0) -> "Runtime":
        """CPU workers: measured against real workers (benchmarks/capacity.py), what the
        runtime adds besides tensors once imports are done is within a few hundred KB of
        what the terms above already over-count, so the default overhead is 0."""
        return cls(overhead_bytes=overhead_bytes, foreach_optimizer=False)


@dataclass(frozen=True)
class RankMemory:
    """Bytes one pp rank (any of its dp replicas) holds at its peak, by term."""

    pp_index: int
    peak_bytes: float
    phase: str  # which phase holds the peak: setup | forward_backward | optimizer
    params_sharded: float
    optimizer_states: float
    grads: float  # sharded (optimizer phase) or unsharded (accumulating) at the peak
    params_gathered: float
    activations: float
    pipeline_buffers: float
    workspace: float
    overhead: float
    setup_bytes: float
    optimizer_phase_bytes: float
    forward_backward_bytes: float
    activation_microbatches: float  # microbatch-equivalents of activations at the peak
    unsharded_at_setup: float = 0.0  # setup phase: the stage built unsharded before fully_shard
    inference_graph: float = 0.0  # activations kept by the never-freed shape-inference graph
    # What no activation checkpointing removes: the largest of setup, the optimizer step
    # without the shape-inference graph, and forward/backward's state, gathered parameters,
    # pipeline receive buffers (unsharded accumulated gradients for pp == 1) and overhead. A
    # lower bound of the peak whichever blocks recompute (the capacity search's pruning).
    fixed_bytes: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    def breakdown(self) -> str:
        parts = [("sharded params", self.params_sharded), ("optimizer", self.optimizer_states),
                 ("grads", self.grads), ("gathered params", self.params_gathered),
                 ("activations", self.activations), ("pipeline buffers", self.pipeline_buffers),
                 ("workspace", self.workspace), ("stage built unsharded", self.unsharded_at_setup),
                 ("overhead", self.overhead)]
        return " + ".join(f"{name} {fmt_bytes(v)}" for name, v in parts if v > 0)


@dataclass(frozen=True)
class MemoryEstimate:
    layout: MeshPlan
    ranks: tuple  # RankMemory per pp index

    @property
    def peak_bytes(self) -> float:
        return max(r.peak_bytes for r in self.ranks)

    @property
    def peak_rank(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.peak_bytes)

    @property
    def fixed_bytes(self) -> float:
        """The most bytes a rank holds whatever blocks recompute (``RankMemory.fixed_bytes``)."""
        return max(r.fixed_bytes for r in self.ranks)


def fmt_bytes(b: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(b) >= size:
            return f"{b / size:.1f} {unit}"
    return f"{b:.0f} B"


# ------------------------------------------------------------------------------ estimate
def estimate_memory(model: ModelDescription, layout: MeshPlan, runtime: Runtime | None = None) -> MemoryEstimate:
    """Peak bytes of every pp rank of ``layout`` (dp and tp ranks of a stage hold the same)."""
    runtime = runtime or Runtime()
    # stages are cut on the whole model's parameter counts, as the workers cut them
    stage_blocks = layout.stage_blocks or stage_split(model.block_params, layout.num_stages)
    model = model.split_over_tp(layout.tp)
    if len(stage_blocks) != layout.num_stages:
        raise ConfigError("MeshPlan.stage_blocks", f"{len(stage_blocks)} stages for pp={layout.pp} x "
                          f"stages_per_rank={layout.stages_per_rank}", "give one block list per stage")
    if layout.pp == 1:
        return MemoryEstimate(layout, (_rank_memory_fsdp(model, layout, runtime),))
    ranks = tuple(_rank_memory_pipeline(model, layout, stage_blocks, i, runtime) for i in range(layout.pp))
    return MemoryEstimate(layout, ranks)


def rank_exceeds(model: ModelDescription, layout: MeshPlan, pp_index: int, limit: float,
                 runtime: Runtime | None = None) -> bool:
    """Whether pp rank ``pp_index`` of ``layout`` peaks above ``limit``: one rank of
    :func:`estimate_memory` (the capacity search asks it of the rank most likely to break
    before estimating them all)."""
    runtime = runtime or Runtime()
    stage_blocks = layout.stage_blocks or stage_split(model.block_params, layout.num_stages)
    model = model.split_over_tp(layout.tp)
    if layout.pp == 1:
        return _rank_memory_fsdp(model, layout, runtime).peak_bytes > limit
    return _rank_memory_pipeline(model, layout, stage_blocks, pp_index, runtime).peak_bytes > limit


def _state_bytes(model: ModelDescription, params: float, dp: int) -> tuple[float, float, float]:
    p = model.precision
    shard = params / dp
    return shard * p.sharded_bytes, shard * p.sharded_bytes * p.optimizer_states, shard * p.sharded_bytes


def _optimizer_temp(model: ModelDescription, params: float, largest: float, dp: int, runtime: Runtime) -> float:
    b = model.precision.sharded_bytes
    return (params if runtime.foreach_optimizer else largest) / dp * b


def _rank_memory_fsdp(model: ModelDescription, layout: MeshPlan, runtime: Runtime) -> RankMemory:
    """pp == 1: FSDP over the whole model, accumulation passes one after another."""
    p, dp = model.precision, layout.dp_shard
    total = model.total_params
    largest = max(model.block_params)
    params_sh, opt, grads_sh = _state_bytes(model, total, dp)
    tokens = layout.micro_batch * model.seq_len
    acts = sum(block_activation_bytes(model, b, tokens, layout.micro_batch) for b in model.blocks)
    workspace = max(block_backward_workspace(model, b, tokens, layout.micro_batch) for b in model.blocks)
    gathered = 2 * largest * p.param_bytes  # this block and the prefetched next one (backward)
    if layout.accum_steps > 1:
        # every parameter's unsharded gradient from pass 2 on, and in the last pass the
        # reduce-scatter's staging copy of the block being reduced
        grads = (total + largest) * p.accum_grad_bytes
    else:
        grads = grads_sh + largest * p.accum_grad_bytes  # shards so far + the block being reduced
    fb = params_sh + opt + gathered + acts + grads + workspace + runtime.overhead_bytes
    opt_phase = (params_sh + opt + grads_sh + _optimizer_temp(model, total, largest, dp, runtime)
                 + runtime.overhead_bytes)
    setup = _setup_bytes(model, [total], largest, dp, runtime)
    return _pick(0, runtime, setup=setup, fb=fb, opt_phase=opt_phase, params_sharded=params_sh, optimizer=opt,
                 grads=grads, gathered=gathered, acts=acts, buffers=0.0, workspace=workspace, grads_sh=grads_sh,
                 mbs=1.0, fixed=max(setup, opt_phase, fb - acts - workspace))


def _setup_bytes(model: ModelDescription, stage_params: Iterable[float], largest: float, dp: int,
                 runtime: Runtime) -> float:
    b = model.precision.sharded_bytes
    params = sum(stage_params)
    if runtime.materializes_stage:
        # every block unsharded, plus the shard being copied out of the block in hand
        return params * b + largest * b / dp + runtime.overhead_bytes
    return params * b / dp + runtime.overhead_bytes


@dataclass(frozen=True)
class _Walk:
    """What a pp rank's schedule holds at its peak, independent of dp and the shard-group size
    (so the search's HSDP variants of a mesh share one walk)."""

    chunk_params: tuple
    largest: float
    persistent_buffers: float
    leak: float
    acts: float
    grads: float
    kept: float
    workspace: float
    live: int
    end_kept: float
    mean_chunk: float


_WALKS: dict = {}  # (id(model), ...) -> (model, _Walk); the model is kept so its id stays its own
_WALKS_SIZE = 8192


def _pipeline_walk(model: ModelDescription, layout: MeshPlan, stage_blocks, pp_index: int, runtime: Runtime) -> _Walk:
    blocks = stage_blocks if isinstance(stage_blocks, tuple) else tuple(tuple(b) for b in stage_blocks)
    key = (id(model), layout.schedule, layout.pp, layout.microbatches, layout.stages_per_rank, layout.micro_batch,
           blocks, pp_index, runtime)
    hit = _WALKS.get(key)
    if hit is not None and hit[0] is model:
        return hit[1]
    walk = _walk(model, layout, blocks, pp_index, runtime)
    if len(_WALKS) >= _WALKS_SIZE:
        _WALKS.clear()
    _WALKS[key] = (model, walk)
    return walk


def _walk(model: ModelDescription, layout: MeshPlan, stage_blocks, pp_index: int, runtime: Runtime) -> _Walk:
    p, m, v = model.precision, layout.microbatches, layout.stages_per_rank
    e, h = p.param_bytes, model.hidden_size
    tokens = layout.micro_batch * model.seq_len
    last_stage = layout.num_stages - 1
    stages = layout.local_stages(pp_index)
    # one activation (or its gradient) crossing a stage boundary: whole on every tp rank
    boundary = tokens * h * e
    logits = tokens * model.vocab_size * e  # whole: the head gathers them over the tp group
    chunk_params, chunk_acts, chunk_ws, chunk_in_grad, chunk_keep = [], [], [], [], []
    chunk_first_grads = []
    persistent_buffers = 0.0
    largest = 0.0
    for s in stages:
        params, big, saved, ws, first_grads, first_kind = _chunk_terms(model, stage_blocks[s], tokens,
                                                                       layout.micro_batch)
        chunk_params.append(params)
        largest = max(largest, big)
        if s > 0:
            # the first block's saved input is the receive buffer, counted below
            saved -= boundary if first_kind in ("transformer", "head", "other") else 0.0
            persistent_buffers += m * boundary  # one receive buffer per microbatch
        if s < last_stage:
            saved += boundary  # the output waits in the forward cache until its backward
            persistent_buffers += m * boundary  # one gradient-receive buffer per microbatch
        chunk_acts.append(saved)
        chunk_ws.append(ws)
        chunk_first_grads.append(first_grads)
        chunk_in_grad.append(boundary if s > 0 else 0.0)
        chunk_keep.append(logits if (s == last_stage and runtime.keeps_outputs) else 0.0)
    leak = chunk_acts[0] if (runtime.leaks_inference_graph and stages[0] == 0) else 0.0

    chunks = (chunk_acts, chunk_keep, chunk_in_grad, chunk_ws, chunk_first_grads,
              [c * p.accum_grad_bytes for c in chunk_params])
    if v == 1 and layout.schedule in ("gpipe", "1f1b"):
        best = schedule_peak_linear(layout.schedule, pp_index, layout.pp, m, *(c[0] for c in chunks))
    else:
        best = schedule_peak(layout.schedule, pp_index, layout.pp, m, v, *chunks)
    _, acts_pk, grads_pk, kept_pk, ws_pk, live_pk = best
    end_kept = sum(m * (k + g) for k, g in zip(chunk_keep, chunk_in_grad))
    return _Walk(tuple(chunk_params), largest, persistent_buffers, leak, acts_pk, grads_pk, kept_pk, ws_pk,
                 live_pk, end_kept, sum(chunk_acts) / len(chunk_acts))


_CHUNKS: dict = {}  # (id(model), block indices, tokens, micro_batch) -> (model, terms)


def _chunk_terms(model: ModelDescription, indices: tuple, tokens: int, micro_batch: int) -> tuple:
    """``(params, largest block, saved activations, backward workspace, first backward's
    growth, first block's kind)`` of one stage's blocks; many layouts share a stage."""
    key = (id(model), indices, tokens, micro_batch)
    hit = _CHUNKS.get(key)
    if hit is not None and hit[0] is model:
        return hit[1]
    blocks = [model.blocks[i] for i in indices]
    terms = (sum(b.params for b in blocks), max(b.params for b in blocks),
             sum(block_activation_bytes(model, b, tokens, micro_batch) for b in blocks),
             max(block_backward_workspace(model, b, tokens, micro_batch) for b in blocks),
             _first_backward_growth(model, blocks, tokens, micro_batch), blocks[0].kind)
    if len(_CHUNKS) >= _WALKS_SIZE:
        _CHUNKS.clear()
    _CHUNKS[key] = (model, terms)
    return terms


def _rank_memory_pipeline(model: ModelDescription, layout: MeshPlan, stage_blocks, pp_index: int,
                          runtime: Runtime) -> RankMemory:
    w = _pipeline_walk(model, layout, stage_blocks, pp_index, runtime)
    dp, e = layout.dp_shard, model.precision.param_bytes
    stage_params = sum(w.chunk_params)
    params_sh, opt, grads_sh = _state_bytes(model, stage_params, dp)
    gathered = stage_params * e
    base = params_sh + opt + w.persistent_buffers + w.leak + runtime.overhead_bytes
    fb = base + gathered + w.acts + w.grads + w.kept + w.workspace
    opt_phase = (params_sh + opt + grads_sh + w.persistent_buffers + w.leak + w.end_kept + runtime.overhead_bytes
                 + _optimizer_temp(model, stage_params, w.largest, dp, runtime))
    setup = _setup_bytes(model, w.chunk_params, w.largest, dp, runtime)
    fixed = max(setup, opt_phase - w.leak, params_sh + opt + w.persistent_buffers + runtime.overhead_bytes + gathered)
    return _pick(pp_index, runtime, setup=setup, fb=fb, opt_phase=opt_phase, params_sharded=params_sh,
                 optimizer=opt, grads=w.grads, gathered=gathered, acts=w.acts + w.leak,
                 buffers=w.persistent_buffers + w.kept, workspace=w.workspace, grads_sh=grads_sh,
                 mbs=(w.acts / w.mean_chunk if w.mean_chunk else float(w.live)),
                 opt_buffers=w.persistent_buffers + w.end_kept, leak=w.leak, fixed=fixed)


def _first_backward_growth(model: ModelDescription, blocks, tokens: int, micro_batch: int) -> float:
    """Most bytes the first backward of a stage adds on top of its saved activations.

    Backward walks the blocks last to first: when block ``k`` runs, the (unsharded)
    gradients of blocks ``k..n`` exist and the activations of blocks ``k+1..n`` are gone.
    """
    g = model.precision.accum_grad_bytes
    best, grads, freed = 0.0, 0.0, 0.0
    for b in reversed(blocks):
        grads += b.params * g
        best = max(best, grads - freed)
        freed += block_activation_bytes(model, b, tokens, micro_batch)
    return best


def _pick(pp_index: int, runtime: Runtime, *, setup: float, fb: float, opt_phase: float, params_sharded: float,
          optimizer: float, grads: float, gathered: float, acts: float, buffers: float, workspace: float,
          grads_sh: float, mbs: float, opt_buffers: float = 0.0, leak: float = 0.0,
          fixed: float = 0.0) -> RankMemory:
    phases = {"forward_backward": fb, "optimizer": opt_phase, "setup": setup}
    phase = max(phases, key=phases.get)
    common = dict(pp_index=pp_index, peak_bytes=phases[phase], phase=phase, overhead=runtime.overhead_bytes,
                  setup_bytes=setup, optimizer_phase_bytes=opt_phase, forward_backward_bytes=fb,
                  activation_microbatches=mbs, inference_graph=leak, fixed_bytes=min(fixed, phases[phase]))
    if phase == "forward_backward":
        return RankMemory(params_sharded=params_sharded, optimizer_states=optimizer, grads=grads,
                          params_gathered=gathered, activations=acts, pipeline_buffers=buffers,
                          workspace=workspace, **common)
    if phase == "optimizer":
        return RankMemory(params_sharded=params_sharded, optimizer_states=optimizer, grads=grads_sh,
                          params_gathered=0.0, activations=leak, pipeline_buffers=opt_buffers,
                          workspace=opt_phase - params_sharded - optimizer - grads_sh - opt_buffers - leak
                          - runtime.overhead_bytes, **common)
    return RankMemory(params_sharded=0.0, optimizer_states=0.0, grads=0.0, params_gathered=0.0, activations=0.0,
                      pipeline_buffers=0.0, workspace=0.0, unsharded_at_setup=setup - runtime.overhead_bytes,
                      **common)


# ------------------------------------------------------------------------------ calibration
def measure_activation_bytes(spec, seq_len: int, micro_batch: int = 1, vocab_size: int | None = None) -> list[float]:
    """Bytes each block of ``spec`` saves for backward per token, measured on this host.

    Runs every block once on CPU in the default dtype under ``saved_tensors_hooks`` and
    counts distinct saved storages that are not parameters. The result can go into
    :meth:`ModelDescription.from_spec` (``activation_bytes_per_token``) in place of the
    formula; for rayflex's GPT it reproduces the formula (see the tests).
    """
    import torch

    counts: list[float] = []
    tokens = seq_len * micro_batch
    x = torch.randint(0, vocab_size or 2, (micro_batch, seq_len))
    y = torch.randint(0, vocab_size or 2, (micro_batch, seq_len))
    for i in range(spec.num_blocks):
        block = spec.block(i)
        params = {q.untyped_storage().data_ptr() for q in block.parameters()}
        seen: dict[int, int] = {}

        def pack(t, params=params, seen=seen):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params:
                seen[ptr] = t.untyped_storage().nbytes()
            return t

        if x.is_floating_point():
            x = x.detach().requires_grad_(True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = block(x)
            if i == spec.num_blocks - 1:
                spec.loss_fn(out, y)
        counts.append(sum(seen.values()) / tokens)
        x = out.detach()
    return counts
