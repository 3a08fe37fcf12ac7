"""PyTorch references for the SiLU of a projection split into its parts (the HSTU block's ``u, v, q, k``) and for
the sigmoid self-gate ``x * sigmoid(g)`` (the InterFormer summary's)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.glue import SiluGate


def silu_split(
    h: torch.Tensor, widths: Sequence[int], bias: torch.Tensor | None = None, *, gate_first: bool = False
) -> tuple[torch.Tensor | SiluGate, ...]:
    """``silu(h + bias)`` split along the last axis into ``widths``: ``h[L, N]``, ``bias[N]`` or None -> ``[L, w_i]``
    views in h's dtype, ``sum(w_i) = N``. The bias is added in h's dtype, as a GEMM's bias epilogue rounds it.
    ``gate_first``: the first part is ``SiluGate(h's columns, bias's columns)``, not activated.

    Autograd's backward concatenates the parts' gradients into one ``[L, N]`` tensor, then runs SiLU's backward.
    """
    if not gate_first:
        pre = h if bias is None else h + bias.to(h.dtype)
        return torch.split(torch.nn.functional.silu(pre), list(widths), -1)
    width = widths[0]
    gate = SiluGate(h[:, :width], None if bias is None else bias[:width])
    rest = silu_split(h[:, width:], widths[1:], None if bias is None else bias[width:]) if widths[1:] else ()
    return (gate, *rest)


def sigmoid_gate(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(g)`` for ``x`` and ``g`` of one shape, in their promoted dtype, computed in float32 (as the
    Triton kernel computes it) and rounded once."""
    return (x.float() * torch.sigmoid(g.float())).to(torch.promote_types(x.dtype, g.dtype))
