"""What a run that resumes by name is checked against before anything starts: the model
it would load its newest committed checkpoint into."""

from __future__ import annotations

import warnings

from rayflex.errors import ConfigError


def check_model_fits(model_spec, root: str, run_name: str) -> None:
    """Before a run resumes from ``root``'s newest committed checkpoint: the model it would
    load into has that checkpoint's tensors (DCP's ``.metadata`` only, one small read),
    else ConfigError naming the first differences and the fix. Without it a resubmitted
    run name with another model fails only once the workers load the checkpoint.

    Tensors both hold must have the same shape, and they must share at least one tensor
    (names only one side holds, e.g. tied weights saved once, are not a mismatch)."""
    from rayflex.models.meta import on_meta
    from rayflex.models.spec import build_stage
    from rayflex.storage import fs as rfs
    from rayflex.checkpoint import manifest as mf
    from rayflex.checkpoint.reader import CheckpointWeights

    latest = mf.latest_committed(root)
    if latest is None:
        return
    try:
        saved = CheckpointWeights(step_uri=mf.step_dir(root, latest), step=latest, model={},
                                  description=f"step {latest} at {rfs.redact_uri(root)}").tensors()
    except Exception as e:  # noqa: BLE001 - unreadable: the restore falls back to an older step itself
        warnings.warn(f"could not read the metadata of step {latest} at {rfs.redact_uri(root)} to check the "
                      f"model against it ({e}); the run's restore decides", stacklevel=2)
        return
    with on_meta():
        stage = build_stage(model_spec, list(range(model_spec.num_blocks)))
    expected = {k: tuple(v.shape) for k, v in stage.state_dict().items()}
    shared = sorted(set(saved) & set(expected))
    differ = [f"{k}: saved {list(saved[k].shape)}, model {list(expected[k])}" for k in shared
              if tuple(saved[k].shape) != expected[k]]
    if shared and not differ:
        return
    problem = ("; ".join(differ[:3]) + (f" (and {len(differ) - 3} more)" if len(differ) > 3 else "")) if differ else (
        f"no tensor in common (saved e.g. {', '.join(sorted(saved)[:2])}; the model has e.g. "
        f"{', '.join(sorted(expected)[:2])})")
    raise ConfigError("model", f"run {run_name!r} resumes from its checkpoint at step {latest}, which holds another "
                      f"model: {problem}",
                      "use a new RunConfig.name for a new model, or set CheckpointConfig.resume=False with a "
                      "checkpoint location of its own; the run's files and checkpoints were left as they are")
