"""Reading a run's committed checkpoints outside training: find the run (its
``spec.json`` and checkpoint root) from the run directory, the root or one step directory,
pick and verify a committed step, and read DCP's model entries key by key into plain CPU
tensors (DCP reads just their byte ranges; the optimizer is never touched). What
``rayflex ckpt export`` (:func:`rayflex.api.export.export_hf`) reads a model from.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

from rayflex.errors import CheckpointError, ConfigError

SPEC_FILE = "spec.json"


class SavedTensor(NamedTuple):
    """One saved tensor as DCP's metadata says: shape and dtype (a torch name, ``"float32"``)."""

    shape: tuple
    dtype: str


@dataclass(frozen=True)
class RunCheckpoints:
    """A run's ``spec.json`` and checkpoint root, found from the run directory, the root
    or a step directory (``step``: the one a step directory names)."""

    source: str
    run_dir: str
    root: str
    spec: dict
    step: Optional[int] = None

    @property
    def model(self) -> dict:
        return self.spec.get("model") or {}

    @property
    def name(self) -> str:
        return str((self.spec.get("run") or {}).get("name", "?"))

    @classmethod
    def find(cls, source: str) -> "RunCheckpoints":
        import json

        from rayflex.storage import fs as rfs
        from rayflex.checkpoint import manifest as mf

        uri = _strip(source)
        named = mf.parse_step(uri)
        if named is not None:
            root, candidates = _parent(uri), [_parent(_parent(uri))]
        else:
            root, candidates = None, [uri, _parent(uri)]
        for run_dir in filter(None, candidates):
            try:
                spec = json.loads(rfs.read_text(rfs.join(run_dir, SPEC_FILE)))
            except FileNotFoundError:
                continue
            if root is None:
                root = uri if run_dir != uri else ((spec.get("checkpoint") or {}).get("uri")
                                                   or rfs.join(run_dir, "checkpoints"))
            return cls(source=source, run_dir=run_dir, root=_strip(root), spec=spec, step=named)
        looked = " or ".join(rfs.join(d, SPEC_FILE) for d in filter(None, candidates))
        raise ConfigError("checkpoint source", f"found no run at {rfs.redact_uri(source)}: {looked} does not exist",
                          "pass the run directory {storage}/{name} (rayflex writes spec.json there when the run "
                          "starts), its checkpoints/ directory or one of its step_XXXXXXXX directories; a "
                          "CheckpointConfig.uri outside the run directory is found from the run directory")

    def open_step(self, step: Optional[int] = None) -> "CheckpointWeights":
        """The committed ``step`` (default: the one the source names, else the newest),
        verified against its manifest (sizes and checksums)."""
        from rayflex.storage import fs as rfs
        from rayflex.checkpoint import manifest as mf

        if self.step is not None:
            if step is not None and step != self.step:
                raise ConfigError("checkpoint step", f"step={step} but the source is the directory of step "
                                  f"{self.step}", "pass the run directory to choose a step, or leave step out")
            step = self.step
        shown = rfs.redact_uri(self.root)
        committed = mf.list_committed(self.root)
        if not committed:
            unfinished = [n for n in rfs.listdir(self.root) if mf.parse_step(n) is not None]
            raise CheckpointError(
                f"run {self.name!r} has no committed checkpoint under {shown}"
                + (f" ({', '.join(unfinished)} without {mf.MARKER}: saves that did not finish)" if unfinished
                   else "") + ". Fix: let the run save one (CheckpointConfig.every_steps, or the final save at the "
                "end of a run) and export it then")
        if step is None:
            step = committed[-1]
        elif step not in committed:
            raise CheckpointError(f"step {step} of run {self.name!r} is not committed under {shown} (committed: "
                                  f"{', '.join(map(str, committed))}). Fix: pass one of those with --step")
        try:
            mf.verify(self.root, step, deep=True)
        except CheckpointError as err:
            older = [s for s in committed if s < step]
            raise CheckpointError(f"{err}" + (f" (older committed steps: {', '.join(map(str, older))}; "
                                              "choose one with --step)" if older else "")) from err
        return CheckpointWeights(step_uri=mf.step_dir(self.root, step), step=step, model=self.model,
                                 description=f"step {step} of run {self.name!r} at {shown}")


@dataclass
class CheckpointWeights:
    """The model entries of one committed DCP checkpoint (what
    :func:`rayflex.models.hf_export.write_hf` reads, a ``WeightSource``): shapes and dtypes from DCP's
    ``.metadata``, tensors read by DCP into plain CPU tensors of those shapes, only the
    keys asked for (DCP reads just their byte ranges; the optimizer is never touched). A
    checkpoint of replicas that trained apart (DiLoCo, saved mid-round) stands for their
    common point: each parameter is read from there (``checkpointer.COMMON_MODEL``)."""

    step_uri: str
    step: int
    model: dict
    description: str
    _infos: Optional[dict] = field(default=None, repr=False)
    _common: set = field(default_factory=set, repr=False)  # keys read from the common point

    def _reader(self):
        from rayflex.checkpoint.dcp_io import CheckpointReader
        from rayflex.storage.fs import fsspec_kwargs

        return CheckpointReader(self.step_uri, **fsspec_kwargs(self.step_uri))

    def tensors(self) -> dict[str, "SavedTensor"]:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from rayflex.checkpoint.checkpointer import COMMON_MODEL

        if self._infos is None:
            infos = {}
            saved = self._reader().read_metadata().state_dict_metadata
            self._common = {fqn[len(COMMON_MODEL) + 1:] for fqn in saved if fqn.startswith(f"{COMMON_MODEL}.")}
            for fqn, meta in saved.items():
                if not fqn.startswith("model."):
                    continue
                if not isinstance(meta, TensorStorageMetadata):
                    raise CheckpointError(f"{self.description}: {fqn} is not a tensor. Fix: export checkpoints "
                                          "written by rayflex runs")
                infos[fqn[len("model."):]] = SavedTensor(tuple(meta.size), str(meta.properties.dtype).split(".")[-1])
            if not infos:
                raise CheckpointError(f"{self.description} holds no model tensors (no 'model.' entries in its DCP "
                                      "metadata). Fix: export a checkpoint written by a rayflex run")
            self._infos = infos
        return self._infos

    def load(self, keys: list[str]) -> dict:
        import torch
        import torch.distributed.checkpoint as dcp

        from rayflex.checkpoint.checkpointer import COMMON_MODEL

        infos = self.tensors()
        model = {k: torch.empty(infos[k].shape, dtype=getattr(torch, infos[k].dtype)) for k in keys}
        sections = {"model": {k: t for k, t in model.items() if k not in self._common},
                    COMMON_MODEL: {k: t for k, t in model.items() if k in self._common}}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*assuming the intent is to load in a single process")
            dcp.load({name: part for name, part in sections.items() if part}, storage_reader=self._reader(),
                     no_dist=True)
        return model


def _strip(uri: str) -> str:
    text = str(uri)
    return text if text.endswith("://") else text.rstrip("/")


def _parent(uri: Optional[str]) -> Optional[str]:
    """``s3://b/runs/x`` -> ``s3://b/runs``; None above the top (a bucket, ``/``)."""
    if not uri:
        return None
    scheme, sep, rest = uri.partition("://") if "://" in uri else ("", "", uri)
    head, _, tail = rest.rstrip("/").rpartition("/")
    if not tail or not head:
        return None
    return f"{scheme}{sep}{head}"

