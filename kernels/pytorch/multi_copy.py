"""Reference for :mod:`kernels.triton.multi_copy`: one ``copy_`` per pair."""

from __future__ import annotations

import torch


def multi_copy(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``dsts[i].copy_(srcs[i])`` for every ``i`` (same shapes; the dtypes may differ, e.g. float32 parameters into
    their bf16 copies, or bf16 gradients into float32 buffers); ``torch._foreach_copy_``, which converts one tensor
    per kernel where the dtypes differ."""
    if dsts:
        torch._foreach_copy_(dsts, srcs)
