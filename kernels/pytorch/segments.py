"""PyTorch reference for broadcasting per-row vectors over a jagged batch's tokens."""

from __future__ import annotations

import torch


def jagged_broadcast(values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``values[rows]``: ``values[B, N]``, ``rows[L]`` sorted row of every token -> ``[L, N]``.

    Autograd's backward is ``index_add_`` of the token gradients into ``[B, N]``.
    """
    return values.index_select(0, rows)
