"""The HSTU block's gate ``u`` left un-activated by the SiLU split and activated by the gated norm that reads it
(:class:`kernels.SiluGate`): Triton (interpreted on CPU) against the PyTorch references and against the gate
computed and passed as a tensor, forward and every gradient (the projection's, its bias's, the norm's input and
parameters'), and the gate's gradient written in place into the projection's."""

from __future__ import annotations

import pytest
import torch

from kernels import SiluGate, draw_dropout_mask, layer_norm, silu_split
from kernels.glue import GateGrad

WIDTHS = [24, 24, 16, 16]


def _tol(dtype: torch.dtype) -> dict:
    return {
        torch.float32: {"rtol": 1e-5, "atol": 1e-5},
        torch.float16: {"rtol": 4e-3, "atol": 4e-3},
        torch.bfloat16: {"rtol": 3e-2, "atol": 3e-2},
    }[dtype]


def _block(tokens: int, dtype: torch.dtype, *, with_bias: bool, dropout: bool, seed: int):
    """The inputs of ``LN(attn) * silu(h_u + b_u)`` plus the other parts' losses: leaves and upstream gradients."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, sum(WIDTHS), generator=g).to(dtype).requires_grad_(True)
    bias = (torch.randn(sum(WIDTHS), generator=g) * 0.5).requires_grad_(True) if with_bias else None
    attn = torch.randn(tokens, WIDTHS[0], generator=g).to(dtype).requires_grad_(True)
    weight = (1 + 0.3 * torch.randn(WIDTHS[0], generator=g)).requires_grad_(True)
    norm_bias = (0.3 * torch.randn(WIDTHS[0], generator=g)).requires_grad_(True)
    upstream = [torch.randn(tokens, w, generator=g) for w in WIDTHS]
    torch.manual_seed(seed)
    mask = draw_dropout_mask((tokens, WIDTHS[0]), 0.25, torch.device("cpu")) if dropout else None
    return h, bias, attn, weight, norm_bias, upstream, mask


def _run(inputs, *, split_backend: str, norm_backend: str, gate_first: bool = True):
    """Output and gradients of the gated norm plus the other parts' losses."""
    h, bias, attn, weight, norm_bias, upstream, mask = inputs
    leaves = [t for t in (h, bias, attn, weight, norm_bias) if t is not None]
    for t in leaves:
        t.grad = None
    parts = silu_split(h, WIDTHS, bias=bias, gate_first=gate_first, backend=split_backend)
    gate = parts[0]
    y = layer_norm(attn, weight, norm_bias, 1e-5, scale=0.5, gate=gate, out_dtype=h.dtype,
                   dropout_mask=mask, dropout_p=0.25 if mask is not None else 0.0, backend=norm_backend)
    loss = (y.float() * upstream[0]).sum() + sum((p.float() * u).sum() for p, u in zip(parts[1:], upstream[1:],
                                                                                       strict=True))
    loss.backward()
    return y.detach(), [t.grad.clone() for t in leaves]


@pytest.mark.parametrize(
    ("tokens", "dtype", "with_bias", "dropout"),
    [
        (37, torch.float32, True, False),
        (37, torch.float32, False, True),
        (1, torch.float32, True, True),
        (0, torch.float32, True, False),
        (23, torch.float16, True, False),
        (19, torch.bfloat16, True, True),
    ],
)
def test_triton_gate_matches_the_reference_and_the_gate_as_a_tensor(tokens, dtype, with_bias, dropout):
    inputs = _block(tokens, dtype, with_bias=with_bias, dropout=dropout, seed=tokens + 3 * with_bias)
    ref_y, ref_grads = _run(inputs, split_backend="pytorch", norm_backend="pytorch")
    y, grads = _run(inputs, split_backend="triton", norm_backend="triton")
    torch.testing.assert_close(y, ref_y, **_tol(dtype))
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, **_tol(dtype))
    if dtype == torch.float32:  # the same function as the gate computed by the split and passed as a tensor
        _, eager_grads = _run(inputs, split_backend="pytorch", norm_backend="pytorch", gate_first=False)
        for a, b in zip(grads, eager_grads, strict=True):
            torch.testing.assert_close(a, b, **_tol(dtype))


@pytest.mark.parametrize(("tokens", "programs", "rows", "stages"), [(37, 4, 2, 2), (70, 16, 4, 3), (2, 4, 4, 2)])
def test_row_tiles_of_the_norm_backward_match_the_reference(monkeypatch, tokens, programs, rows, stages):
    """The norm's backward on ``[rows, N]`` tiles (a power of 2), pipelined (``BWD_ROWS``, ``BWD_STAGES``; the interpreter runs the
    loop unpipelined): rows not a multiple of the tile (a short last tile, a program with fewer rows than one tile),
    every gradient against the reference."""
    from kernels.triton import layer_norm as triton_ln

    monkeypatch.setattr(triton_ln, "_num_programs", lambda m, device: programs)
    monkeypatch.setattr(triton_ln, "BWD_ROWS", rows)
    monkeypatch.setattr(triton_ln, "BWD_STAGES", stages)
    inputs = _block(tokens, torch.float32, with_bias=True, dropout=True, seed=tokens)
    ref_y, ref_grads = _run(inputs, split_backend="pytorch", norm_backend="pytorch")
    y, grads = _run(inputs, split_backend="triton", norm_backend="triton")
    torch.testing.assert_close(y, ref_y, **_tol(torch.float32))
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, **_tol(torch.float32))


@pytest.mark.parametrize(("split_backend", "norm_backend"), [("triton", "pytorch"), ("pytorch", "triton")])
def test_mixed_backends_agree(split_backend, norm_backend):
    """A gate whose gradient is not written in place (another consumer) is copied into the projection's."""
    inputs = _block(29, torch.float32, with_bias=True, dropout=False, seed=5)
    ref_y, ref_grads = _run(inputs, split_backend="pytorch", norm_backend="pytorch")
    y, grads = _run(inputs, split_backend=split_backend, norm_backend=norm_backend)
    torch.testing.assert_close(y, ref_y, **_tol(torch.float32))
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, **_tol(torch.float32))


def test_gate_gradient_is_written_in_place(monkeypatch):
    """The norm writes the gate's gradient into the buffer the split's backward hands on as ``dh``: the projection's
    gradient is that buffer, whose gate columns no pass copied."""
    taken = []
    original = GateGrad.take

    def spy(self):
        buffer = original(self)
        taken.append(buffer)
        return buffer

    monkeypatch.setattr(GateGrad, "take", spy)
    copies = []
    original_copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda t, *a, **k: copies.append(t.shape) or original_copy(t, *a, **k))
    inputs = _block(21, torch.float32, with_bias=True, dropout=False, seed=9)
    _run(inputs, split_backend="triton", norm_backend="triton")
    assert len(taken) == 1 and taken[0] is not None
    assert inputs[0].grad is not None and copies == []
    monkeypatch.setattr(torch.Tensor, "copy_", original_copy)
    _, grads = _run(inputs, split_backend="triton", norm_backend="triton")
    ref_grads = _run(inputs, split_backend="pytorch", norm_backend="pytorch")[1]
    torch.testing.assert_close(grads[0], ref_grads[0], **_tol(torch.float32))


def test_unused_gate_gets_zero_gradient():
    g = torch.Generator().manual_seed(2)
    h = torch.randn(11, sum(WIDTHS), generator=g).requires_grad_(True)
    bias = torch.randn(sum(WIDTHS), generator=g).requires_grad_(True)
    for backend in ("pytorch", "triton"):
        h.grad = bias.grad = None
        gate, v, q, k = silu_split(h, WIDTHS, bias=bias, gate_first=True, backend=backend)
        assert isinstance(gate, SiluGate) and gate.pre.shape == (11, WIDTHS[0])
        (v.sum() + q.sum() + k.sum()).backward()
        assert (h.grad[:, : WIDTHS[0]] == 0).all() and (bias.grad[: WIDTHS[0]] == 0).all()
        assert (h.grad[:, WIDTHS[0]:] != 0).any()


def test_gate_value_is_silu_of_pre_plus_bias():
    pre, bias = torch.randn(4, 6), torch.randn(6)
    torch.testing.assert_close(SiluGate(pre, bias).value(), torch.nn.functional.silu(pre + bias))
    assert SiluGate(pre.to(torch.bfloat16)).value().dtype == torch.float32


def test_layer_norm_rejects_a_bad_gate():
    x = torch.randn(3, 6)
    w, b = torch.ones(6), torch.zeros(6)
    with pytest.raises(ValueError, match=r"gate\.pre must have x's shape"):
        layer_norm(x, w, b, 1e-5, gate=SiluGate(torch.randn(3, 5)))
    with pytest.raises(ValueError, match=r"gate\.bias must be \[N\]=\[6\]"):
        layer_norm(x, w, b, 1e-5, gate=SiluGate(torch.randn(3, 6), torch.zeros(5)))
    with pytest.raises(ValueError, match=r"gate\.pre must be a floating tensor"):
        layer_norm(x, w, b, 1e-5, gate=SiluGate(torch.ones(3, 6, dtype=torch.long)))
