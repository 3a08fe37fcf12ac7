"""The ``parallel`` section of a run's config: degrees, sharding, FSDP, balancing, as the user sets them.

:class:`GemParallelStrategy` (:mod:`foundation.parallel.strategy`) reads it; the structured options
:func:`~foundation.parallel.parallelize.parallelize_teacher` applies are derived from it there.
"""

from __future__ import annotations

from dataclasses import dataclass

from foundation.config import ConfigError


@dataclass
class ParallelSettings:
    """Distributed training through :mod:`foundation.parallel.strategy` (off: plain single-device Lightning).

    Kept apart from :class:`~foundation.parallel.ParallelConfig`: this is the flat, user-set config section (degrees,
    backend, balancing, checkpoints; strings checked with ``ConfigError``), from which the strategy builds that.

    Attributes:
        dp_replicate, dp_shard, tp, cp, emb_shard: degrees of :class:`foundation.parallel.ParallelDims`;
            one dense degree may be ``-1`` (the rest of the world size), checked at launch by :meth:`validate`.
        backend: ``gloo``/``nccl``; empty: nccl on GPUs, gloo on CPU.
        shard_embeddings, sharding_types, sparse_optimizer, sparse_lr: torchrec table sharding and the
            fused sparse optimizer; fsdp, param_dtype, activation_checkpointing, compile, cp_attention: the dense
            part (see :class:`foundation.parallel.ParallelConfig`).
        balance: every data-parallel rank reads the same global batch (``data.batch_size`` and
            ``data.token_budget`` are then global) and keeps a share of rows with even attention work
            (``len + attention_weight * len**2``, :mod:`foundation.parallel.balance`); off: each rank
            reads its own row groups.
        checkpoints_kept: DCP step directories kept.
    """

    enabled: bool = False
    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    cp: int = 1
    emb_shard: int = -1
    backend: str = ""
    shard_embeddings: bool = True
    sharding_types: tuple[str, ...] = ("table_wise",)
    sparse_optimizer: str = "rowwise_adagrad"
    sparse_lr: float = 0.01
    fsdp: bool = True
    param_dtype: str = "fp32"
    activation_checkpointing: bool = False
    compile: bool = False
    cp_attention: str = "gather"
    balance: bool = True
    attention_weight: float = 1.0
    checkpoints_kept: int = 2

    def validate(self, world_size: int) -> None:
        """Raise :class:`ConfigError` naming the first bad ``parallel.*`` field for a run of ``world_size`` ranks."""
        for name in ("dp_replicate", "dp_shard", "tp", "cp", "emb_shard"):
            value = getattr(self, name)
            if value == 0 or value < -1:
                raise ConfigError(f"parallel.{name}={value}: must be a positive degree or -1 (inferred)")
        inferred = [n for n in ("dp_replicate", "dp_shard", "tp", "cp") if getattr(self, n) == -1]
        if len(inferred) > 1:
            raise ConfigError(f"parallel.{inferred[1]}=-1: only one degree may be inferred (also {inferred[0]}=-1)")
        known = self.dp_replicate * self.dp_shard * self.tp * self.cp * (-1 if inferred else 1)
        if (inferred and world_size % known) or (not inferred and known != world_size):
            field_name = inferred[0] if inferred else "dp_shard"
            raise ConfigError(
                f"parallel.{field_name}: degrees dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} "
                f"tp={self.tp} cp={self.cp} do not fit the world size {world_size}"
            )
        if self.emb_shard != -1 and world_size % self.emb_shard:
            raise ConfigError(f"parallel.emb_shard={self.emb_shard}: must divide the world size {world_size}")
        if self.backend not in ("", "gloo", "nccl"):
            raise ConfigError(f"parallel.backend={self.backend!r}: must be '', 'gloo' or 'nccl'")
        if self.sparse_lr <= 0:
            raise ConfigError(f"parallel.sparse_lr={self.sparse_lr}: must be positive")
        if self.attention_weight < 0:
            raise ConfigError(f"parallel.attention_weight={self.attention_weight}: must be >= 0")
        if self.checkpoints_kept < 1:
            raise ConfigError(f"parallel.checkpoints_kept={self.checkpoints_kept}: must be >= 1")
