"""rayflex: elastic FSDP2 + pipeline-parallel training on Ray, built for spot clusters."""

from rayflex.config import (CheckpointConfig, DataConfig, ElasticConfig, MemoryConfig, OptimizerConfig,
                            ParallelConfig, PrecisionConfig, RunConfig, ScalingConfig, TrainSpec)
from rayflex.errors import (CheckpointError, ConfigError, PlacementError, RayflexError, RunFailed,
                            StorageError, WorkerError)
from rayflex.api.trainer import Result, RunHandle, Trainer

__all__ = [
    "CheckpointConfig", "CheckpointError", "ConfigError", "DataConfig", "ElasticConfig", "MemoryConfig",
    "OptimizerConfig", "ParallelConfig", "PlacementError", "PrecisionConfig", "RayflexError", "Result",
    "RunConfig", "RunFailed", "RunHandle", "ScalingConfig", "StorageError", "Trainer", "TrainSpec", "WorkerError",
]
__version__ = "0.1.0"
