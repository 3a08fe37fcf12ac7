"""Jagged attention: the public dispatchers.

Model code reaches the kernels only through these functions. ``backend="auto"`` runs the Triton
kernels on CUDA tensors and the PyTorch reference elsewhere; ``"pytorch"`` and ``"triton"``
force one (the Triton one also runs on CPU tensors under ``TRITON_INTERPRET=1``, which is how
the tests check it without a GPU). Every backend takes the same arguments and returns the same
function of them, with gradients for ``q``, ``k``, ``v``, ``pos_bias`` and ``time_bias``.

Inputs are checked at every call for what costs no device sync: shapes, dtypes, devices, and the
values of CPU tensors. The values of device offsets and ``num_targets`` (sorted, in range) are
validated once where batches are built (the data pipeline); inside a training step a check of them
would stall the host on the GPU at every call. :func:`check_values` turns those checks on for CUDA
tensors too, to debug a pipeline.

The environment variable ``GEM_ATTENTION_BACKEND`` (``pytorch`` or ``triton``), when set and not
``auto``, replaces ``backend="auto"`` at every call (an explicit backend is never overridden):
it runs a whole model on one backend without touching model code, e.g. to benchmark the
reference against the kernels (``experiments/bench_teacher.py --backend pytorch``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from contextvars import ContextVar

import torch

from kernels.pytorch.jagged_attention import ACTIVATIONS

__all__ = ["ACTIVATIONS", "check_values", "jagged_attention", "jagged_cross_attention", "route_jagged_attention"]

# Context parallelism (foundation/parallel/context.py) computes the model's unchanged jagged_attention calls on
# one rank's tokens against every rank's keys; it takes them over through this route.
_ATTENTION_ROUTE: ContextVar[Callable[..., torch.Tensor] | None] = ContextVar("jagged_attention_route", default=None)

_CHECK_VALUES: ContextVar[bool] = ContextVar("jagged_attention_check_values", default=False)

_BACKENDS = ("auto", "pytorch", "triton")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@contextlib.contextmanager
def check_values(enabled: bool = True) -> Iterator[None]:
    """Inside the context the dispatchers also check the values of offsets and ``num_targets`` on
    CUDA tensors (one device sync per call); outside, only on CPU tensors, where it costs no sync."""
    token = _CHECK_VALUES.set(enabled)
    try:
        yield
    finally:
        _CHECK_VALUES.reset(token)


def _values_checked(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" or _CHECK_VALUES.get()


def _check_offsets(name: str, offsets: torch.Tensor, rows: int, max_len: int, device: torch.device) -> int:
    if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError(f"{name} must be a 1-D tensor [B + 1], got {getattr(offsets, 'shape', offsets)}")
    if offsets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name} must be int64 or int32, got {offsets.dtype}")
    if offsets.device != device:
        raise ValueError(f"{name} is on {offsets.device} but the inputs are on {device}")
    if not isinstance(max_len, int) or max_len < 0:
        raise ValueError(f"the max length for {name} must be a non-negative int, got {max_len!r}")
    if _values_checked(offsets):
        _check_offset_values(name, offsets, rows, max_len)
    return offsets.numel() - 1


def _check_offset_values(name: str, offsets: torch.Tensor, rows: int, max_len: int) -> None:
    lengths = offsets[1:] - offsets[:-1]
    # One device sync for every value check together.
    first, last, shortest, longest = torch.stack(
        [
            offsets[0],
            offsets[-1],
            lengths.min() if lengths.numel() else offsets[0] * 0,
            lengths.max() if lengths.numel() else offsets[0] * 0,
        ]
    ).tolist()
    if first != 0 or last != rows:
        raise ValueError(f"{name} must start at 0 and end at the row count {rows}, got {first}..{last}")
    if shortest < 0:
        raise ValueError(f"{name} must be non-decreasing")
    if longest > max_len:
        raise ValueError(f"{name} has a sequence of length {longest} > max length {max_len}")


def _check_num_targets(num_targets: torch.Tensor, offsets: torch.Tensor, batch: int, device: torch.device) -> None:
    if not isinstance(num_targets, torch.Tensor) or num_targets.shape != (batch,):
        raise ValueError(f"num_targets must be [B]=[{batch}], got {getattr(num_targets, 'shape', num_targets)}")
    if num_targets.device != device or num_targets.dtype.is_floating_point:
        raise ValueError(f"num_targets must be an integer tensor on {device}")
    if _values_checked(num_targets):
        lengths = offsets[1:] - offsets[:-1]
        if bool(((num_targets < 0) | (num_targets > lengths)).any()):
            raise ValueError("num_targets must lie in [0, length] for every sequence")


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, same_rows: bool) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(f"{name} must be a 3-D tensor [L, H, D], got {getattr(x, 'shape', x)}")
        if x.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name} must be a floating tensor, got {x.dtype}")
        if x.device != q.device or x.dtype != q.dtype:
            raise ValueError(f"{name} must match q's dtype and device ({q.dtype}, {q.device}), got {x.dtype}, {x.device}")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree on [L, H]")
    if q.shape[1] != k.shape[1] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on H and Dqk")
    if same_rows and q.shape[0] != k.shape[0]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must have the same rows L")


def _check_bias(name: str, table: torch.Tensor | None, heads: int, q: torch.Tensor) -> None:
    if table is None:
        return
    if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.shape[0] not in (1, heads):
        raise ValueError(f"{name} must be [H, P] or [1, P] with H={heads}, got {getattr(table, 'shape', table)}")
    if table.shape[1] < 1 or table.device != q.device or not table.dtype.is_floating_point:
        raise ValueError(f"{name} must be a non-empty floating table on {q.device}")


def _check_timestamps(name: str, ts: torch.Tensor, q: torch.Tensor) -> None:
    if not isinstance(ts, torch.Tensor) or ts.shape != (q.shape[0],) or ts.dtype != torch.int64 or ts.device != q.device:
        raise ValueError(f"{name} must be int64 [L]=[{q.shape[0]}] on {q.device}, got {getattr(ts, 'shape', ts)}")


def _resolve_backend(backend: str, q: torch.Tensor) -> str:
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "auto":
        forced = os.environ.get("GEM_ATTENTION_BACKEND", "auto")
        if forced not in _BACKENDS:
            raise ValueError(f"GEM_ATTENTION_BACKEND must be one of {_BACKENDS}, got {forced!r}")
        if forced != "auto":
            return forced
        return "triton" if q.is_cuda else "pytorch"
    return backend


@contextlib.contextmanager
def route_jagged_attention(route: Callable[..., torch.Tensor] | None) -> Iterator[None]:
    """Inside the context, ``jagged_attention(q, k, v, offsets, max_len, **options)`` returns
    ``route(q, k, v, offsets, max_len, **options)`` instead; ``None`` restores the kernels (which is how a
    route calls them itself)."""
    token = _ATTENTION_ROUTE.set(route)
    try:
        yield
    finally:
        _ATTENTION_ROUTE.reset(token)


def _check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def jagged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    max_len: int,
    *,
    activation: str = "silu",
    causal: bool = True,
    alpha: float | None = None,
    num_targets: torch.Tensor | None = None,
    window: int | None = None,
    pos_bias: torch.Tensor | None = None,
    time_bias: torch.Tensor | None = None,
    timestamps: torch.Tensor | None = None,
    query_timestamps: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Self-attention inside each sequence of a jagged batch (HSTU GDPA or softmax).

    ``out_i = sum_j f(alpha * q_i . k_j + bias_ij) v_j`` over the keys ``j`` that query ``i``
    may see, where ``f`` is the softmax over those keys, or a pointwise activation divided by
    ``max_len`` (HSTU's ``1/N``).

    Args:
        q: ``[L, H, Dqk]`` queries, the rows of all sequences one after another.
        k: ``[L, H, Dqk]`` keys.
        v: ``[L, H, Dv]`` values.
        offsets: ``[B + 1]`` int64; sequence ``b`` is rows ``offsets[b]:offsets[b + 1]``.
        max_len: ``N``, an int at least the longest sequence; the pointwise activations are
            divided by it.
        activation: ``"softmax"``, ``"silu"``, ``"gelu"`` (exact, erf), ``"relu"`` or
            ``"identity"``.
        causal: query ``i`` sees keys ``j <= i`` only.
        alpha: scale on ``q . k``; default ``1 / sqrt(Dqk)``.
        num_targets: ``[B]`` int or None. The last ``num_targets[b]`` tokens of sequence ``b``
            are targets: each sees the whole history (the non-target prefix) and itself, never
            another target, and no history token sees a target.
        window: int or None; sliding window on effective positions ``p(i) = min(i, n_hist)``
            (targets all sit at the position after the history): ``i`` sees ``j`` only when
            ``|p(i) - p(j)| < window``, combined with ``causal``.
        pos_bias: ``[H, P]`` or ``[1, P]`` learnable table; adds ``pos_bias[h, min(|p(i) - p(j)|,
            P - 1)]``.
        time_bias: ``[H, T]`` or ``[1, T]`` learnable table; adds ``time_bias[h, bucket]`` with
            ``bucket = min(floor(ln(max(|qts_i - ts_j|, 1)) / 0.301), T - 1)``.
        timestamps: ``[L]`` int64 event times ``ts``; required with ``time_bias``.
        query_timestamps: ``[L]`` int64 or None: the time ``qts_i`` each query measures its
            distance to the keys from; None means ``timestamps``. HSTU's target-time bias passes
            the time of the event each position predicts (``ts[i + 1]``). Only with ``time_bias``.
        backend: ``"auto"`` (Triton on CUDA, the reference elsewhere), ``"pytorch"`` or
            ``"triton"``.

    Returns:
        ``[L, H, Dv]`` in v's dtype.

    Raises:
        ValueError: on shapes, dtypes, devices or offsets that do not fit together.
    """
    route = _ATTENTION_ROUTE.get()
    if route is not None:
        return route(
            q, k, v, offsets, max_len, activation=activation, causal=causal, alpha=alpha, num_targets=num_targets,
            window=window, pos_bias=pos_bias, time_bias=time_bias, timestamps=timestamps, backend=backend,
            # Routes written before query_timestamps existed keep working for every call that omits it.
            **({} if query_timestamps is None else {"query_timestamps": query_timestamps}),
        )
    _check_qkv(q, k, v, same_rows=True)
    _check_activation(activation)
    _check_offsets("offsets", offsets, q.shape[0], max_len, q.device)
    batch = offsets.numel() - 1
    heads = q.shape[1]
    if num_targets is not None:
        _check_num_targets(num_targets, offsets, batch, q.device)
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    if alpha is not None and not isinstance(alpha, (int, float)):
        raise ValueError(f"alpha must be a number or None, got {alpha!r}")
    _check_bias("pos_bias", pos_bias, heads, q)
    _check_bias("time_bias", time_bias, heads, q)
    if time_bias is not None:
        if timestamps is None:
            raise ValueError("timestamps [L] are required with time_bias")
        _check_timestamps("timestamps", timestamps, q)
    if query_timestamps is not None:
        if time_bias is None:
            raise ValueError("query_timestamps [L] only enter the time bias; pass time_bias with them")
        _check_timestamps("query_timestamps", query_timestamps, q)
    kwargs = dict(
        activation=activation,
        causal=causal,
        alpha=alpha,
        num_targets=num_targets,
        window=window,
        pos_bias=pos_bias,
        time_bias=time_bias,
        timestamps=timestamps,
        query_timestamps=query_timestamps,
    )
    if _resolve_backend(backend, q) == "triton":
        from kernels.triton.jagged_attention import jagged_attention as impl
    else:
        from kernels.pytorch.jagged_attention import jagged_attention as impl
    return impl(q, k, v, offsets, max_len, **kwargs)


def jagged_cross_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    max_q_len: int,
    max_kv_len: int,
    *,
    activation: str = "softmax",
    alpha: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """A few query tokens per sequence attend to all of that sequence's jagged keys, unmasked.

    Used for candidate items, PMA seeds and CLS tokens attending to a user history; serves
    both short-query/long-key and long-query/short-key shapes.

    Args:
        q: ``[Lq, H, Dqk]`` queries; sequence ``b`` owns rows ``q_offsets[b]:q_offsets[b + 1]``.
        k: ``[Lkv, H, Dqk]`` keys; sequence ``b`` owns rows ``kv_offsets[b]:kv_offsets[b + 1]``.
        v: ``[Lkv, H, Dv]`` values.
        q_offsets: ``[B + 1]`` int64.
        kv_offsets: ``[B + 1]`` int64 (same ``B``).
        max_q_len: int, at least the most queries of any sequence.
        max_kv_len: int, at least the most keys of any sequence; pointwise activations are
            divided by it.
        activation: as in :func:`jagged_attention`. A query whose sequence has no keys gets 0.
        alpha: scale on ``q . k``; default ``1 / sqrt(Dqk)``.
        backend: ``"auto"``, ``"pytorch"`` or ``"triton"``.

    Returns:
        ``[Lq, H, Dv]`` in v's dtype.

    Raises:
        ValueError: on shapes, dtypes, devices or offsets that do not fit together.
    """
    _check_qkv(q, k, v, same_rows=False)
    _check_activation(activation)
    b_q = _check_offsets("q_offsets", q_offsets, q.shape[0], max_q_len, q.device)
    b_kv = _check_offsets("kv_offsets", kv_offsets, k.shape[0], max_kv_len, q.device)
    if b_q != b_kv:
        raise ValueError(f"q_offsets has B={b_q} sequences but kv_offsets has B={b_kv}")
    if alpha is not None and not isinstance(alpha, (int, float)):
        raise ValueError(f"alpha must be a number or None, got {alpha!r}")
    if _resolve_backend(backend, q) == "triton":
        from kernels.triton.jagged_attention import jagged_cross_attention as impl
    else:
        from kernels.pytorch.jagged_attention import jagged_cross_attention as impl
    return impl(q, k, v, q_offsets, kv_offsets, max_q_len, max_kv_len, activation=activation, alpha=alpha)
