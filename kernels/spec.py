"""What a jagged self-attention call computes: one description shared by the dispatcher and every backend."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from kernels.checks import check_num_targets, check_table, check_timestamps
from kernels.pytorch.jagged_attention import ACTIVATIONS

# Options that routes written before them (foundation/parallel/context.py) do not know; a call passes
# them on only when set.
_NEWER_OPTIONS = ("query_timestamps", "divisor")


@dataclass(frozen=True, eq=False)
class AttentionSpec:
    """Everything a jagged self-attention computes besides ``q, k, v, offsets, max_len``.

    ``out_i = sum_j f(alpha * q_i . k_j + bias_ij) v_j`` over the keys ``j`` query ``i`` may see,
    where ``f`` is the softmax over those keys or a pointwise activation divided by ``divisor``.
    Positions ``p(i) = min(i, n_hist)`` count from 0 inside each sequence (``n_hist`` its length
    minus its targets).

    Attributes:
        activation: ``"softmax"``, ``"silu"``, ``"gelu"`` (exact, erf), ``"relu"`` or ``"identity"``.
        causal: query ``i`` sees keys ``j <= i`` only.
        alpha: scale on ``q . k``; None means ``1 / sqrt(Dqk)``.
        num_targets: ``[B]`` int or None. The last ``num_targets[b]`` tokens of sequence ``b`` are
            targets: each sees the whole history (the non-target prefix) and itself, never another
            target, and no history token sees a target.
        window: int or None; sliding window on positions: ``i`` sees ``j`` only when
            ``|p(i) - p(j)| < window``, combined with ``causal``.
        pos_bias: ``[H, P]`` or ``[1, P]`` table; adds ``pos_bias[h, min(|p(i) - p(j)|, P - 1)]``.
        time_bias: ``[H, T]`` or ``[1, T]`` table; adds ``time_bias[h, bucket]`` with
            ``bucket = min(floor(ln(max(|qts_i - ts_j|, 1)) / 0.301), T - 1)``.
        timestamps: ``[L]`` int64 event times ``ts``; required with ``time_bias``.
        query_timestamps: ``[L]`` int64 or None: the time ``qts_i`` each query measures its
            distance to the keys from; None means ``timestamps``. HSTU's target-time bias passes the
            time of the event each position predicts (``ts[i + 1]``). Only with ``time_bias``.
        divisor: positive number or None; the pointwise activations are divided by it (HSTU's
            fixed ``N``, independent of the batch); None means ``max_len``. Unused by softmax.
    """

    activation: str = "silu"
    causal: bool = True
    alpha: float | None = None
    num_targets: torch.Tensor | None = None
    window: int | None = None
    pos_bias: torch.Tensor | None = None
    time_bias: torch.Tensor | None = None
    timestamps: torch.Tensor | None = None
    query_timestamps: torch.Tensor | None = None
    divisor: float | None = None

    @classmethod
    def from_options(cls, options: dict) -> AttentionSpec:
        """The spec of ``jagged_attention``'s keyword options; an unknown one is a ValueError."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise ValueError(f"jagged_attention got unknown options {unknown}; valid: {sorted(names)}")
        return cls(**options)

    def as_options(self) -> dict:
        """The keyword options of this spec, the newer ones only when set (module comment)."""
        options = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in _NEWER_OPTIONS:
            if options[name] is None:
                del options[name]
        return options

    def scale(self, dim_qk: int) -> float:
        """``alpha``, by default ``1 / sqrt(Dqk)``."""
        return 1.0 / math.sqrt(dim_qk) if self.alpha is None else float(self.alpha)

    def pointwise_divisor(self, max_len: int) -> float:
        """What the pointwise activations are divided by (at least 1 for an empty batch)."""
        return float(self.divisor) if self.divisor is not None else float(max(max_len, 1))

    def check(self, q: torch.Tensor, offsets: torch.Tensor) -> None:
        """Raises ValueError, naming the option, where the spec does not fit ``q[L, H, D]`` and
        ``offsets[B + 1]``."""
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.window is not None and (not isinstance(self.window, int) or self.window < 1):
            raise ValueError(f"window must be a positive int or None, got {self.window!r}")
        if self.alpha is not None and not isinstance(self.alpha, (int, float)):
            raise ValueError(f"alpha must be a number or None, got {self.alpha!r}")
        if self.divisor is not None and (not isinstance(self.divisor, (int, float)) or not self.divisor > 0):
            raise ValueError(f"divisor must be a positive number or None, got {self.divisor!r}")
        if self.num_targets is not None:
            check_num_targets(self.num_targets, offsets, offsets.numel() - 1, q.device)
        check_table("pos_bias", self.pos_bias, q.shape[1], q)
        check_table("time_bias", self.time_bias, q.shape[1], q)
        if self.time_bias is not None:
            if self.timestamps is None:
                raise ValueError("timestamps [L] are required with time_bias")
            check_timestamps("timestamps", self.timestamps, q)
        if self.query_timestamps is not None:
            if self.time_bias is None:
                raise ValueError("query_timestamps [L] only enter the time bias; pass time_bias with them")
            check_timestamps("query_timestamps", self.query_timestamps, q)
