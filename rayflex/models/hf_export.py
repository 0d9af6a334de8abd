"""Weights out: a rayflex model made by :func:`rayflex.models.hf.causal_lm` as a Hugging Face directory.

:func:`write_hf` writes what ``AutoModelForCausalLM.from_pretrained(out)`` reads:
``config.json`` (the run's HF config, ``tie_word_embeddings=False`` by the tie rule,
``dtype`` of the saved tensors) and safetensors shards of at most ``shard_bytes`` each,
with ``model.safetensors.index.json`` when there is more than one.

The weights come from a :class:`WeightSource`: the model as ``spec.json`` describes it,
the name, shape and dtype of every tensor, and a ``load(keys)`` that reads just those.
``rayflex ckpt export`` (:func:`rayflex.cli.ckpt.export_hf`) passes a committed DCP
checkpoint (it lives above ``storage``, which this layer may not import);
:class:`StateDictWeights` passes tensors in memory. Memory stays at one block: the shard
headers are computed from the shapes before any tensor is read, then each block is loaded
once and its tensors are streamed into the open shard file, so a 2 GB shard never sits in
memory whole.

A failed export leaves nothing that looks loadable: everything is written into a sibling
``{out}.tmp-XXXX`` (``config.json`` last, so even a directory left by a killed process has
none), which is renamed onto ``out`` only when complete. ``out`` is a local directory:
``from_pretrained`` reads local directories, and a rename is atomic only there; upload the
directory afterwards (``aws s3 sync``, ``huggingface-cli upload``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import sys
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Mapping, Optional, Protocol

from rayflex.errors import ConfigError
from rayflex.models.hf_families import FAMILIES, to_hf_key

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_SHARD_BYTES", "TensorInfo", "WeightSource", "StateDictWeights", "ExportResult", "write_hf",
           "hf_metadata", "hf_config", "check_out_dir", "parse_size"]

DEFAULT_SHARD_BYTES = 2 * 1024 ** 3
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"

# torch dtype name -> safetensors dtype code
_SAFETENSORS_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
                       "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "int64": "I64", "int32": "I32",
                       "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
_ITEM_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
               "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1}


@dataclass(frozen=True)
class TensorInfo:
    """One saved tensor as its metadata says: shape and dtype (a torch name, ``"float32"``)."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * _ITEM_BYTES[self.dtype]


class WeightSource(Protocol):
    """Where :func:`write_hf` reads a model's tensors from."""

    description: str  # for messages: "step 3 of run 'x' at file:///..."
    model: dict  # as spec.json's "model": {"name", "num_blocks", "metadata"}

    def tensors(self) -> Mapping[str, TensorInfo]:
        """Every tensor of the model (anything with ``shape`` and ``dtype``), by rayflex key (``blocks.{i}.<name>``), in model order."""

    def load(self, keys: list[str]) -> Mapping[str, "torch.Tensor"]:
        """Exactly these tensors, as plain CPU tensors (called once per block)."""


@dataclass
class StateDictWeights:
    """A model's tensors in memory (e.g. ``build_stage(spec, all_blocks).state_dict()``)."""

    model: dict
    state: Mapping[str, "torch.Tensor"]
    description: str = "a state dict in memory"

    @classmethod
    def of(cls, spec, state: Mapping[str, "torch.Tensor"]) -> "StateDictWeights":
        return cls(model={"name": spec.name, "num_blocks": spec.num_blocks, "metadata": spec.metadata},
                   state=state, description=f"model {spec.name!r} in memory")

    def tensors(self) -> dict[str, TensorInfo]:
        return {k: TensorInfo(tuple(v.shape), _dtype_name(v.dtype)) for k, v in self.state.items()}

    def load(self, keys: list[str]) -> dict[str, "torch.Tensor"]:
        return {k: self.state[k].detach().cpu() for k in keys}


@dataclass(frozen=True)
class ExportResult:
    out_dir: str
    files: tuple[str, ...]  # written into out_dir, config.json included
    shards: int
    num_tensors: int
    total_bytes: int  # of the tensors
    dtype: str
    source: str
    step: Optional[int] = None
    notes: tuple[str, ...] = field(default=())

    def lines(self) -> list[str]:
        what = f"step {self.step}" if self.step is not None else self.source
        out = [f"exported {what} ({self.num_tensors} tensors, {_human(self.total_bytes)}, {self.dtype}) "
               f"to {self.out_dir}:"]
        out += [f"  {name}" for name in self.files]
        out += [f"  note: {n}" for n in self.notes]
        out.append(f"load it with: AutoModelForCausalLM.from_pretrained({self.out_dir!r})")
        return out


# ------------------------------------------------------------------------------ config
def hf_metadata(model: dict, where: str = "the run") -> dict:
    """``model["metadata"]["hf"]``; a ConfigError saying what to do when the model is not HF's."""
    hf = ((model or {}).get("metadata") or {}).get("hf")
    if not hf or not hf.get("config") or hf.get("family") not in FAMILIES:
        raise ConfigError("export_hf(source)", f"the model of {where} ({(model or {}).get('name')!r}) is not a "
                          "Hugging Face model: its spec has no metadata['hf'] with a config",
                          "export runs whose model was made by rayflex.models.hf.causal_lm(...) (Llama, Qwen2, "
                          "Qwen3, Mistral, GPT-2); for another ModelSpec read the checkpoint's 'model' entries "
                          "with torch.distributed.checkpoint (keys blocks.<i>.<name>; a ModelSpec.from_module "
                          "maps back with rayflex.models.to_module_state_dict)")
    return hf


def hf_config(model: dict, dtype: str) -> dict:
    """The ``config.json`` an export writes: the run's HF config, untied (the tie rule:
    rayflex trained embedding and ``lm_head`` apart), with the saved tensors' dtype."""
    config = dict(hf_metadata(model)["config"])
    config["tie_word_embeddings"] = False
    config["dtype"] = dtype
    config.pop("torch_dtype", None)  # the old name; transformers 5 reads "dtype"
    return config


# ------------------------------------------------------------------------------ out dir
def check_out_dir(out_dir, overwrite: bool = False) -> str:
    """The absolute local path ``out_dir`` names (a path or ``file://``), checked before
    anything is read: remote URIs are refused, and so is a non-empty directory unless
    ``overwrite`` and it holds a previous export (a ``config.json``)."""
    text = os.fspath(out_dir)
    if "://" in text:
        scheme = text.split("://", 1)[0].lower()
        if scheme != "file":
            raise ConfigError("export_hf(out_dir)", f"{text!r} is not a local directory",
                              "export to a local directory (from_pretrained reads local directories and only there "
                              "is the final rename atomic), then upload it, e.g. `aws s3 sync OUT s3://...`")
        text = text[len("file://"):]
    path = os.path.abspath(os.path.expanduser(text))
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise ConfigError("export_hf(out_dir)", f"{path} exists and is not a directory",
                              "pass a new or empty directory")
        if os.listdir(path):
            if not overwrite:
                raise ConfigError("export_hf(out_dir)", f"{path} is not empty",
                                  "choose a new or empty directory, or pass overwrite=True (--overwrite) to replace "
                                  "a previous export")
            if not os.path.isfile(os.path.join(path, CONFIG_FILE)):
                raise ConfigError("export_hf(out_dir)", f"{path} is not empty and holds no {CONFIG_FILE}, so it "
                                  "is not a previous export; overwrite replaces only those",
                                  "choose a new or empty directory")
    return path


# ------------------------------------------------------------------------------ writing
@dataclass(frozen=True)
class _Entry:
    key: str  # rayflex
    hf_key: str
    block: int
    info: TensorInfo


@dataclass(frozen=True)
class _Described:
    """What ``to_hf_key`` reads of a spec (spec.json's model entry)."""

    name: str
    num_blocks: int
    metadata: dict


def write_hf(weights: WeightSource, out_dir, *, shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False,
             step: Optional[int] = None) -> ExportResult:
    """Write ``weights`` as a Hugging Face model directory at ``out_dir`` (see the module doc)."""
    if not isinstance(shard_bytes, int) or isinstance(shard_bytes, bool) or shard_bytes < 1:
        raise ConfigError("export_hf(shard_bytes)", f"must be a positive int, got {shard_bytes!r}",
                          "pass a byte count, e.g. 2 * 1024**3 (--shard-size 2GB)")
    out = check_out_dir(out_dir, overwrite)
    model = weights.model
    hf = hf_metadata(model, weights.description)
    entries = _entries(model, weights.tensors(), weights.description)
    _check_against_hf(hf, entries, weights.description)
    dtypes = sorted({e.info.dtype for e in entries})
    dtype = max(dtypes, key=lambda d: sum(e.info.nbytes for e in entries if e.info.dtype == d))
    shards = plan_shards(entries, shard_bytes)
    names = ([SINGLE_FILE] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    tmp = f"{out}.tmp-{uuid.uuid4().hex[:8]}"
    os.makedirs(tmp)
    try:
        _write_shards(weights, entries, shards, names, tmp)
        files = list(names)
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(e.info.nbytes for e in entries)},
                     "weight_map": {e.hf_key: name for shard, name in zip(shards, names) for e in shard}}
            _write_json(os.path.join(tmp, INDEX_FILE), index)
            files.append(INDEX_FILE)
        _write_json(os.path.join(tmp, CONFIG_FILE), hf_config(model, dtype))  # last: the dir is now loadable
        files.insert(0, CONFIG_FILE)
        _move_into_place(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    notes = ()
    if hf.get("source_tied_embeddings"):
        notes = ("the source model tied lm_head to its embedding; rayflex trained them apart, so config.json says "
                 "tie_word_embeddings=false and both matrices are saved",)
    return ExportResult(out_dir=out, files=tuple(files), shards=len(shards), num_tensors=len(entries),
                        total_bytes=sum(e.info.nbytes for e in entries), dtype=dtype, source=weights.description,
                        step=step, notes=notes)


def plan_shards(entries: list, shard_bytes: int) -> list[list]:
    """Consecutive runs of tensors of at most ``shard_bytes`` each (a larger tensor alone)."""
    shards, current, size = [], [], 0
    for e in entries:
        if current and size + e.info.nbytes > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(e)
        size += e.info.nbytes
    if current or not shards:
        shards.append(current)
    return shards


def _entries(model: dict, infos: Mapping[str, TensorInfo], where: str) -> list[_Entry]:
    described = _Described(name=str(model.get("name")), num_blocks=int(model["num_blocks"]),
                           metadata=model["metadata"])
    entries = []
    for key, saved in infos.items():
        info = TensorInfo(tuple(saved.shape), str(saved.dtype))  # any (shape, dtype) record a source gives
        m = re.fullmatch(r"blocks\.(\d+)\..+", key)
        if m is None:
            raise ConfigError("export_hf(source)", f"{where} holds {key!r}, which is not a block's tensor "
                              "(blocks.<i>.<name>)", "export checkpoints written by rayflex runs")
        if info.dtype not in _SAFETENSORS_DTYPES:
            raise ConfigError("export_hf(source)", f"{key} has dtype {info.dtype}, which safetensors cannot hold",
                              f"use one of {', '.join(_SAFETENSORS_DTYPES)}")
        entries.append(_Entry(key=key, hf_key=to_hf_key(described, key), block=int(m.group(1)), info=info))
    entries.sort(key=lambda e: e.block)  # stable: the source's order within a block
    return entries


def _check_against_hf(hf: dict, entries: list[_Entry], where: str) -> None:
    """The exported keys and shapes are exactly those of HF's own model of the config
    (built on the meta device), so from_pretrained finds every weight and nothing else."""
    from transformers import AutoModelForCausalLM

    from rayflex.models.meta import on_meta

    config = _config_object(hf)
    with on_meta():
        expected = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    got = {e.hf_key: e.info.shape for e in entries}
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    wrong = sorted(f"{k} {got[k]} (HF: {expected[k]})" for k in set(got) & set(expected) if got[k] != expected[k])
    problems = ([f"lacks {_listed(missing)}"] if missing else []) + ([f"has extra {_listed(extra)}"] if extra else []) \
        + ([f"has other shapes: {_listed(wrong)}"] if wrong else [])
    if problems:
        raise ConfigError("export_hf(source)", f"{where} does not match the {hf['family']} model of its config: "
                          + "; ".join(problems), "export a checkpoint of the run whose spec.json it sits under")


def _config_object(hf: dict):
    from transformers import AutoConfig

    config = dict(hf["config"])
    config["tie_word_embeddings"] = False
    return type(AutoConfig.for_model(hf["model_type"])).from_dict(config)


def _write_shards(weights: WeightSource, entries: list[_Entry], shards: list, names: list[str], tmp: str) -> None:
    """Each shard: header from the planned shapes, then the tensors streamed in order; each
    block is loaded once, when its first tensor is due (shards follow block order)."""
    if sys.byteorder != "little":  # pragma: no cover - safetensors is little-endian
        raise RuntimeError("writing safetensors needs a little-endian host")
    by_block: dict[int, list[str]] = {}
    for e in entries:
        by_block.setdefault(e.block, []).append(e.key)
    loaded_block, loaded = None, {}
    for shard, name in zip(shards, names):
        with open(os.path.join(tmp, name), "wb") as f:
            f.write(_safetensors_header(shard))
            for e in shard:
                if e.block != loaded_block:
                    loaded_block, loaded = e.block, dict(weights.load(by_block[e.block]))
                tensor = loaded.pop(e.key)
                if tuple(tensor.shape) != e.info.shape or _dtype_name(tensor.dtype) != e.info.dtype:
                    raise RuntimeError(f"{e.key}: loaded {tuple(tensor.shape)} {tensor.dtype}, its metadata says "
                                       f"{e.info.shape} {e.info.dtype}")
                f.write(_raw_bytes(tensor))
            f.flush()
            os.fsync(f.fileno())


def _safetensors_header(shard: list[_Entry]) -> bytes:
    """safetensors' layout: 8-byte little-endian header length, the JSON header (padded
    with spaces to a multiple of 8), then the tensors' bytes back to back."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for e in shard:
        header[e.hf_key] = {"dtype": _SAFETENSORS_DTYPES[e.info.dtype], "shape": list(e.info.shape),
                            "data_offsets": [offset, offset + e.info.nbytes]}
        offset += e.info.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _raw_bytes(tensor: "torch.Tensor"):
    import torch

    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else b""


def _move_into_place(tmp: str, out: str, overwrite: bool) -> None:
    if os.path.isdir(out) and os.listdir(out):
        check_out_dir(out, overwrite)  # something appeared meanwhile: the same rules
        old = f"{out}.old-{uuid.uuid4().hex[:8]}"
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
        return
    if os.path.isdir(out):
        os.rmdir(out)
    os.rename(tmp, out)


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _listed(items: Iterable[str]) -> str:
    items = list(items)
    return ", ".join(items[:6]) + (f" and {len(items) - 6} more" if len(items) > 6 else "")


def _human(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value, unit = float(n), "B"
    for unit in ("KB", "MB", "GB", "TB"):
        value /= 1024
        if value < 1024:
            break
    return f"{value:.1f} {unit}"


def parse_size(text: str) -> int:
    """``"2GB"``, ``"500MB"``, ``"64KiB"`` or a byte count -> bytes (powers of 1024: GB and
    GiB are both 2**30)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*", str(text), re.IGNORECASE)
    if m is None:
        raise ConfigError("--shard-size", f"cannot read {text!r} as a size", "use e.g. 2GB, 500MB or 1048576")
    scale = 1024 ** " kmgt".index((m.group(2) or " ").lower())
    value = int(float(m.group(1)) * scale)
    if value < 1:
        raise ConfigError("--shard-size", f"{text!r} is less than one byte", "use e.g. 2GB")
    return value
