"""FSDP2 / HSDP for the dense part of a model: ``fully_shard`` per block, then the root.

Blocks are found by duck typing so that model code stays single-device: a model may name its
units in an attribute ``fsdp_units`` (names of sub-modules or ``ModuleList`` s); otherwise every
element of every top-level ``nn.ModuleList`` is a unit. Whatever no unit holds (small heads, CLS
tokens, side embeddings) is sharded with the root, unless ``shard_children`` gives each other
direct child its own unit. Parameters owned by torchrec's sharded
embedding modules are ignored: their rows are model-parallel and updated by the fused optimizer.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from foundation.model.interformer import PersonalizedFFN, SequenceSummary

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
        shard_children: also wrap every other direct child with dense parameters (see
            :func:`other_dense_children`). Needed for bf16 compute when a model feeds fp32
            embedding outputs into such children; only valid when the model calls those children
            through ``forward`` (FSDP gathers parameters around ``forward`` only), as the DLRM
            baseline and the teacher do.
    """

    param_dtype: str = "fp32"
    reduce_dtype: str = "fp32"
    reshard_after_forward: bool = True
    units: tuple[str, ...] | None = None
    shard_children: bool = False

    def __post_init__(self) -> None:
        for name in (self.param_dtype, self.reduce_dtype):
            if name not in PARAM_DTYPES:
                raise ValueError(f"FSDP dtype must be one of {sorted(PARAM_DTYPES)}, got {name!r}")

    def mixed_precision(self) -> MixedPrecisionPolicy:
        return MixedPrecisionPolicy(
            param_dtype=PARAM_DTYPES[self.param_dtype],
            reduce_dtype=PARAM_DTYPES[self.reduce_dtype] or torch.float32,
        )


def find_unit_paths(model: nn.Module, names: tuple[str, ...] | None = None) -> list[str]:
    """Fully-qualified names of the block modules (a ``ModuleList`` contributes each element).

    ``names`` overrides the model's ``fsdp_units`` attribute; without either, every top-level
    ``nn.ModuleList`` is a list of blocks. Blocks without trainable parameters are skipped.
    """
    names = names if names is not None else getattr(model, "fsdp_units", None)
    if names is None:
        names = [n for n, m in model.named_children() if isinstance(m, nn.ModuleList)]
    paths = []
    for name in names:
        module = model.get_submodule(name)
        if isinstance(module, nn.ModuleList):
            paths += [f"{name}.{i}" for i in range(len(module))]
        else:
            paths.append(name)
    return [p for p in paths if any(q.requires_grad for q in model.get_submodule(p).parameters())]


def other_dense_children(model: nn.Module, blocks: list[str], ignored: set[nn.Parameter]) -> list[str]:
    """Direct children outside the blocks that own trainable dense parameters (heads, towers, projections).

    Each gets its own ``fully_shard`` too: its parameters are gathered only around its forward,
    and, under mixed precision, FSDP casts its floating inputs to the compute dtype, which is
    what lets fp32 embedding outputs from torchrec meet bf16 weights.
    """
    taken = {p.split(".")[0] for p in blocks}
    return [
        name
        for name, child in model.named_children()
        if name not in taken
        and not isinstance(child, nn.ModuleList)
        and any(p.requires_grad and p not in ignored for p in child.parameters())
    ]


def apply_fsdp(
    model: nn.Module, mesh: DeviceMesh, cfg: FSDPConfig, ignored_params: set[nn.Parameter]
) -> None:
    """``fully_shard`` every block, every other dense child, then the root, over ``mesh``.

    A 1-D mesh shards (FSDP); a 2-D ``(dp_replicate, dp_shard)`` mesh replicates across the first
    dim and shards across the second (HSDP).
    """
    # FSDP2 warns, every step, when a unit returns a view: an in-place op on it would skip the unit's pre-backward
    # hook. These views are by design and nothing modifies them in place: the personalised FFN and the sequence
    # summary hand the residual stream on through a norm's autograd op, as a view of its input (that op's backward
    # then adds the stream's gradient in its own pass; the next block adds to it out of place), and a model's
    # per-task logits are the columns of one [B, tasks] tensor (the losses read them out of place).
    for name in {PersonalizedFFN.__name__, SequenceSummary.__name__, type(model).__name__}:
        warnings.filterwarnings(
            "ignore", message=rf"FSDP2-wrapped module \(FSDP{name}\) returned a view", category=UserWarning
        )
    policy = cfg.mixed_precision()
    blocks = find_unit_paths(model, cfg.units)
    children = other_dense_children(model, blocks, ignored_params) if cfg.shard_children else []
    for path in blocks + children:
        fully_shard(
            model.get_submodule(path),
            mesh=mesh,
            mp_policy=policy,
            reshard_after_forward=cfg.reshard_after_forward,
            ignored_params=ignored_params,
        )
    # The root's parameters are gathered at forward start and needed through backward's end.
    fully_shard(
        model, mesh=mesh, mp_policy=policy, reshard_after_forward=False, ignored_params=ignored_params
    )
