"""Jagged attention: the public dispatchers.

Model code reaches the kernels only through these functions. ``backend="auto"`` runs the Triton
kernels on CUDA tensors and the PyTorch reference elsewhere; ``"pytorch"`` and ``"triton"``
force one (the Triton one also runs on CPU tensors under ``TRITON_INTERPRET=1``, which is how
the tests check it without a GPU). Every backend takes the same :class:`~kernels.spec.AttentionSpec`
and returns the same function of it, with gradients for ``q``, ``k``, ``v``, ``pos_bias`` and
``time_bias``. Inputs are checked at every call as far as that costs no device sync
(:mod:`kernels.checks`; :func:`check_values` checks device values too).

The kernel switch ``backend`` (:mod:`kernels.settings`: ``model.kernels.backend`` in a run's config, or
the environment variable ``GEM_ATTENTION_BACKEND``), when ``pytorch`` or ``triton``, replaces
``backend="auto"`` at every call (an explicit backend is never overridden): it runs a whole model on one
backend without touching model code, e.g. to benchmark the reference against the kernels
(``experiments/bench_teacher.py --backend pytorch``). The glue kernels (fused LayerNorm, row modulation)
have their own dispatchers in :mod:`kernels.glue`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar

import torch

from kernels import settings
from kernels.checks import check_offsets, check_qkv, check_values
from kernels.glue import (
    SiluGate,
    catch_up_rows,
    draw_dropout_mask,
    jagged_silu_modulate,
    layer_norm,
    multi_adamw,
    multi_copy,
    residual_layer_norm,
    row_adamw,
    sigmoid_gate,
    silu_split,
    sum_rows,
    unbind_pair,
)
from kernels.pytorch.jagged_attention import ACTIVATIONS
from kernels.spec import AttentionSpec

__all__ = [
    "ACTIVATIONS",
    "AttentionSpec",
    "SiluGate",
    "catch_up_rows",
    "check_values",
    "draw_dropout_mask",
    "jagged_attention",
    "jagged_cross_attention",
    "jagged_silu_modulate",
    "layer_norm",
    "multi_adamw",
    "multi_copy",
    "residual_layer_norm",
    "route_jagged_attention",
    "row_adamw",
    "sigmoid_gate",
    "silu_split",
    "sum_rows",
    "unbind_pair",
]

# Context parallelism (foundation/parallel/context.py) computes the model's unchanged jagged_attention calls on
# one rank's tokens against every rank's keys; it takes them over through this route.
_ATTENTION_ROUTE: ContextVar[Callable[..., torch.Tensor] | None] = ContextVar("jagged_attention_route", default=None)

def _resolve_backend(backend: str, q: torch.Tensor) -> str:
    return settings.resolve_backend(backend, settings.backend(), q.is_cuda)


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


def jagged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    max_len: int,
    *,
    backend: str = "auto",
    **options,
) -> torch.Tensor:
    """Self-attention inside each sequence of a jagged batch (HSTU GDPA or softmax).

    Args:
        q: ``[L, H, Dqk]`` queries, the rows of all sequences one after another.
        k: ``[L, H, Dqk]`` keys.
        v: ``[L, H, Dv]`` values.
        offsets: ``[B + 1]`` int64; sequence ``b`` is rows ``offsets[b]:offsets[b + 1]``.
        max_len: ``N``, an int at least the longest sequence; by default the pointwise activations
            are divided by it.
        backend: ``"auto"`` (Triton on CUDA, the reference elsewhere), ``"pytorch"`` or ``"triton"``.
        **options: the fields of :class:`~kernels.spec.AttentionSpec` (``activation``, ``causal``,
            ``alpha``, ``num_targets``, ``window``, ``pos_bias``, ``time_bias``, ``timestamps``,
            ``query_timestamps``, ``divisor``), by name.

    Returns:
        ``[L, H, Dv]`` in v's dtype.

    Raises:
        ValueError: on shapes, dtypes, devices, offsets or options that do not fit together.
    """
    spec = AttentionSpec.from_options(options)
    route = _ATTENTION_ROUTE.get()
    if route is not None:
        return route(q, k, v, offsets, max_len, backend=backend, **spec.as_options())
    check_qkv(q, k, v, same_rows=True)
    check_offsets("offsets", offsets, q.shape[0], max_len, q.device)
    spec.check(q, offsets)
    if _resolve_backend(backend, q) == "triton":
        from kernels.triton.jagged_attention import jagged_attention as impl
    else:
        from kernels.pytorch.jagged_attention import jagged_attention as impl
    return impl(q, k, v, offsets, max_len, spec)


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
    check_qkv(q, k, v, same_rows=False)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    b_q = check_offsets("q_offsets", q_offsets, q.shape[0], max_q_len, q.device)
    b_kv = check_offsets("kv_offsets", kv_offsets, k.shape[0], max_kv_len, q.device)
    if b_q != b_kv:
        raise ValueError(f"q_offsets has B={b_q} sequences but kv_offsets has B={b_kv}")
    if alpha is not None and not isinstance(alpha, (int, float)):
        raise ValueError(f"alpha must be a number or None, got {alpha!r}")
    if _resolve_backend(backend, q) == "triton":
        from kernels.triton.jagged_attention import jagged_cross_attention as impl
    else:
        from kernels.pytorch.jagged_attention import jagged_cross_attention as impl
    return impl(q, k, v, q_offsets, kv_offsets, max_q_len, max_kv_len, activation=activation, alpha=alpha)
