"""``parallelize_teacher(model, dims, cfg)``: every parallel dimension applied to a single-device model, in place.

Order, and why:

0. **Dense table gradients**: a model built with ``sparse_tables`` (the ``large`` flavor) has tables whose
   gradients are sparse, for :class:`~foundation.model.precision.MasterAdamW`'s rows on one device; neither FSDP
   nor the dense AdamW takes them, so every table gives dense gradients again.
1. **Embeddings** (torchrec): attach the fused sparse optimizer, plan, and swap each EBC/EC for its
   sharded variant. First, because FSDP must be told to ignore the table parameters, and the
   sharded modules own them only after this step.
2. **TP** on the ``tp`` mesh: column/row-wise pairs of MLP ``Linear`` s (see
   :mod:`foundation.parallel.tensor`), before FSDP, since FSDP then shards TP's DTensor parameters
   over the data-parallel mesh (2-D).
3. **Activation checkpointing** (optional) per block, so that FSDP's unit wraps the recomputed block;
   then ``torch.compile`` (optional) per block, in place (:mod:`foundation.parallel.compile`).
4. **CP** on the ``cp`` mesh (:mod:`foundation.parallel.context`): forward hooks shard the sequence
   between its whole-sequence readers and route the HSTU blocks' attention (K/V all-gather, or a head
   all-to-all with ``cp_attention="heads"``). After checkpointing, so that the shard/gather hooks sit
   outside the recomputed blocks and the attention route inside them.
5. **FSDP2 / HSDP** per block, then the root, on ``dp_shard`` (``dp_shard x cp`` flattened when
   ``cp > 1``), preceded by ``dp_replicate`` for HSDP (:meth:`ParallelDims.fsdp_mesh`).
6. **Dense optimizer** (:func:`build_dense_optimizer`): AdamW over the parameters FSDP owns.

Each rank must then feed its own slice of the global batch (``dims.dp_rank()`` of ``dims.dp``; cp and
tp ranks read the same slice); losses are per-rank means, and both FSDP (reduce-scatter) and torchrec
(all-to-all backward) average gradients over ranks, so one step equals one single-process step on the
mean of the per-rank losses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.types import ShardedModule, ShardingPlan

from foundation.model.embeddings import sparse_gradients
from foundation.parallel.activation import apply_activation_checkpointing
from foundation.parallel.compile import apply_compile
from foundation.parallel.context import CP_ATTENTION, apply_context_parallel
from foundation.parallel.dims import ParallelDims
from foundation.parallel.embeddings import (
    EmbeddingShardingConfig,
    apply_embedding_sharding,
    find_embedding_modules,
)
from foundation.parallel.fsdp import FSDPConfig, apply_fsdp
from foundation.parallel.tensor import apply_tensor_parallel


@dataclass
class ParallelConfig:
    """What :func:`parallelize_teacher` applies besides the degrees in :class:`ParallelDims`.

    Kept apart from :class:`~foundation.parallel.settings.ParallelSettings` (the run config's flat section, built
    into this by :func:`~foundation.parallel.strategy.build_parallel_config`): typed components and the dense optimizer.

    Attributes:
        shard_embeddings: shard the torchrec tables (else they stay whole on every rank and are
            data-parallel like the rest; fine for small tables).
        embeddings: sharding types and the fused sparse optimizer.
        fsdp: apply FSDP2/HSDP to the dense part (else dense parameters are replicated and the
            caller must reduce their gradients).
        fsdp_options: precision and unit choice.
        activation_checkpointing: recompute each block's activations in backward.
        compile: ``torch.compile`` each block (:mod:`foundation.parallel.compile`); not with ``cp > 1``.
        cp_attention: how context-parallel ranks attend over every rank's tokens: ``gather`` (all-gather
            K/V; works for any head count) or ``heads`` (all-to-all to ``H/cp`` heads per rank; splits the
            attention FLOPs ``cp`` ways; ``cp`` must divide the heads). See :mod:`foundation.parallel.context`.
        lr, weight_decay, betas, eps: the dense AdamW.
    """

    shard_embeddings: bool = True
    embeddings: EmbeddingShardingConfig = field(default_factory=EmbeddingShardingConfig)
    fsdp: bool = True
    fsdp_options: FSDPConfig = field(default_factory=FSDPConfig)
    activation_checkpointing: bool = False
    compile: bool = False
    cp_attention: str = "gather"
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8


def check_supported(dims: ParallelDims, cfg: ParallelConfig) -> None:
    """Reject degree combinations this module does not apply yet, before any collective runs."""
    if cfg.cp_attention not in CP_ATTENTION:
        raise ValueError(f"parallel.cp_attention must be one of {CP_ATTENTION}, got {cfg.cp_attention!r}")
    if cfg.shard_embeddings and dims.emb_replicate > 1:
        raise ValueError(
            f"parallelize_teacher: 2-D embedding sharding (emb_shard={dims.emb_shard} < world "
            f"{dims.world_size}) is not supported: torchrec 1.8's DMPCollection asserts a CUDA or MTIA device "
            "(torchrec/distributed/model_parallel.py, DMPCollection.__init__), so it cannot run or be tested on "
            "CPU/gloo here; use emb_shard=-1"
        )
    if cfg.compile and dims.cp > 1:
        raise ValueError("parallelize_teacher: compile=True with cp > 1 is not supported (CP's hooks run collectives)")
    if not cfg.fsdp and dims.dp * dims.cp > 1:
        raise ValueError(
            "parallelize_teacher: with dp > 1 or cp > 1 the dense part needs fsdp=True to reduce its gradients"
        )


def sharded_embedding_parameters(model: nn.Module) -> set[nn.Parameter]:
    """Parameters owned by torchrec sharded modules (updated by the fused optimizer, not by FSDP/AdamW)."""
    return {p for m in model.modules() if isinstance(m, ShardedModule) for p in m.parameters()}


def dense_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Trainable parameters that the dense optimizer steps: all but the embedding tables.

    Unsharded tables are excluded too when the sparse optimizer already runs in backward on them.
    """
    skip = sharded_embedding_parameters(model)
    skip |= {
        p
        for m in find_embedding_modules(model).values()
        for p in m.parameters()
        if hasattr(p, "_in_backward_optimizers")
    }
    return [p for p in model.parameters() if p.requires_grad and p not in skip]


def parallelize_teacher(
    model: nn.Module, dims: ParallelDims, cfg: ParallelConfig, device: torch.device | None = None
) -> ShardingPlan | None:
    """Apply embedding sharding, TP, activation checkpointing, CP, then FSDP2/HSDP to ``model``, in place
    (see the module docstring for the order).

    ``dims.build_mesh()`` must have been called. Returns the torchrec sharding plan (None when
    tables are not sharded).
    """
    check_supported(dims, cfg)
    device = device or torch.device("cpu")
    sparse_gradients(model, sparse=False)
    plan = None
    if cfg.shard_embeddings:
        plan = apply_embedding_sharding(model, cfg.embeddings, dist.group.WORLD, device)
    if dims.tp > 1:
        apply_tensor_parallel(model, dims.mesh_for("tp"))
    if cfg.activation_checkpointing:
        apply_activation_checkpointing(model, cfg.fsdp_options.units)
    if cfg.compile:
        apply_compile(model, cfg.fsdp_options.units)
    if dims.cp > 1:
        apply_context_parallel(model, dims.mesh_for("cp"), cfg.cp_attention)
    if cfg.fsdp:
        apply_fsdp(model, dims.fsdp_mesh(), cfg.fsdp_options, ignored_params=sharded_embedding_parameters(model))
    return plan


def build_dense_optimizer(model: nn.Module, cfg: ParallelConfig) -> torch.optim.AdamW:
    """AdamW over :func:`dense_parameters` (DTensor shards once FSDP has run)."""
    return torch.optim.AdamW(
        dense_parameters(model), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
    )
