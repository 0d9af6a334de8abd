"""Weights out: a committed checkpoint of a Hugging Face model's run as an HF directory.

It composes two layers that may not import each other: the checkpoint side
(:mod:`rayflex.checkpoint.reader`: find the run, pick and verify a committed step,
read DCP's model entries block by block) and the HF side
(:func:`rayflex.models.hf_export.write_hf`). ``rayflex ckpt export`` calls it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from rayflex.models.hf_export import ExportResult


def export_hf(source: str, out_dir, *, step: Optional[int] = None, shard_bytes: Optional[int] = None,
              overwrite: bool = False) -> "ExportResult":
    """Write a committed checkpoint of a run whose model was made by
    :func:`rayflex.models.hf.causal_lm` as a Hugging Face directory ``out_dir`` (local)
    that ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads.

    ``source``: the run directory (``{storage}/{name}``, holding ``spec.json``), its
    checkpoint root, or one ``step_XXXXXXXX`` directory, on any storage rayflex supports.
    ``step``: that committed step (default: the newest). The step is verified against its
    manifest before anything is read; only the model's entries are read, one block at a
    time. ``shard_bytes``: largest safetensors file (default 2 GiB). A non-empty
    ``out_dir`` is refused unless ``overwrite`` and it holds a previous export.
    """
    from rayflex.models.hf_export import DEFAULT_SHARD_BYTES, check_out_dir, hf_metadata, write_hf
    from rayflex.checkpoint.reader import RunCheckpoints

    check_out_dir(out_dir, overwrite)  # before anything is read
    run = RunCheckpoints.find(source)
    hf_metadata(run.model, f"run {run.name!r} at {run.run_dir}")
    weights = run.open_step(step)
    return write_hf(weights, out_dir, shard_bytes=DEFAULT_SHARD_BYTES if shard_bytes is None else shard_bytes,
                    overwrite=overwrite, step=weights.step)
