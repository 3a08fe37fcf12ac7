"""FLOP counts for jagged attention on valid (unmasked) (query, key) pairs only.

Convention: the forward pass costs ``2 * Dqk + 2 * Dv`` FLOPs per valid pair (``QK^T`` and
``PV``); the backward pass costs 2.5x the forward (``dV``, ``dP``, ``dQ``, ``dK`` and the
recomputed ``QK^T``: five matrix products against the forward's two). Elementwise work
(activation, softmax, masks) is not counted. These are the figures behind every TFLOP/s in
``docs/benchmarks.md`` and behind the teacher's MFU.
"""

from __future__ import annotations

import torch

from kernels.pytorch.jagged_attention import self_attention_mask

BACKWARD_FACTOR = 2.5


def valid_pairs(
    offsets: torch.Tensor,
    max_len: int,
    *,
    causal: bool,
    num_targets: torch.Tensor | None = None,
    window: int | None = None,
) -> int:
    """Number of (query, key) pairs that attend in a jagged self-attention batch.

    Args:
        offsets: ``[B + 1]`` int64.
        max_len: ``N``.
        causal, num_targets (``[B]``), window: as in :func:`kernels.jagged_attention`.
    """
    lengths = (offsets[1:] - offsets[:-1]).cpu()
    nt = num_targets.cpu() if num_targets is not None else None
    if window is None:
        # History pairs, plus each target seeing the history and itself.
        n_t = nt.to(torch.float64) if nt is not None else torch.zeros(lengths.numel(), dtype=torch.float64)
        n_h = lengths.to(torch.float64) - n_t
        hist = n_h * (n_h + 1) / 2 if causal else n_h * n_h
        return int((hist + n_t * (n_h + 1)).sum().item())
    total = 0
    for b in range(lengths.numel()):
        sub_nt = nt[b : b + 1] if nt is not None else None
        mask, _ = self_attention_mask(lengths[b : b + 1], int(lengths[b]), causal=causal, num_targets=sub_nt, window=window)
        total += int(mask.sum())
    return total


def attention_flops(pairs: int, heads: int, dim_qk: int, dim_v: int, *, backward: bool = False) -> float:
    """FLOPs of ``pairs`` valid pairs per head over ``heads`` heads, forward or backward."""
    fwd = 2.0 * pairs * heads * (dim_qk + dim_v)
    return fwd * BACKWARD_FACTOR if backward else fwd


def cross_attention_pairs(q_offsets: torch.Tensor, kv_offsets: torch.Tensor) -> int:
    """Valid pairs of a jagged cross-attention batch: ``sum_b len_q[b] * len_kv[b]``."""
    nq = (q_offsets[1:] - q_offsets[:-1]).cpu().to(torch.float64)
    nk = (kv_offsets[1:] - kv_offsets[:-1]).cpu().to(torch.float64)
    return int((nq * nk).sum().item())
