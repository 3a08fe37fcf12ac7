"""The only place parallelism is applied: ``ParallelDims`` and ``parallelize_teacher``."""

from foundation.parallel.dims import ParallelDims
from foundation.parallel.embeddings import EmbeddingShardingConfig
from foundation.parallel.fsdp import FSDPConfig
from foundation.parallel.parallelize import ParallelConfig, build_dense_optimizer, parallelize_teacher

__all__ = [
    "EmbeddingShardingConfig",
    "FSDPConfig",
    "ParallelConfig",
    "ParallelDims",
    "build_dense_optimizer",
    "parallelize_teacher",
]
