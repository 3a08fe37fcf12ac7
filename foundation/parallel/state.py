"""Whole (unsharded) tensors from a parallelized model: for tests against a single-process run and
for a plain single-file export that any process can load without a process group."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor

from foundation.data.io import atomic_path


def gather_sharded_tensor(tensor: ShardedTensor) -> torch.Tensor:
    """Every rank gets the full tensor (collective over the tensor's process group)."""
    full = torch.empty(tensor.size(), dtype=tensor.dtype) if dist.get_rank() == 0 else None
    tensor.gather(dst=0, out=full)
    if full is None:
        full = torch.empty(tensor.size(), dtype=tensor.dtype)
    dist.broadcast(full, src=0)
    return full


def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``state_dict`` with FSDP's DTensors and torchrec's ShardedTensors made whole, on every rank.

    Collective: every rank must call it, in the same order. Keys are those of the single-device
    model (torchrec and FSDP2 both keep the original fully-qualified names).
    """
    full = {}
    for name, value in model.state_dict().items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        elif isinstance(value, ShardedTensor):
            value = gather_sharded_tensor(value)
        full[name] = value.detach().clone()
    return full


def export_single_file(model: nn.Module, path: str | Path) -> None:
    """Collective: write the whole model to one safetensors file, loadable by a single-device model.

    Rank 0 writes a temporary file, fsyncs it and renames it over ``path``, so a reader never sees
    a partial export; every rank waits for it before returning.
    """
    full = gather_full_state_dict(model)
    path = Path(path)
    if dist.get_rank() == 0:
        with atomic_path(path) as tmp:
            save_file({k: v.contiguous() for k, v in full.items()}, str(tmp))
    dist.barrier()
