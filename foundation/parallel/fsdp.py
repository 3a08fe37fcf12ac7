"""FSDP2 / HSDP for the dense part of a model: ``fully_shard`` per block, then the root.

Blocks are found by duck typing so that model code stays single-device: a model may name its
units in an attribute ``fsdp_units`` (names of sub-modules or ``ModuleList`` s); otherwise every
element of every top-level ``nn.ModuleList`` is a unit. Whatever no unit holds (small heads, CLS
tokens, side embeddings) is sharded with the root. Parameters owned by torchrec's sharded
embedding modules are ignored: their rows are model-parallel and updated by the fused optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

PARAM_DTYPES = {"fp32": None, "bf16": torch.bfloat16}


@dataclass
class FSDPConfig:
    """FSDP2 options.

    Attributes:
        param_dtype: compute dtype of all-gathered parameters (``fp32`` or ``bf16``); gradients
            are reduced in ``reduce_dtype`` either way.
        reduce_dtype: ``fp32`` keeps gradient reduction exact-ish at bf16 compute.
        reshard_after_forward: free gathered parameters after forward (ZeRO-3) or keep them
            until backward (ZeRO-2, more memory, one all-gather fewer).
        units: sub-module names to wrap, overriding the model's ``fsdp_units`` and the
            ``ModuleList`` default.
    """

    param_dtype: str = "fp32"
    reduce_dtype: str = "fp32"
    reshard_after_forward: bool = True
    units: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        for name in (self.param_dtype, self.reduce_dtype):
            if name not in PARAM_DTYPES:
                raise ValueError(f"FSDP dtype must be one of {sorted(PARAM_DTYPES)}, got {name!r}")

    def mixed_precision(self) -> MixedPrecisionPolicy:
        return MixedPrecisionPolicy(
            param_dtype=PARAM_DTYPES[self.param_dtype],
            reduce_dtype=PARAM_DTYPES[self.reduce_dtype] or torch.float32,
        )


def find_fsdp_units(model: nn.Module, names: tuple[str, ...] | None = None) -> list[nn.Module]:
    """The modules that each get their own ``fully_shard`` (a ``ModuleList`` named contributes each element)."""
    names = names if names is not None else getattr(model, "fsdp_units", None)
    if names is None:
        lists = [m for m in model.children() if isinstance(m, nn.ModuleList)]
    else:
        lists = [model.get_submodule(n) for n in names]
    units = []
    for m in lists:
        units += list(m) if isinstance(m, nn.ModuleList) else [m]
    return [u for u in units if any(p.requires_grad for p in u.parameters())]


def apply_fsdp(
    model: nn.Module, mesh: DeviceMesh, cfg: FSDPConfig, ignored_params: set[nn.Parameter]
) -> None:
    """``fully_shard`` every unit, then the root, over ``mesh``.

    A 1-D mesh shards (FSDP); a 2-D ``(dp_replicate, dp_shard)`` mesh replicates across the first
    dim and shards across the second (HSDP).
    """
    policy = cfg.mixed_precision()
    for unit in find_fsdp_units(model, cfg.units):
        fully_shard(
            unit,
            mesh=mesh,
            mp_policy=policy,
            reshard_after_forward=cfg.reshard_after_forward,
            ignored_params=ignored_params,
        )
    # The root's parameters are gathered at forward start and needed through backward's end.
    fully_shard(
        model, mesh=mesh, mp_policy=policy, reshard_after_forward=False, ignored_params=ignored_params
    )
