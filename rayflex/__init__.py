"""rayflex: elastic FSDP2 + pipeline-parallel training on Ray, built for spot clusters."""

from rayflex.config import (CheckpointConfig, CommConfig, DataConfig, ElasticConfig, MemoryConfig, OptimizerConfig,
                            ParallelConfig, PrecisionConfig, RunConfig, ScalingConfig, TrainSpec)
from rayflex.errors import (CheckpointError, ConfigError, PlacementError, RayflexError, RunFailed,
                            StorageError, WorkerError)
from rayflex.api.trainer import Result, RunHandle, Trainer


def export_hf(source, out_dir, **options):
    """A committed checkpoint of a Hugging Face model's run as an HF directory
    (:func:`rayflex.api.export.export_hf`; imported on first use: it needs torch)."""
    from rayflex.api.export import export_hf as export

    return export(source, out_dir, **options)


__all__ = [
    "CheckpointConfig", "CheckpointError", "CommConfig", "ConfigError", "DataConfig", "ElasticConfig", "MemoryConfig",
    "OptimizerConfig", "ParallelConfig", "PlacementError", "PrecisionConfig", "RayflexError", "Result",
    "RunConfig", "RunFailed", "RunHandle", "ScalingConfig", "StorageError", "Trainer", "export_hf", "TrainSpec", "WorkerError",
]
__version__ = "0.1.0"
