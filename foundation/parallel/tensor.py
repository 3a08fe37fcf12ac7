"""Tensor parallel for MLPs: each ``Linear → activation → Linear`` pair inside an ``nn.Sequential``
becomes column-wise then row-wise (Megatron style), so the hidden activation stays sharded and
one all-reduce per pair (forward and backward) restores the full output.

Pairs are found structurally (no model hooks needed): within an ``nn.Sequential``, a ``Linear``
followed by elementwise modules only and then another ``Linear``. Greedy and non-overlapping: a
three-layer MLP gets its first two layers paired and its last one left replicated. Every rank of
a tp group must read the same rows (``ParallelDims.dp_rank`` already ignores ``tp``).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

ELEMENTWISE = (nn.ReLU, nn.SiLU, nn.GELU, nn.Tanh, nn.Sigmoid, nn.Dropout, nn.Identity)


def find_linear_pairs(model: nn.Module) -> list[tuple[str, str]]:
    """``(column-wise fqn, row-wise fqn)`` for every ``Linear → elementwise* → Linear`` run in a ``Sequential``."""
    pairs = []
    for seq_name, seq in model.named_modules():
        if not isinstance(seq, nn.Sequential):
            continue
        prefix = f"{seq_name}." if seq_name else ""
        children = list(seq.named_children())
        open_linear = None
        for name, child in children:
            if isinstance(child, nn.Linear):
                if open_linear is None:
                    open_linear = name
                else:
                    pairs.append((prefix + open_linear, prefix + name))
                    open_linear = None
            elif not isinstance(child, ELEMENTWISE):
                open_linear = None
    return pairs


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> list[tuple[str, str]]:
    """Shard every pair of :func:`find_linear_pairs` over ``tp_mesh``; returns the pairs.

    Raises when a pair's hidden width does not divide by the tp degree (the shards must be even).
    """
    tp = tp_mesh.size()
    pairs = find_linear_pairs(model)
    plan = {}
    for col, row in pairs:
        hidden = model.get_submodule(col).out_features
        if hidden % tp:
            raise ValueError(f"tensor parallel: {col} has {hidden} outputs, not divisible by tp={tp}")
        plan[col] = ColwiseParallel()
        plan[row] = RowwiseParallel()
    if plan:
        parallelize_module(model, tp_mesh, plan)
    return pairs
