"""A Hugging Face decoder-only causal LM as a rayflex ModelSpec.

``causal_lm(config_or_dir, init_from=dir)`` cuts Llama, Qwen2, Qwen3, Mistral or GPT-2
into ``num_hidden_layers + 2`` blocks: the embeddings (GPT-2: ``wte`` + ``wpe``), one block
per decoder layer, and the final norm + ``lm_head``. The decoder blocks *are* HF's own
layer classes (``LlamaDecoderLayer`` ...) with a one-tensor ``forward``, so the names
inside a block are HF's (:mod:`rayflex.models.hf_families` maps the keys both ways).

What HF's model hands every layer besides the hidden states is made inside the block,
so a pipeline can cut anywhere:

* **Positions**: ``position_ids = arange(T)``; a rotary family's block owns a copy of the
  model's rotary embedding module (its ``inv_freq`` buffers are non-persistent, so no
  state-dict key) and computes ``position_embeddings`` from them.
* **Causality**: HF's layers get their mask from the model. Called without one, the eager
  kernel attends to *every* position, future ones included. The blocks force SDPA, whose
  path without a mask is ``is_causal=True``; a sliding-window layer (Mistral, Qwen2/3 with
  ``use_sliding_window``) whose window is shorter than the sequence gets an explicit
  boolean causal window mask (HF's rule: ``q - window < k <= q``).
* **Dropout** is off (every dropout probability 0 in the config the blocks run with), so
  any split of the model computes the same function.

Tied embeddings (GPT-2, small Llamas and Qwens with ``tie_word_embeddings=True``): the
blocks are built independently, so one parameter cannot live in block 0 and in the head.
**rayflex trains such a model untied**: ``lm_head`` starts as a copy of the embedding
matrix (loading weights, ``lm_head.weight`` is taken from the embedding when the
checkpoint has none; from scratch both are drawn from one generator), the two train
apart, and the config the spec exports (``spec.metadata["hf"]["config"]``) says
``tie_word_embeddings=False``, so an exported checkpoint loads into HF as trained.

Weights: ``init_from`` is a local directory of ``*.safetensors`` (one file, or shards
with ``model.safetensors.index.json``) that every worker can read. ``build_block(i)`` on
a real device reads exactly block ``i``'s tensors, with plain file reads straight into the
block (not through an mmap, whose touched pages would count as a second copy of the
block), so the meta-device setup (:mod:`rayflex.worker.meta_init`) holds this rank's
shards plus one block at most (``benchmarks/hf_load_memory.py``);
on the meta device it reads nothing. Keys and shapes are checked against the model when
the spec is made, before any worker starts. Without ``init_from`` the weights follow
HF's initialisation (normal(0, ``initializer_range``), zero biases, unit norms, GPT-2's
scaled residual projections), seeded per block like every ModelSpec.

Nothing here downloads: a directory is read with ``local_files_only=True``.
"""

from __future__ import annotations

import copy
import functools
import importlib
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from rayflex.errors import ConfigError
from rayflex.models.gpt_blocks import lm_loss
from rayflex.models.hf_families import (FAMILIES, HFFamily, family_of, from_hf_key, hf_key_of, size_of_config,
                                        to_hf_key)
from rayflex.models.hf_tp import hf_tp_metadata
from rayflex.models.spec import ModelSpec
from rayflex.models.meta import on_meta

__all__ = ["causal_lm", "to_hf_key", "from_hf_key", "TIE_RULE"]

TIE_RULE = ("rayflex trains tied embeddings untied: lm_head starts as a copy of the embedding matrix "
            "(taken from the embedding when the checkpoint has no lm_head) and the exported config says "
            "tie_word_embeddings=False")

# Dropout probabilities of the supported configs; the blocks run with all of them at 0.
_DROPOUTS = ("attention_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop", "hidden_dropout",
             "summary_first_dropout")


@dataclass(frozen=True)
class HFBuild:
    """What ``build_block`` needs; travels to the workers pickled inside the spec."""

    family: str
    config: Any  # the PretrainedConfig the blocks run with (SDPA, no dropout, no cache)
    init_from: Optional[str]  # absolute path of the safetensors directory
    tied_source: bool  # the source model ties lm_head to the embedding
    init_seed: int

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers


# ------------------------------------------------------------------------------ the spec
def causal_lm(config_or_dir, *, init_from: Optional[str] = None, name: Optional[str] = None,
              init_seed: int = 1234) -> ModelSpec:
    """A Hugging Face causal LM (``transformers.PretrainedConfig``, or a local directory with
    its ``config.json``) as a ModelSpec of ``num_hidden_layers + 2`` blocks.

    ``init_from``: a local directory of safetensors weights (e.g. what ``save_pretrained``
    wrote) that every worker can read; None initialises from scratch (a directory as
    ``config_or_dir`` gives the config only: ``causal_lm(d, init_from=d)`` for its weights).
    Supported ``model_type``: llama, qwen2, qwen3, mistral, gpt2; another raises
    ConfigError. Tied embeddings are trained untied (:data:`TIE_RULE`): the spec's
    ``metadata["hf"]["config"]`` has ``tie_word_embeddings=False``.
    """
    config = _load_config(config_or_dir)
    family = family_of(getattr(config, "model_type", None))
    tied = bool(getattr(config, "tie_word_embeddings", False))
    root = None
    if init_from is not None:
        root = os.path.abspath(os.fspath(init_from))
        if not os.path.isdir(root):
            raise ConfigError("causal_lm(init_from)", f"{init_from!r} is not a directory",
                              "pass the local directory holding model.safetensors (or its shards)")
    build = HFBuild(family=family.name, config=_run_config(config, family), init_from=root, tied_source=tied,
                    init_seed=init_seed)
    exported = json.loads(config.to_json_string(use_diff=False))
    exported["tie_word_embeddings"] = False
    architectures = list(getattr(config, "architectures", None) or [family.architecture])
    exported["architectures"] = architectures
    size = size_of_config(family, exported)
    metadata = {"hf": {"family": family.name, "model_type": config.model_type, "architectures": architectures,
                       "config": exported, "source_tied_embeddings": tied, "tie_rule": TIE_RULE,
                       "init_from": root, "size": size.to_dict()},
                # how the blocks split over tp ranks, from transformers' own plan (rayflex.models.hf_tp)
                "tp": hf_tp_metadata(family.name, getattr(type(config), "base_model_tp_plan", None),
                                     size.to_dict())}
    spec = ModelSpec(name=name or f"hf-{config.model_type}-{size.num_layers}x{size.hidden_size}",
                     num_blocks=size.num_layers + 2, build_block=functools.partial(build_hf_block, build),
                     loss_fn=lm_loss, hidden_size=size.hidden_size, init_seed=init_seed,
                     vocab_size=int(getattr(config, "vocab_size", 0) or 0), metadata=metadata)
    if root is not None:
        check_checkpoint(build)
    return spec


def _load_config(config_or_dir):
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(config_or_dir, PretrainedConfig):
        return config_or_dir
    if isinstance(config_or_dir, (str, os.PathLike)):
        path = os.fspath(config_or_dir)
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ConfigError("causal_lm(config_or_dir)", f"{path!r} has no config.json",
                              "pass a transformers.PretrainedConfig or a local directory written by "
                              "save_pretrained (rayflex never downloads from the Hub)")
        return AutoConfig.from_pretrained(path, local_files_only=True)
    raise ConfigError("causal_lm(config_or_dir)", f"got {type(config_or_dir).__name__}",
                      "pass a transformers.PretrainedConfig or a local directory with config.json")


def _run_config(config, family: HFFamily):
    """The config the blocks run with: SDPA (causal without a mask), no dropout, no cache."""
    cfg = copy.deepcopy(config)
    cfg._attn_implementation = "sdpa"
    for attr in _DROPOUTS:
        if isinstance(getattr(cfg, attr, None), (int, float)):
            setattr(cfg, attr, 0.0)
    cfg.use_cache = False
    if getattr(cfg, "add_cross_attention", False):
        raise ConfigError("causal_lm(config)", f"{family.name} config has add_cross_attention=True",
                          "use a decoder-only config (add_cross_attention=False)")
    return cfg


# ------------------------------------------------------------------------------ blocks
class Embeddings(nn.Module):
    """Block 0: token embeddings (GPT-2: plus learned positions ``arange(T)``)."""

    def __init__(self, family: HFFamily, cfg):
        super().__init__()
        self.max_positions = 0
        if family.rotary is None:  # GPT-2
            self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.wpe = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
            self.max_positions = cfg.max_position_embeddings
        else:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, getattr(cfg, "pad_token_id", None))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.max_positions:
            return self.embed_tokens(ids)
        t = ids.shape[1]
        if t > self.max_positions:
            raise ValueError(f"sequences of {t} tokens but the model has {self.max_positions} learned positions "
                             "(n_positions); shorten DataConfig.seq_len")
        return self.wte(ids) + self.wpe(torch.arange(t, device=ids.device).unsqueeze(0))


class Head(nn.Module):
    """The last block: final norm and ``lm_head`` (untied, no bias)."""

    def __init__(self, family: HFFamily, cfg):
        super().__init__()
        self.norm_name = family.final_norm
        if family.final_norm_class is None:
            norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_epsilon)
        else:
            norm = getattr(importlib.import_module(family.module), family.final_norm_class)(
                cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.add_module(family.final_norm, norm)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(getattr(self, self.norm_name)(x))


class _OneTensorDecoder:
    """Mixed into HF's decoder layer class: ``forward(hidden_states)`` makes the positions,
    the rotary embeddings and the causal (window) mask itself."""

    _family = ""

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx=layer_idx)
        family = FAMILIES[self._family]
        self.rotary_emb = (getattr(importlib.import_module(family.module), family.rotary)(config=config)
                           if family.rotary else None)
        window = None
        if family.sliding_window == "attention":
            window = getattr(self.self_attn, "sliding_window", None)
        elif family.sliding_window == "config":
            window = getattr(config, "sliding_window", None)
        self.attention_window = window

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        t = hidden_states.shape[1]
        mask = None
        if self.attention_window is not None and t > self.attention_window:
            q = torch.arange(t, device=hidden_states.device)[:, None]
            k = torch.arange(t, device=hidden_states.device)[None, :]
            mask = ((k <= q) & (k > q - self.attention_window))[None, None]
        if self.rotary_emb is None:
            return super().forward(hidden_states, attention_mask=mask)
        positions = torch.arange(t, device=hidden_states.device).unsqueeze(0)
        return super().forward(hidden_states, attention_mask=mask, position_ids=positions,
                               position_embeddings=self.rotary_emb(hidden_states, positions))


_BLOCK_CLASSES: dict[str, type] = {}


def decoder_block_class(family: HFFamily) -> type:
    """HF's decoder layer class with a one-tensor forward (``LlamaDecoderLayerBlock`` ...)."""
    cls = _BLOCK_CLASSES.get(family.name)
    if cls is None:
        base = getattr(importlib.import_module(family.module), family.decoder_layer)
        name = f"{base.__name__}Block"
        cls = type(name, (_OneTensorDecoder, base), {"_family": family.name, "__module__": __name__,
                                                     "__qualname__": name})
        globals()[name] = cls  # importable by name, so a pickled block finds its class
        _BLOCK_CLASSES[family.name] = cls
    return cls


def build_hf_block(build: HFBuild, index: int) -> nn.Module:
    """Block ``index``; on a real device with its weights (loaded or initialised)."""
    family, cfg, n = FAMILIES[build.family], build.config, build.num_layers
    if index == 0:
        block = Embeddings(family, cfg)
    elif index <= n:
        block = decoder_block_class(family)(cfg, index - 1)
    elif index == n + 1:
        block = Head(family, cfg)
    else:
        raise IndexError(f"block {index} of a model with blocks 0..{n + 1}")
    if torch.empty(()).device.type == "meta":  # shapes only: nothing to read or draw
        return block
    with torch.no_grad():
        if build.init_from is not None:
            load_block(block, build, index)
        else:
            init_block(block, build, index)
    return block


# ------------------------------------------------------------------------------ init
def init_block(block: nn.Module, build: HFBuild, index: int) -> None:
    """HF's default initialisation, drawn from the global generator (seeded per block by
    ``ModelSpec.block``); a tied source's embedding and ``lm_head`` from one generator."""
    from transformers.pytorch_utils import Conv1D

    cfg = build.config
    std = getattr(cfg, "initializer_range", 0.02) or 0.02
    for module in block.modules():
        if isinstance(module, (nn.Linear, Conv1D)):
            module.weight.normal_(0.0, std)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.normal_(0.0, std)
            if module.padding_idx is not None:
                module.weight[module.padding_idx].zero_()
        elif "Norm" in type(module).__name__:
            if getattr(module, "weight", None) is not None:
                module.weight.fill_(1.0)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
    if build.family == "gpt2" and 0 < index <= build.num_layers:  # GPT-2's residual scaling
        for proj in (block.attn.c_proj, block.mlp.c_proj):
            proj.weight.normal_(0.0, std / math.sqrt(2 * cfg.num_hidden_layers))
    if build.tied_source and index in (0, build.num_layers + 1):
        family = FAMILIES[build.family]
        target = getattr(block, family.embeddings[0]) if index == 0 else block.lm_head
        target.weight.copy_(_tied_matrix(build, std))


def _tied_matrix(build: HFBuild, std: float) -> torch.Tensor:
    """The tied source's embedding matrix, drawn once from a generator of its own (the
    head is built apart from block 0 but starts as its copy)."""
    cfg = build.config
    gen = torch.Generator(device="cpu").manual_seed(build.init_seed * 1_000_003 + 999_983)
    matrix = torch.empty(cfg.vocab_size, cfg.hidden_size, device="cpu").normal_(0.0, std, generator=gen)
    padding_idx = None if build.family == "gpt2" else getattr(cfg, "pad_token_id", None)
    if padding_idx is not None:
        matrix[padding_idx] = 0
    return matrix


# ------------------------------------------------------------------------------ weights
def _snapshot(root: str) -> tuple:
    """What identifies the directory's current files (a rewritten checkpoint is re-read)."""
    try:
        return tuple(sorted((e.name, e.stat().st_mtime_ns, e.stat().st_size) for e in os.scandir(root)
                            if e.name.endswith((".safetensors", ".json"))))
    except OSError as err:
        raise ConfigError("causal_lm(init_from)", f"cannot read {root!r}: {err}",
                          "pass a directory every worker can read") from None


@functools.lru_cache(maxsize=16)
def _checkpoint_index(root: str, snapshot: tuple) -> dict[str, tuple[str, tuple[int, ...]]]:
    """HF key -> (file, shape) of every tensor under ``root`` (headers only)."""
    from safetensors import safe_open

    index = os.path.join(root, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(name for name, *_ in snapshot if name.endswith(".safetensors"))
    if not files:
        raise ConfigError("causal_lm(init_from)", f"no *.safetensors files in {root!r}",
                          "save the weights with save_pretrained(dir) (safetensors by default), or point "
                          "init_from at the directory holding model.safetensors")
    listed_by = "model.safetensors.index.json lists it" if os.path.isfile(index) else "found in the directory"
    out = {}
    for name in files:
        path = os.path.join(root, name)
        if not os.path.isfile(path):
            raise ConfigError("causal_lm(init_from)", f"{path} is missing ({listed_by})",
                              "copy the complete checkpoint (every shard the index lists), or re-save it "
                              "with save_pretrained(dir)")
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for key in f.keys():
                    out[key] = (path, tuple(f.get_slice(key).get_shape()))
        except Exception as err:  # noqa: BLE001 - safetensors' own error names no file
            raise ConfigError("causal_lm(init_from)", f"{path} is not a readable safetensors file ({err})",
                              "copy or download the file again (it may be truncated), or re-save the "
                              "checkpoint with save_pretrained(dir)") from None
    return out


def _source_key(build: HFBuild, index: int, name: str, available) -> Optional[str]:
    """The checkpoint key block ``index``'s ``name`` is read from (None: missing)."""
    family = FAMILIES[build.family]
    key = hf_key_of(family, build.num_layers, index, name)
    candidates = [key, key.removeprefix(family.base + ".")]
    if index == build.num_layers + 1 and name == f"{family.lm_head}.weight" and build.tied_source:
        tied = hf_key_of(family, build.num_layers, 0, f"{family.embeddings[0]}.weight")
        candidates += [tied, tied.removeprefix(family.base + ".")]
    return next((c for c in candidates if c in available), None)


def _missing_error(build: HFBuild, missing: list[str], what: str) -> ConfigError:
    return ConfigError("causal_lm(init_from)", f"{build.init_from} {what}: {_listed(missing)}",
                       f"point init_from at weights of this {build.family} config (same layers and sizes), "
                       "e.g. what save_pretrained wrote for it")


def _listed(keys) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")


# safetensors dtype names (little-endian by the format) -> torch dtypes.
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


def _tensor_locations(f) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
    """key -> (dtype, shape, first byte, end byte) in an open safetensors file (the format:
    an 8-byte little-endian header length, the JSON header, then the data)."""
    size = int.from_bytes(f.read(8), "little")
    header = json.loads(f.read(size))
    return {k: (v["dtype"], tuple(v["shape"]), 8 + size + v["data_offsets"][0], 8 + size + v["data_offsets"][1])
            for k, v in header.items() if k != "__metadata__"}


def _read_into(f, target: torch.Tensor, dtype: torch.dtype, begin: int, end: int, what: str) -> None:
    """Read a tensor's bytes with plain file reads: straight into ``target`` when it is a
    contiguous CPU tensor of the file's dtype, else into one temporary that ``copy_``
    casts or moves. Not through safetensors' mmap: the pages a copy from a mapping touches
    count in the process's RSS until the file is closed, i.e. a whole block twice."""
    direct = target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous()
    buf = target if direct else torch.empty(target.shape, dtype=dtype)
    view = memoryview(buf.view(torch.uint8).reshape(-1).numpy()) if buf.numel() else memoryview(b"")
    if len(view) != end - begin:
        raise ConfigError("causal_lm(init_from)", f"{what} has {end - begin} bytes, {len(view)} expected for "
                          f"{tuple(target.shape)} {dtype}", "re-save the checkpoint (the file is corrupt)")
    f.seek(begin)
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise ConfigError("causal_lm(init_from)", f"{what} ends after {done} of {len(view)} bytes",
                              "re-save the checkpoint (the file is truncated)")
        done += n
    if not direct:
        target.copy_(buf)


def load_block(block: nn.Module, build: HFBuild, index: int) -> None:
    """Copy block ``index``'s tensors (and only those) from the safetensors files, read
    straight into the block's tensors (:func:`_read_into`)."""
    import sys

    from safetensors import safe_open

    available = _checkpoint_index(build.init_from, _snapshot(build.init_from))
    sources, missing = {}, []
    for name in block.state_dict():
        key = _source_key(build, index, name, available)
        if key is None:
            missing.append(hf_key_of(FAMILIES[build.family], build.num_layers, index, name))
        else:
            sources[name] = key
    if missing:
        raise _missing_error(build, missing, f"has no tensors for block {index}")
    targets = block.state_dict()
    by_file: dict[str, list[str]] = {}
    for name, key in sources.items():
        by_file.setdefault(available[key][0], []).append(name)
    for path, names in by_file.items():
        # safe_open validates the header (and converts what _read_into cannot); it maps the
        # file but touches no page unless get_tensor's result is read.
        with open(path, "rb", buffering=0) as raw, safe_open(path, framework="pt", device="cpu") as f:
            locations = _tensor_locations(raw)
            for name in names:
                dtype, shape, begin, end = locations[sources[name]]
                if shape != tuple(targets[name].shape):
                    raise ConfigError("causal_lm(init_from)", f"{sources[name]} in {path} has shape "
                                      f"{shape}, block {index} needs {tuple(targets[name].shape)}",
                                      "use weights saved for this config")
                if dtype in _SAFETENSORS_DTYPES and sys.byteorder == "little":
                    _read_into(raw, targets[name], _SAFETENSORS_DTYPES[dtype], begin, end, f"{sources[name]} in {path}")
                else:  # a dtype torch has no plain equivalent for (fp8 ...): safetensors converts it
                    targets[name].copy_(f.get_tensor(sources[name]))


def check_checkpoint(build: HFBuild) -> None:
    """Every tensor of the model is in the checkpoint with its shape, and the checkpoint
    holds nothing else (besides what HF itself ignores): checked on the driver, from the
    file headers and a meta build, before any worker starts."""
    family = FAMILIES[build.family]
    available = _checkpoint_index(build.init_from, _snapshot(build.init_from))
    used, missing, wrong = set(), [], []
    with on_meta():
        for index in range(build.num_layers + 2):
            for name, tensor in build_hf_block(build, index).state_dict().items():
                key = _source_key(build, index, name, available)
                if key is None:
                    missing.append(hf_key_of(family, build.num_layers, index, name))
                    continue
                used.add(key)
                if available[key][1] != tuple(tensor.shape):
                    wrong.append(f"{key} {available[key][1]} (needs {tuple(tensor.shape)})")
    if missing:
        raise _missing_error(build, missing, "lacks tensors the model needs")
    if wrong:
        raise ConfigError("causal_lm(init_from)", f"{build.init_from} has tensors of other shapes: {_listed(wrong)}",
                          "use weights saved for this config (same hidden size, heads, vocabulary)")
    unexpected = [k for k in available if k not in used and not family.ignores(k)]
    if unexpected:
        raise ConfigError("causal_lm(init_from)", f"{build.init_from} has tensors this {build.family} model does "
                          f"not use: {_listed(unexpected)}",
                          "check that the config matches the weights (num_hidden_layers, model_type)")
