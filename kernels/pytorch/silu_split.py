"""PyTorch reference for the SiLU of a projection split into its parts (the HSTU block's ``u, v, q, k``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def silu_split(h: torch.Tensor, widths: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """``silu(h)`` split along the last axis into ``widths``: ``h[L, N]`` -> ``[L, w_i]`` views, ``sum(w_i) = N``.

    Autograd's backward concatenates the parts' gradients into one ``[L, N]`` tensor, then runs SiLU's backward.
    """
    return torch.split(torch.nn.functional.silu(h), list(widths), -1)
