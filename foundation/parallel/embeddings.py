"""Model-parallel embedding tables: torchrec's planner picks shard placement, ``shard_modules`` swaps
every ``EmbeddingBagCollection`` / ``EmbeddingCollection`` for its sharded variant in place, and a
fused sparse optimizer updates the table rows inside backward (no dense gradient is ever built).

The sparse optimizer must be attached *before* sharding: torchrec's sharders read it off the
parameters (``apply_optimizer_in_backward``) and compile it into the fused fbgemm kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec import EmbeddingBagCollection, EmbeddingCollection
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.shard import shard_modules
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec.distributed.types import ShardingEnv, ShardingPlan, ShardingType
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

SHARDING_TYPES = {
    "table_wise": ShardingType.TABLE_WISE,
    "row_wise": ShardingType.ROW_WISE,
    "column_wise": ShardingType.COLUMN_WISE,
    # Every rank keeps the whole table (small tables: no all-to-all, gradients all-reduced).
    "data_parallel": ShardingType.DATA_PARALLEL,
}
SPARSE_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "rowwise_adagrad": RowWiseAdagrad,
    "adagrad": torch.optim.Adagrad,
    "adam": torch.optim.Adam,
    "sgd": torch.optim.SGD,
}
EMBEDDING_MODULE_TYPES = (EmbeddingBagCollection, EmbeddingCollection)


@dataclass
class EmbeddingShardingConfig:
    """How the torchrec tables are sharded and optimised.

    Attributes:
        sharding_types: allowed types the planner may choose from (``table_wise``, ``row_wise``,
            ``column_wise``, ``data_parallel``); ``()`` lets the planner use all it knows.
        table_sharding_types: per-table override, table name -> allowed types.
        column_wise_min_dim: smallest column shard; tables narrower than ``2 * column_wise_min_dim``
            stay whole even when column-wise.
        optimizer: fused sparse optimizer: ``rowwise_adagrad`` (one state scalar per row: the
            mean squared gradient over the row's columns, so with column-wise sharding each shard
            keeps its own and the update differs from unsharded), ``adagrad`` (exact, per
            element), ``adam`` or ``sgd``.
        lr, eps, weight_decay: its hyper-parameters (``eps`` unused by ``sgd``).
    """

    sharding_types: tuple[str, ...] = ()
    table_sharding_types: dict[str, tuple[str, ...]] | None = None
    column_wise_min_dim: int = 4
    optimizer: str = "rowwise_adagrad"
    lr: float = 0.01
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        self.sharding_types = tuple(self.sharding_types)
        every = [*self.sharding_types, *(t for ts in (self.table_sharding_types or {}).values() for t in ts)]
        unknown = sorted(set(every) - set(SHARDING_TYPES))
        if unknown:
            raise ValueError(f"unknown embedding sharding type(s) {unknown}; known: {sorted(SHARDING_TYPES)}")
        if self.optimizer not in SPARSE_OPTIMIZERS:
            raise ValueError(
                f"unknown sparse optimizer {self.optimizer!r}; known: {sorted(SPARSE_OPTIMIZERS)}"
            )

    def optimizer_kwargs(self) -> dict[str, float]:
        kwargs = {"lr": self.lr, "weight_decay": self.weight_decay}
        if self.optimizer != "sgd":
            kwargs["eps"] = self.eps
        return kwargs


def find_embedding_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Fully-qualified name -> every torchrec ``EmbeddingBagCollection`` / ``EmbeddingCollection`` in ``model``."""
    return {name: m for name, m in model.named_modules() if isinstance(m, EMBEDDING_MODULE_TYPES)}


def module_tables(module: nn.Module) -> list[str]:
    """Table names of one EBC/EC."""
    configs = (
        module.embedding_bag_configs()
        if isinstance(module, EmbeddingBagCollection)
        else module.embedding_configs()
    )
    return [c.name for c in configs]


def apply_sparse_optimizer(model: nn.Module, cfg: EmbeddingShardingConfig) -> None:
    """Attach the sparse optimizer to every table so that it steps inside backward.

    Works on an unsharded model too (then it runs torchrec's Python optimizer per parameter), which
    is how a single-process reference trains with the same update rule.
    """
    params = [p for m in find_embedding_modules(model).values() for p in m.parameters()]
    apply_optimizer_in_backward(SPARSE_OPTIMIZERS[cfg.optimizer], params, cfg.optimizer_kwargs())


def build_constraints(
    model: nn.Module, cfg: EmbeddingShardingConfig, device: torch.device
) -> dict[str, ParameterConstraints]:
    """Planner constraints: the allowed sharding types of every table.

    Raises a clear error when a requested type is one torchrec cannot apply to that module on this
    device (e.g. row-wise ``EmbeddingBagCollection`` s need CUDA; row-wise ``EmbeddingCollection`` s
    work on CPU too), instead of the planner's search-space error.
    """
    per_table = cfg.table_sharding_types or {}
    sharders = {s.module_type: s for s in get_default_sharders()}
    constraints = {}
    for path, module in find_embedding_modules(model).items():
        supported = set(sharders[type(module)].sharding_types(device.type))
        for name in module_tables(module):
            allowed = per_table.get(name, cfg.sharding_types)
            if not allowed:
                continue
            unsupported = [t for t in allowed if SHARDING_TYPES[t].value not in supported]
            if unsupported:
                raise ValueError(
                    f"table {name!r} of {type(module).__name__} {path!r}: torchrec cannot shard it "
                    f"{unsupported} on {device.type}; it supports {sorted(supported)}"
                )
            constraints[name] = ParameterConstraints(
                sharding_types=[SHARDING_TYPES[t].value for t in allowed],
                min_partition=cfg.column_wise_min_dim,
            )
    return constraints


def build_sharding_plan(
    model: nn.Module, cfg: EmbeddingShardingConfig, group: dist.ProcessGroup, device: torch.device
) -> ShardingPlan:
    """Plan on rank 0 of ``group`` and broadcast, so that every rank shards identically."""
    world = dist.get_world_size(group)
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world, compute_device=device.type, local_world_size=world),
        constraints=build_constraints(model, cfg, device),
    )
    return planner.collective_plan(model, get_default_sharders(), group)


def copy_into_shards(sharded: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Write whole tables ``full`` (state-dict keys of the unsharded module) into this rank's shards.

    torchrec's sharded modules allocate fresh tables; copying keeps the model's own initialisation,
    so a parallel run starts from exactly the single-process weights. The ShardedTensor shards
    are views of the fused kernel's storage, so copying into them updates the live tables.
    """
    with torch.no_grad():
        for key, value in sharded.state_dict().items():
            if isinstance(value, ShardedTensor):
                for shard in value.local_shards():
                    index = tuple(
                        slice(o, o + n)
                        for o, n in zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes, strict=True)
                    )
                    shard.tensor.copy_(full[key][index])
            else:
                value.copy_(full[key])


def apply_embedding_sharding(
    model: nn.Module, cfg: EmbeddingShardingConfig, group: dist.ProcessGroup, device: torch.device
) -> ShardingPlan:
    """Attach the fused optimizer, plan, and shard every table module of ``model`` in place over ``group``,
    keeping the tables' current values.

    Returns the plan (for logging: which table went where).
    """
    if not find_embedding_modules(model):
        raise ValueError(
            "apply_embedding_sharding: the model has no torchrec EmbeddingBagCollection/EmbeddingCollection"
        )
    apply_sparse_optimizer(model, cfg)
    plan = build_sharding_plan(model, cfg, group, device)
    tables = {path: m.state_dict() for path, m in find_embedding_modules(model).items()}
    shard_modules(model, env=ShardingEnv.from_process_group(group), device=device, plan=plan)
    for path, full in tables.items():
        copy_into_shards(model.get_submodule(path), full)
    return plan


def summarize_plan(plan: ShardingPlan) -> dict[str, dict[str, object]]:
    """Table name -> ``{"sharding_type", "ranks"}``: where each table went, for logs and tests."""
    return {
        table: {"sharding_type": p.sharding_type, "ranks": sorted(p.ranks or [])}
        for module_plan in plan.plan.values()
        for table, p in module_plan.items()
    }
