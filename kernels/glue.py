"""Dispatchers for the glue around the attention kernels: a fused LayerNorm (alone or after a residual add), a
per-row SiLU modulation, a split SiLU and a sigmoid self-gate; and the split of a fused key-value projection
(:func:`unbind_pair`).
The optimizer's kernels are here too: the multi-tensor AdamW (:func:`multi_adamw`) and the embedding tables' lazy
row AdamW (:func:`row_adamw`) with its catch-up of missed steps (:func:`catch_up_rows`).

Like :mod:`kernels` for attention, ``backend="auto"`` runs the Triton kernels on CUDA tensors and the
PyTorch references elsewhere; ``"pytorch"`` and ``"triton"`` force one (the Triton one also runs on CPU
tensors under ``TRITON_INTERPRET=1``). The kernel switch ``glue_backend`` (:mod:`kernels.settings`,
environment override ``GEM_GLUE_BACKEND``), when not ``auto``, replaces ``backend="auto"`` at every call:
a whole model then runs on the references without touching model code, e.g. for a fused-against-unfused
loss comparison (``experiments/bench_teacher.py --glue-backend pytorch``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels import settings


def _resolve(backend: str, x: torch.Tensor) -> str:
    return settings.resolve_backend(backend, settings.glue_backend(), x.is_cuda)


class GateGrad:
    """The input gradient ``[L, N]`` of a projection whose first ``width`` columns a :class:`SiluGate` hands on
    un-activated: allocated by the first backward that asks for the gate's columns (the gated norm's, which runs
    first), then taken by :func:`silu_split`'s backward, which writes the other columns. The gate's gradient is so
    written once, where the projection's backward reads it, instead of into a tensor of its own and copied there."""

    def __init__(self, like: torch.Tensor, width: int) -> None:
        self.shape, self.dtype, self.device, self.width = like.shape, like.dtype, like.device, width
        self.buffer: torch.Tensor | None = None

    def gate_columns(self) -> torch.Tensor | None:
        """``[L, width]``: the buffer's gate columns, to write the gate's gradient into; None while the buffer is
        out (a second consumer of the gate writes a gradient of its own, which autograd adds to the first)."""
        if self.buffer is not None:
            return None
        self.buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return self.buffer[:, : self.width]

    def take(self) -> torch.Tensor | None:
        """The buffer, if a consumer asked for its gate columns; the reference is dropped."""
        buffer, self.buffer = self.buffer, None
        return buffer

    def holds(self, grad: torch.Tensor | None) -> bool:
        """Whether ``grad`` is the gate columns of ``buffer`` (as handed out, so already in place)."""
        return (
            grad is not None and self.buffer is not None and grad.data_ptr() == self.buffer.data_ptr()
            and grad.shape == (self.shape[0], self.width) and grad.stride() == self.buffer.stride()
        )


@dataclass(frozen=True)
class SiluGate:
    """A gate ``silu(pre + bias)`` not yet computed: the first part of :func:`silu_split` with ``gate_first``, for
    :func:`layer_norm` to activate as it reads it (no pass of the split writes the gate, no pass reads it back, and
    the norm's backward writes the pre-activation's gradient straight into the projection's, ``grad``).

    Attributes:
        pre: ``[L, W]`` the projection's gate columns (a view of it), before the bias.
        bias: ``[W]`` the projection's bias over those columns, or None.
        grad: where the Triton norm writes ``pre``'s gradient, or None (a gradient of its own).
    """

    pre: torch.Tensor
    bias: torch.Tensor | None = None
    grad: GateGrad | None = None

    def value(self) -> torch.Tensor:
        """The gate, ``silu(pre + bias)``, in float32 (the reference's; the Triton norm computes it as it reads)."""
        with torch.autocast(self.pre.device.type, enabled=False):
            pre = self.pre.float() if self.bias is None else self.pre.float() + self.bias.float()
            return torch.nn.functional.silu(pre)


def _check_dropout(mask: torch.Tensor | None, p: float, shape: torch.Size, device: torch.device) -> None:
    """A keep mask of the output's shape with ``0 < p < 1``, or no mask and ``p == 0``."""
    if mask is None:
        if p != 0.0:
            raise ValueError(f"dropout_p={p} needs a dropout_mask (draw it with kernels.draw_dropout_mask)")
        return
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape != shape:
        raise ValueError(f"dropout_mask must be bool of shape {tuple(shape)}, got {getattr(mask, 'dtype', mask)} "
                         f"{tuple(getattr(mask, 'shape', ()))}")
    if mask.device != device:
        raise ValueError(f"dropout_mask is on {mask.device} but the input is on {device}")
    if not 0.0 < p < 1.0:
        raise ValueError(f"dropout_p must be in (0, 1) with a dropout_mask, got {p}")


def draw_dropout_mask(shape: Sequence[int], p: float, device: torch.device) -> torch.Tensor:
    """``[*shape]`` bool keep mask, each element kept with probability ``1 - p`` (PyTorch's generator: CUDA-graph
    safe), for the glue ops' ``dropout_mask``."""
    return torch.empty(tuple(shape), dtype=torch.bool, device=device).bernoulli_(1.0 - p)


def _check_float(name: str, t: torch.Tensor, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
        raise ValueError(f"{name} must be a floating tensor, got {getattr(t, 'dtype', type(t))}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but x is on {device}")


def _check_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, out_dtype: torch.dtype | None) -> None:
    """A floating ``x[..., N]``, ``weight``/``bias`` ``[N]`` on its device, a floating ``out_dtype`` or None."""
    _check_float("x", x, x.device)
    n = x.shape[-1] if x.dim() else 0
    for name, p in (("weight", weight), ("bias", bias)):
        _check_float(name, p, x.device)
        if p.shape != (n,):
            raise ValueError(f"{name} must be [N]=[{n}], got {tuple(p.shape)}")
    if out_dtype is not None and not out_dtype.is_floating_point:
        raise ValueError(f"out_dtype must be a floating dtype, got {out_dtype}")


def _check_gate(gate: torch.Tensor | SiluGate, x: torch.Tensor) -> None:
    """A floating gate of x's shape on its device: a tensor, or a :class:`SiluGate`'s ``pre`` (with a ``bias``
    ``[N]`` or none)."""
    pre = gate.pre if isinstance(gate, SiluGate) else gate
    name = "gate.pre" if isinstance(gate, SiluGate) else "gate"
    _check_float(name, pre, x.device)
    if pre.shape != x.shape:
        raise ValueError(f"{name} must have x's shape {tuple(x.shape)}, got {tuple(pre.shape)}")
    if isinstance(gate, SiluGate) and gate.bias is not None:
        _check_float("gate.bias", gate.bias, x.device)
        if gate.bias.shape != x.shape[-1:]:
            raise ValueError(f"gate.bias must be [N]=[{x.shape[-1]}], got {tuple(gate.bias.shape)}")


def _norm_impl(name: str, backend: str, x: torch.Tensor):
    """The LayerNorm function ``name`` of the backend that runs ``x`` (the Triton one takes ``N <= MAX_N``)."""
    if _resolve(backend, x) == "triton":
        from kernels.triton import layer_norm as module

        n = x.shape[-1] if x.dim() else 0
        if n > module.MAX_N:
            raise ValueError(f"the Triton {name} takes N <= {module.MAX_N}, got {n}; use backend='pytorch'")
    else:
        from kernels.pytorch import layer_norm as module
    return getattr(module, name)


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    *,
    scale: float = 1.0,
    gate: torch.Tensor | SiluGate | None = None,
    out_dtype: torch.dtype | None = None,
    dropout_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
) -> torch.Tensor:
    """``dropout(LN(scale * x) * gate).to(out_dtype)`` over the last axis, computed in float32.

    ``out_dtype`` lets the caller hand the next GEMM its autocast dtype directly: the values are those
    that autocast's float32 LayerNorm followed by the GEMM's cast would give.

    Args:
        x: ``[..., N]``.
        weight, bias: ``[N]`` (an ``nn.LayerNorm``'s parameters).
        eps: the LayerNorm epsilon.
        scale: multiplies ``x`` before the normalisation (folded into the kernel's load).
        gate: ``[..., N]``, x's shape, multiplying the normalised output; or a :class:`SiluGate` whose ``pre`` has
            x's shape (activated in float32 as it is read); or None.
        out_dtype: the result's dtype; None: x's dtype promoted with gate's (``pre``'s).
        dropout_mask: ``[..., N]`` bool (x's shape): the elements kept, scaled by ``1 / (1 - dropout_p)``
            (:func:`draw_dropout_mask`); None: no dropout (``dropout_p`` 0).
        dropout_p: the dropout probability the mask was drawn with.
        backend: ``"auto"``, ``"pytorch"`` or ``"triton"``.

    Returns:
        x's shape in ``out_dtype``; differentiable in x, weight, bias and gate (a :class:`SiluGate`'s ``pre`` and
        ``bias``).
    """
    _check_norm(x, weight, bias, out_dtype)
    if gate is not None:
        _check_gate(gate, x)
    _check_dropout(dropout_mask, dropout_p, x.shape, x.device)
    impl = _norm_impl("layer_norm", backend, x)
    return impl(
        x, weight, bias, eps, scale=scale, gate=gate, out_dtype=out_dtype, dropout_mask=dropout_mask, dropout_p=dropout_p
    )


def residual_layer_norm(
    x: torch.Tensor,
    branch: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    *,
    branch_bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    picks: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, ...]:
    """``(x + branch, LN(x + branch).to(out_dtype))``: a block's output added to the residual stream, and the stream's
    norm for the next block, in one pass each way (the Triton backward also adds the stream's own gradient, so a
    stream normalised with no branch, ``branch=None``, saves that add).

    ``picks`` also returns some rows of the sum: their gradient is added into the norm's backward output where it
    lies, where a separate gather's backward would write a zero gradient of the whole stream, add the rows into it
    and accumulate it into the stream's.

    Args:
        x: ``[..., N]`` the residual stream (float32 under autocast).
        branch: ``[..., N]``, x's shape: the block's output (the autocast dtype); or None: the sum is ``x``.
        branch_bias: ``[N]`` the bias of the projection that made the branch, left out of its GEMM and added here, in
            the sum's dtype; its gradient (the column sums of the sum's gradient) comes out of the backward's own
            partial sums instead of a reduction over the branch's gradient. None: no bias; only with a branch.
        weight, bias: ``[N]`` (an ``nn.LayerNorm``'s parameters).
        eps: the LayerNorm epsilon.
        out_dtype: the norm's dtype; None: the sum's.
        picks: ``[P]`` int64 rows of the sum (over x's leading axes flattened), each in ``[0, M)`` (not checked on
            the device: that would sync), repeats allowed; or None.
        backend: ``"auto"``, ``"pytorch"`` or ``"triton"``.

    Returns:
        ``(sum, norm)``: the sum in x's dtype promoted with the branch's, the norm in ``out_dtype``; differentiable in
        x, branch, branch_bias, weight and bias. With ``picks``, ``(sum, norm, picked[P, N])`` (the sum's dtype).
    """
    _check_norm(x, weight, bias, out_dtype)
    if x.dim() == 0:
        raise ValueError("x must have a feature axis, got a scalar")
    if branch is not None:
        _check_float("branch", branch, x.device)
        if branch.shape != x.shape:
            raise ValueError(f"branch must have x's shape {tuple(x.shape)}, got {tuple(branch.shape)}")
    if branch_bias is not None:
        if branch is None:
            raise ValueError("branch_bias needs a branch")
        _check_float("branch_bias", branch_bias, x.device)
        if branch_bias.shape != x.shape[-1:]:
            raise ValueError(f"branch_bias must be [{x.shape[-1]}], got {tuple(branch_bias.shape)}")
    if picks is not None:
        if not isinstance(picks, torch.Tensor) or picks.dim() != 1 or picks.dtype != torch.int64:
            raise ValueError(f"picks must be int64 [P], got {getattr(picks, 'dtype', type(picks))} "
                             f"{tuple(getattr(picks, 'shape', ()))}")
        if picks.device != x.device:
            raise ValueError(f"picks is on {picks.device} but x is on {x.device}")
    impl = _norm_impl("residual_layer_norm", backend, x)
    return impl(x, branch, weight, bias, eps, branch_bias=branch_bias, out_dtype=out_dtype, picks=picks)


def jagged_silu_modulate(
    h: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    rows: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    scale_offset: float = 0.0,
    dropout_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
) -> torch.Tensor:
    """``dropout(silu(h + bias) * (scale_offset + scale[rows]) + shift[rows])``: every token modulated by its row's
    vectors (InterFormer's PFFN).

    The Triton backend is one pass forward and one backward, whose per-row sums of ``scale`` and ``shift``
    gradients run over each row's contiguous tokens (no atomics, no sort) where autograd's would
    scatter-add every token into its row. A projection's bias passed here instead of to its GEMM gets its
    gradient from per-row sums beside those (one ``[B, N]`` reduction instead of one over ``[L, N]``), and
    ``scale_offset`` costs no pass of its own.

    Args:
        h: ``[L, N]`` pre-activations.
        scale, shift: ``[B, N]``.
        bias: ``[N]`` added to ``h`` before the SiLU (float32 inside the Triton kernels; in h's dtype in the
            reference), or None.
        scale_offset: a constant added to ``scale`` (float32 inside the Triton kernels; in scale's dtype in the
            reference).
        rows: ``[L]`` int64, the row of every token, **sorted** (tokens of a row are contiguous, rows in
            order: what :func:`foundation.model.jagged.token_rows` and a context-parallel shard give);
            values in ``[0, B)``. Not checked on the device (that would sync).
        dropout_mask: ``[L, N]`` bool, the elements kept, scaled by ``1 / (1 - dropout_p)``
            (:func:`draw_dropout_mask`); None: no dropout (``dropout_p`` 0).
        dropout_p: the dropout probability the mask was drawn with.
        backend: ``"auto"``, ``"pytorch"`` or ``"triton"``.

    Returns:
        ``[L, N]`` in the promoted dtype of ``h``, ``scale`` and ``shift``.
    """
    _check_float("h", h, h.device)
    if h.dim() != 2:
        raise ValueError(f"h must be [L, N], got {tuple(h.shape)}")
    for name, t in (("scale", scale), ("shift", shift)):
        _check_float(name, t, h.device)
        if t.dim() != 2 or t.shape != scale.shape or t.shape[1] != h.shape[1]:
            raise ValueError(f"{name} must be [B, N] with h's N={h.shape[1]}, got {tuple(t.shape)}")
    if not isinstance(rows, torch.Tensor) or rows.shape != (h.shape[0],) or rows.dtype != torch.int64:
        raise ValueError(f"rows must be int64 [L]=[{h.shape[0]}], got {getattr(rows, 'shape', rows)}")
    if rows.device != h.device:
        raise ValueError(f"rows is on {rows.device} but h is on {h.device}")
    _check_dropout(dropout_mask, dropout_p, h.shape, h.device)
    if bias is not None:
        _check_float("bias", bias, h.device)
        if bias.shape != (h.shape[1],):
            raise ValueError(f"bias must be [N]=[{h.shape[1]}], got {tuple(bias.shape)}")
    if _resolve(backend, h) == "triton":
        from kernels.triton.row_modulate import jagged_silu_modulate as impl
    else:
        from kernels.pytorch.row_modulate import jagged_silu_modulate as impl
    return impl(
        h, scale, shift, rows, bias=bias, scale_offset=scale_offset, dropout_mask=dropout_mask, dropout_p=dropout_p
    )


def silu_split(
    h: torch.Tensor, widths: Sequence[int], *, bias: torch.Tensor | None = None, gate_first: bool = False,
    backend: str = "auto",
) -> tuple[torch.Tensor | SiluGate, ...]:
    """``silu(h + bias)`` split along the last axis into parts of ``widths`` (the HSTU block's ``u, v, q, k``).

    The Triton backward reads each part's gradient where its consumer left it and writes ``dh`` once, where
    autograd's first concatenates the parts' gradients into a new ``[L, N]`` tensor. A projection's bias passed
    here instead of to its GEMM gets its gradient from small per-tile sums the backward writes beside ``dh``
    instead of a reduction over the whole ``[L, N]`` gradient.

    Args:
        h: ``[L, N]`` pre-activations (the projection's output).
        widths: positive part widths summing to ``N``.
        bias: ``[N]`` added before the SiLU (float32 inside the Triton kernels; in h's dtype in the reference),
            or None.
        gate_first: the first part is a gate for a gated :func:`layer_norm` (the HSTU block's ``u``): returned as a
            :class:`SiluGate` of ``h``'s columns and the bias's, activated by the norm as it reads them, instead of
            computed and written here.
        backend: ``"auto"``, ``"pytorch"`` or ``"triton"``.

    Returns:
        ``len(widths)`` tensors ``[L, w_i]`` in h's dtype (column views of one ``[L, N]`` result); with
        ``gate_first`` the first is a :class:`SiluGate`.
    """
    _check_float("h", h, h.device)
    if h.dim() != 2:
        raise ValueError(f"h must be [L, N], got {tuple(h.shape)}")
    widths = tuple(widths)
    if not widths or any(not isinstance(w, int) or isinstance(w, bool) or w <= 0 for w in widths):
        raise ValueError(f"widths must be positive ints, got {widths}")
    if sum(widths) != h.shape[1]:
        raise ValueError(f"widths {widths} sum to {sum(widths)}, not h's N={h.shape[1]}")
    if bias is not None:
        _check_float("bias", bias, h.device)
        if bias.shape != (h.shape[1],):
            raise ValueError(f"bias must be [N]=[{h.shape[1]}], got {tuple(bias.shape)}")
    if _resolve(backend, h) == "triton":
        from kernels.triton.silu_split import silu_split as impl
    else:
        from kernels.pytorch.silu_split import silu_split as impl
    return impl(h, widths, bias, gate_first=gate_first)


def sigmoid_gate(x: torch.Tensor, g: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """``x * sigmoid(g)``: a self-gate (the InterFormer summary's), one fused pass forward and one backward on the
    Triton path (the sigmoid in float32) where eager PyTorch runs two and three.

    Args:
        x: the gated values, any shape.
        g: the gate's pre-activations, ``x``'s shape.
        backend: ``"auto"``, ``"pytorch"`` or ``"triton"``.

    Returns:
        ``x``'s shape, in the promoted dtype of ``x`` and ``g``.
    """
    _check_float("x", x, x.device)
    _check_float("g", g, x.device)
    if g.shape != x.shape:
        raise ValueError(f"sigmoid_gate: g {tuple(g.shape)} must have x's shape {tuple(x.shape)}")
    if _resolve(backend, x) == "triton":
        from kernels.triton.sigmoid_gate import sigmoid_gate as impl
    else:
        from kernels.pytorch.silu_split import sigmoid_gate as impl
    return impl(x, g)


def _dense_strides(size: Sequence[int]) -> tuple[int, ...]:
    """Strides of a contiguous tensor of ``size``."""
    strides, step = [], 1
    for extent in reversed(size):
        strides.append(step)
        step *= max(extent, 1)
    return tuple(reversed(strides))


def pair_halves(first: torch.Tensor, second: torch.Tensor) -> bool:
    """Whether ``first`` and ``second`` are ``pair[:, 0]`` and ``pair[:, 1]`` of one contiguous ``[L, 2, ...]``."""
    pair = _dense_strides((first.shape[0], 2, *first.shape[1:]))
    return (
        first.numel() > 0 and first.shape == second.shape and first.dtype == second.dtype
        and first.device == second.device and first.stride() == second.stride() == (pair[0], *pair[2:])
        and first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
        and second.storage_offset() - first.storage_offset() == pair[1]
    )


class _UnbindPair(torch.autograd.Function):
    @staticmethod
    def forward(ctx, pair: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)
        return pair[:, 0], pair[:, 1]

    @staticmethod
    def backward(ctx, first: torch.Tensor | None, second: torch.Tensor | None) -> torch.Tensor | None:
        if first is None and second is None:
            return None
        first = torch.zeros_like(second) if first is None else first
        second = torch.zeros_like(first) if second is None else second
        if pair_halves(first, second):
            size = (first.shape[0], 2, *first.shape[1:])
            return first.as_strided(size, _dense_strides(size), first.storage_offset())
        return torch.stack([first, second], 1)


def unbind_pair(pair: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``pair[L, 2, ...] -> (pair[:, 0], pair[:, 1])``, views, as ``pair.unbind(1)``: e.g. keys and values from one
    fused projection.

    ``unbind``'s backward stacks the two gradients into a new ``[L, 2, ...]`` tensor, a read and a write of both.
    The attention kernels' backward returns dK and dV for such keys and values as the two halves of one fresh
    ``[L, 2, H, D]`` tensor (:mod:`kernels.triton.jagged_attention`); where the gradients are laid out so, that
    tensor is handed on as the gradient of ``pair``, and only other gradients are stacked.
    """
    if pair.dim() < 2 or pair.shape[1] != 2:
        raise ValueError(f"unbind_pair needs a [L, 2, ...] tensor, got {tuple(pair.shape)}")
    return _UnbindPair.apply(pair)


def multi_copy(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], *, backend: str = "auto") -> None:
    """``dsts[i].copy_(srcs[i])`` for every ``i`` in one launch (Triton) where ``torch._foreach_copy_`` launches one
    kernel per tensor whose dtypes differ: float32 parameters into their bf16 copies, bf16 gradients into float32.

    Args:
        dsts: tensors written, each of its source's shape, all on one device.
        srcs: tensors read (any dtype; a 2-D source may be laid out otherwise than its destination, e.g. transposed).
        backend: ``"auto"``, ``"pytorch"`` or ``"triton"`` (chosen by the first destination).
    """
    if len(dsts) != len(srcs):
        raise ValueError(f"multi_copy needs as many sources as destinations, got {len(srcs)} and {len(dsts)}")
    if not dsts:
        return
    device = dsts[0].device
    for i, (d, s) in enumerate(zip(dsts, srcs, strict=True)):
        if d.shape != s.shape:
            raise ValueError(f"multi_copy pair {i}: destination {tuple(d.shape)} and source {tuple(s.shape)} differ")
        if d.device != device or s.device != device:
            raise ValueError(f"multi_copy pair {i}: tensors on {d.device} and {s.device}, expected {device}")
    if _resolve(backend, dsts[0]) == "triton":
        from kernels.triton.multi_copy import multi_copy as impl
    else:
        from kernels.pytorch.multi_copy import multi_copy as impl
    impl(list(dsts), list(srcs))


def multi_adamw(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    step: int,
    copies: Sequence[torch.Tensor | None] | None = None,
    backend: str = "auto",
) -> None:
    """One AdamW step (``torch.optim.AdamW``'s update) of many float32 tensors in one launch per gradient dtype
    (Triton), gradients read in their own dtype and layout, the updated parameters optionally written into
    low-precision copies in the same pass.

    Args:
        params: ``T`` float32 parameters, updated in place, all on one device.
        grads: their gradients (each of its parameter's shape; float32 or bf16, e.g. the gradients of bf16 copies).
        exp_avgs, exp_avg_sqs: the float32 first and second moments, contiguous, updated in place.
        lr, betas, eps, weight_decay: AdamW's; ``step``: this step's count, from 1 (bias corrections).
        copies: per parameter a tensor of its shape that receives the updated value (rounded to its dtype), or
            None; None for all when omitted.
        backend: ``"auto"``, ``"pytorch"`` or ``"triton"`` (chosen by the first parameter).
    """
    copies = list(copies) if copies is not None else [None] * len(params)
    lists = {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs, "copies": copies}
    for name, values in lists.items():
        if len(values) != len(params):
            raise ValueError(f"multi_adamw: {len(params)} params but {len(values)} {name}")
    if step < 1:
        raise ValueError(f"multi_adamw: step counts from 1, got {step}")
    if not params:
        return
    device = params[0].device
    for i, (p, g, m, v, c) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, copies, strict=True)):
        for name, t in (("param", p), ("exp_avg", m), ("exp_avg_sq", v)):
            if t.dtype != torch.float32:
                raise ValueError(f"multi_adamw tensor {i}: {name} is {t.dtype}, expected torch.float32")
        for name, t in (("grad", g), ("exp_avg", m), ("exp_avg_sq", v), ("copy", c)):
            if t is not None and t.shape != p.shape:
                raise ValueError(f"multi_adamw tensor {i}: {name} {tuple(t.shape)} and param {tuple(p.shape)} differ")
        if any(t is not None and t.device != device for t in (p, g, m, v, c)):
            raise ValueError(f"multi_adamw tensor {i}: not every tensor is on {device}")
    if _resolve(backend, params[0]) == "triton":
        from kernels.triton.adamw import multi_adamw as impl
    else:
        from kernels.pytorch.adamw import multi_adamw as impl
    impl(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), copies, lr=lr, betas=betas, eps=eps,
         weight_decay=weight_decay, step=step)


def row_adamw(
    param: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    rows: torch.Tensor,
    grad_rows: torch.Tensor,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    step: int,
    backend: str = "auto",
) -> None:
    """One lazy AdamW step of an embedding table on the rows a step looked up: what an embedding's sparse gradient
    (``nn.Embedding(sparse=True)``: its ``_indices()[0]`` and ``_values()``) asks for, with no dense gradient and
    no pass over the untouched rows.

    Args:
        param: ``[R, D]`` float32 table, updated in place on the named rows only.
        exp_avg, exp_avg_sq: ``[R, D]`` float32 moments, contiguous, updated on the same rows.
        rows: ``[N]`` int64 row ids, repeats allowed (each distinct row steps once, on the sum of its entries).
        grad_rows: ``[N, D]`` the entries' gradients (float32 or bf16).
        lr, betas, eps, weight_decay, step: as :func:`multi_adamw` (decay applies to the named rows only).
        backend: ``"auto"``, ``"pytorch"`` or ``"triton"``.
    """
    if param.dim() != 2 or param.dtype != torch.float32 or not param.is_contiguous():
        raise ValueError(f"row_adamw: param must be a contiguous float32 [R, D] table, got {param.dtype} {tuple(param.shape)}")
    for name, t in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.shape != param.shape or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"row_adamw: {name} must be contiguous float32 {tuple(param.shape)}, got {t.dtype} {tuple(t.shape)}")
    if rows.dim() != 1 or rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"row_adamw: rows must be 1-D integer ids, got {rows.dtype} {tuple(rows.shape)}")
    if grad_rows.shape != (rows.numel(), param.shape[1]):
        raise ValueError(f"row_adamw: grad_rows {tuple(grad_rows.shape)}, expected {(rows.numel(), param.shape[1])}")
    if step < 1:
        raise ValueError(f"row_adamw: step counts from 1, got {step}")
    if any(t.device != param.device for t in (exp_avg, exp_avg_sq, rows, grad_rows)):
        raise ValueError(f"row_adamw: not every tensor is on {param.device}")
    if _resolve(backend, param) == "triton":
        from kernels.triton.adamw import row_adamw as impl
    else:
        from kernels.pytorch.adamw import row_adamw as impl
    impl(param, exp_avg, exp_avg_sq, rows.to(torch.int64), grad_rows.contiguous(), lr=lr, betas=betas, eps=eps,
         weight_decay=weight_decay, step=step)


def catch_up_rows(
    param: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    last_step: torch.Tensor,
    rows: torch.Tensor,
    clock: torch.Tensor,
    schedule: torch.Tensor,
    log_decay: torch.Tensor,
    *,
    betas: tuple[float, float],
    eps: float,
    window: int,
    backend: str = "auto",
) -> None:
    """The zero-gradient AdamW steps that a lazily stepped table's rows missed, applied when a step looks them up,
    so that the rows, read and stepped only when named, follow dense AdamW (:class:`foundation.model.deferred_rows.
    DeferredRows`). No device sync on the Triton path: it can run inside a captured CUDA graph.

    Args:
        param, exp_avg, exp_avg_sq: ``[R, D]`` contiguous float32 table and moments, updated in place.
        last_step: ``[R]`` int32, each row's step count so far; set to ``clock[0]`` on the rows caught up.
        rows: ``[N]`` int64 row ids, repeats allowed.
        clock: ``[2]`` int32 on the device: the steps so far, and the step the schedule's entry 0 stands for.
        schedule: ``[S, 3]`` float32: per step ``u`` (at ``u - clock[1]``) ``lr / (1 - beta1^u)``,
            ``sqrt(1 - beta2^u)`` and ``1 - lr * weight_decay``.
        log_decay: ``[S]`` float64: the running sum of ``log(1 - lr * weight_decay)`` from ``clock[1]``.
        betas, eps: AdamW's. window: the missed steps applied one by one (the later ones only decay).
        backend: ``"auto"``, ``"pytorch"`` or ``"triton"``.
    """
    if param.dim() != 2 or param.dtype != torch.float32 or not param.is_contiguous():
        raise ValueError(f"catch_up_rows: param must be a contiguous float32 [R, D] table, got {param.dtype} {tuple(param.shape)}")
    for name, t in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.shape != param.shape or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"catch_up_rows: {name} must be contiguous float32 {tuple(param.shape)}, got {t.dtype} {tuple(t.shape)}")
    expected = {"last_step": (last_step, torch.int32, (param.shape[0],)), "clock": (clock, torch.int32, (2,)),
                "schedule": (schedule, torch.float32, (schedule.shape[0], 3)),
                "log_decay": (log_decay, torch.float64, (schedule.shape[0],))}
    for name, (t, dtype, shape) in expected.items():
        if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"catch_up_rows: {name} must be contiguous {dtype} {shape}, got {t.dtype} {tuple(t.shape)}")
    if rows.dim() != 1 or rows.dtype != torch.int64:
        raise ValueError(f"catch_up_rows: rows must be 1-D int64 ids, got {rows.dtype} {tuple(rows.shape)}")
    if window < 1:
        raise ValueError(f"catch_up_rows: window must be at least 1, got {window}")
    if any(t.device != param.device for t in (exp_avg, exp_avg_sq, last_step, rows, clock, schedule, log_decay)):
        raise ValueError(f"catch_up_rows: not every tensor is on {param.device}")
    if _resolve(backend, param) == "triton":
        from kernels.triton.adamw import catch_up_rows as impl
    else:
        from kernels.pytorch.adamw import catch_up_rows as impl
    impl(param, exp_avg, exp_avg_sq, last_step, rows, clock, schedule, log_decay, betas=betas, eps=eps, window=window)


def sum_rows(rows: torch.Tensor, values: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """The entries of a sparse row gradient summed per distinct row, as its dense gradient would hold them (e.g. for
    a gradient norm), without a device sync.

    Args:
        rows: ``[N]`` int64 or int32 row ids, repeats allowed.
        values: ``[N, D]`` the entries (float32 or bf16).
        backend: ``"auto"``, ``"pytorch"`` or ``"triton"``.

    Returns:
        ``[N, D]`` float32: row ``j`` holds the sum of the entries naming the ``j``-th smallest distinct row; the
        rows after the last distinct one are zeros.
    """
    if rows.dim() != 1 or rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"sum_rows: rows must be 1-D integer ids, got {rows.dtype} {tuple(rows.shape)}")
    if values.dim() != 2 or values.shape[0] != rows.numel():
        raise ValueError(f"sum_rows: values {tuple(values.shape)}, expected [{rows.numel()}, D]")
    if rows.device != values.device:
        raise ValueError(f"sum_rows: rows on {rows.device}, values on {values.device}")
    if _resolve(backend, values) == "triton":
        from kernels.triton.adamw import sum_rows as impl
    else:
        from kernels.pytorch.adamw import sum_rows as impl
    return impl(rows.to(torch.int64), values.contiguous())
