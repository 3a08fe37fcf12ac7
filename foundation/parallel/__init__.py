"""The only place parallelism is applied: ``ParallelDims``, ``parallelize_teacher`` and distributed checkpoints."""

from foundation.parallel.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from foundation.parallel.dims import ParallelDims
from foundation.parallel.embeddings import EmbeddingShardingConfig
from foundation.parallel.fsdp import FSDPConfig
from foundation.parallel.parallelize import ParallelConfig, build_dense_optimizer, parallelize_teacher
from foundation.parallel.state import export_single_file, gather_full_state_dict

__all__ = [
    "EmbeddingShardingConfig",
    "FSDPConfig",
    "ParallelConfig",
    "ParallelDims",
    "build_dense_optimizer",
    "export_single_file",
    "gather_full_state_dict",
    "latest_checkpoint",
    "load_checkpoint",
    "parallelize_teacher",
    "save_checkpoint",
]
