"""The fused glue of the HSTU block and the residual stream: Triton (interpreted on CPU) against the PyTorch
references, forward and every gradient, on random shapes incl. no, one and non-power-of-two tokens and widths.

The references are first checked against plain eager PyTorch, so a shared misunderstanding cannot pass both.
"""

from __future__ import annotations

import pytest
import torch

from kernels import (
    draw_dropout_mask,
    jagged_silu_modulate,
    layer_norm,
    residual_layer_norm,
    sigmoid_gate,
    silu_split,
)
from kernels.triton import silu_split as silu_split_module


def _leaf(g: torch.Generator, *shape: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(dtype).requires_grad_(True)


def _tol(dtype: torch.dtype) -> dict:
    """float32: the same formula in both; float16/bfloat16: one rounding of the same float32 value (an ulp apart)."""
    return {
        torch.float32: {"rtol": 1e-5, "atol": 1e-6},
        torch.float16: {"rtol": 2e-3, "atol": 2e-3},
        torch.bfloat16: {"rtol": 1.6e-2, "atol": 1.6e-2},
    }[dtype]


def test_silu_split_reference_is_silu_then_split():
    h = torch.randn(5, 10)
    parts = silu_split(h, [3, 3, 2, 2], backend="pytorch")
    expected = torch.nn.functional.silu(h)
    assert [p.shape for p in parts] == [(5, 3), (5, 3), (5, 2), (5, 2)]
    torch.testing.assert_close(torch.cat(parts, -1), expected)


@pytest.mark.parametrize(
    "tokens,widths,dtype",
    [
        (37, [24, 24, 16, 16], torch.float32),  # the HSTU split, several row tiles
        (1, [5, 5, 3, 3], torch.float32),  # one token, odd widths
        (0, [8, 8, 4, 4], torch.float32),  # no tokens
        (19, [300, 7], torch.float16),  # a part wider than a column tile, one narrower
        (16, [1], torch.float16),  # one column
        (23, [40, 40, 24, 24], torch.bfloat16),  # the block's dtype under autocast on the GPU
    ],
)
def test_silu_split_triton_matches_reference(tokens, widths, dtype):
    g = torch.Generator().manual_seed(tokens + sum(widths))
    h = _leaf(g, tokens, sum(widths), dtype=dtype)
    upstream = [torch.randn(tokens, w, generator=g).to(dtype) for w in widths]
    results = {}
    for backend in ("pytorch", "triton"):
        h.grad = None
        parts = silu_split(h, widths, backend=backend)
        # Every part's gradient, one of them through a non-contiguous view (as the attention's [L, H, D] ones are).
        loss = sum((p * u).sum() for p, u in zip(parts[1:], upstream[1:], strict=True))
        loss = loss + (parts[0].t() * upstream[0].t()).sum() if tokens else loss + parts[0].sum() * 0
        loss.backward()
        results[backend] = (parts, h.grad.clone())
    (ref, ref_dh), (out, dh) = results["pytorch"], results["triton"]
    for a, b in zip(out, ref, strict=True):
        assert a.dtype == b.dtype == dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, **_tol(dtype))
    assert dh.dtype == dtype
    torch.testing.assert_close(dh, ref_dh, **_tol(dtype))


def test_silu_split_part_without_gradient_gets_zeros(monkeypatch):
    """Only some parts used: the others' columns of dh are zero (the kernel's zero-fill, not stale memory)."""
    monkeypatch.setattr(silu_split_module, "BLOCK_M", 4)  # several row tiles
    g = torch.Generator().manual_seed(5)
    h = _leaf(g, 11, 20)
    _, v, _ = silu_split(h, [6, 9, 5], backend="triton")
    (v * 3).sum().backward()
    expected = torch.zeros(11, 20)
    with torch.enable_grad():
        hv = h.detach()[:, 6:15].requires_grad_(True)
        (torch.nn.functional.silu(hv) * 3).sum().backward()
    expected[:, 6:15] = hv.grad
    torch.testing.assert_close(h.grad, expected)


def test_silu_split_reference_adds_the_bias_as_a_gemm_epilogue_does():
    h, bias = torch.randn(5, 10), torch.randn(10)
    parts = silu_split(h, [6, 4], bias=bias, backend="pytorch")
    torch.testing.assert_close(torch.cat(parts, -1), torch.nn.functional.silu(torch.addmm(bias, h, torch.eye(10))))


@pytest.mark.parametrize(
    "tokens,widths,dtype",
    [
        (37, [24, 24, 16, 16], torch.float32),  # several row tiles
        (0, [8, 8, 4, 4], torch.float32),  # no tokens: a zero bias gradient
        (23, [300, 40, 24, 24], torch.bfloat16),  # a part wider than a column tile
    ],
)
@pytest.mark.parametrize("deterministic", ["0", "1"])
def test_silu_split_bias_triton_matches_reference(tokens, widths, dtype, deterministic, monkeypatch):
    """The bias's gradient from the per-tile partial sums, added up by groups of row tiles (the last group short)
    into totals by atomics or per group in order, equals autograd's sum over every token; a part without a
    gradient contributes zeros to it."""
    monkeypatch.setattr(silu_split_module, "BLOCK_M", 8)
    monkeypatch.setattr(silu_split_module, "GROUP", 2)
    monkeypatch.setenv("GEM_KERNELS_DETERMINISTIC", deterministic)
    g = torch.Generator().manual_seed(tokens + len(widths))
    h = _leaf(g, tokens, sum(widths), dtype=dtype)
    bias = _leaf(g, sum(widths))
    upstream = [torch.randn(tokens, w, generator=g).to(dtype) for w in widths]
    results = {}
    for backend in ("pytorch", "triton"):
        h.grad = bias.grad = None
        parts = silu_split(h, widths, bias=bias.to(dtype) if backend == "pytorch" else bias, backend=backend)
        loss = sum((p.float() * u).sum() for p, u in zip(parts[1:], upstream[1:], strict=True))
        loss.backward()
        results[backend] = (parts, h.grad.clone(), bias.grad.clone())
    (ref, ref_dh, ref_db), (out, dh, db) = results["pytorch"], results["triton"]
    for a, b in zip(out, ref, strict=True):
        assert a.dtype == b.dtype == dtype
        torch.testing.assert_close(a, b, **_tol(dtype))
    torch.testing.assert_close(dh, ref_dh, **_tol(dtype))
    assert db.dtype == torch.float32
    torch.testing.assert_close(db, ref_db, rtol=_tol(dtype)["rtol"], atol=_tol(dtype)["atol"] * max(tokens, 1))
    assert (db[: widths[0]] == 0).all()


@pytest.mark.parametrize(
    "shape,x_dtype,g_dtype",
    [
        ((5, 7, 33), torch.float32, torch.float32),  # several programs' worth with the block patched, a ragged tail
        ((3, 28, 16), torch.float32, torch.bfloat16),  # the summary's: float32 tokens, a bf16 GEMM's gate under autocast
        ((4, 9), torch.float16, torch.float16),
        ((0, 8), torch.float32, torch.float32),  # no tokens
    ],
)
def test_sigmoid_gate_triton_matches_reference_and_eager(shape, x_dtype, g_dtype, monkeypatch):
    """Output and both gradients of the fused gate against the reference, and against eager ``x * sigmoid(g)``
    in float32; a non-contiguous gate (a transposed view) is read as it lies."""
    from kernels.triton import sigmoid_gate as gate_module

    monkeypatch.setattr(gate_module, "BLOCK", 64)
    g_ = torch.Generator().manual_seed(sum(shape))
    x = _leaf(g_, *shape, dtype=x_dtype)
    if len(shape) == 2:
        gate = torch.randn(*reversed(shape), generator=g_).to(g_dtype).t().requires_grad_(True)
    else:
        gate = _leaf(g_, *shape, dtype=g_dtype)
    upstream = torch.randn(shape, generator=g_)
    results = {}
    for backend in ("pytorch", "triton", "eager"):
        x.grad = gate.grad = None
        if backend == "eager":
            out = x.double() * torch.sigmoid(gate.double())
        else:
            out = sigmoid_gate(x, gate, backend=backend)
            assert out.dtype == torch.promote_types(x_dtype, g_dtype)
        (out.double() * upstream.double()).sum().backward()
        results[backend] = (out.double(), x.grad.double(), gate.grad.double())
        assert x.grad.dtype == x_dtype and gate.grad.dtype == g_dtype
    for name, a, b, e in zip(("y", "dx", "dg"), results["triton"], results["pytorch"], results["eager"], strict=True):
        narrow = {x_dtype, g_dtype} - {torch.float32}
        tol = _tol(narrow.pop() if narrow else torch.float32)
        torch.testing.assert_close(a, b, **tol, msg=lambda m, name=name: f"{name} vs reference: {m}")
        torch.testing.assert_close(a, e, **tol, msg=lambda m, name=name: f"{name} vs eager: {m}")


def test_sigmoid_gate_rejects_bad_input():
    x = torch.randn(4, 6)
    with pytest.raises(ValueError, match="must have x's shape"):
        sigmoid_gate(x, torch.randn(4, 5))
    with pytest.raises(ValueError, match="g must be a floating"):
        sigmoid_gate(x, torch.ones(4, 6, dtype=torch.long))


def test_silu_split_rejects_bad_input():
    h = torch.randn(4, 6)
    with pytest.raises(ValueError, match="sum to 5"):
        silu_split(h, [2, 3])
    with pytest.raises(ValueError, match="positive ints"):
        silu_split(h, [6, 0])
    with pytest.raises(ValueError, match="h must be"):
        silu_split(h[None], [6])
    with pytest.raises(ValueError, match="h must be a floating"):
        silu_split(h.long(), [6])
    with pytest.raises(ValueError, match="bias must be"):
        silu_split(h, [6], bias=torch.zeros(5))


def _residual_case(tokens: int, n: int, dtype: torch.dtype, seed: int):
    """A float32 stream, a branch in ``dtype`` (a GEMM's under autocast), affine parameters."""
    g = torch.Generator().manual_seed(seed)
    x, branch = _leaf(g, tokens, n), _leaf(g, tokens, n, dtype=dtype)
    weight = (1 + 0.3 * torch.randn(n, generator=g)).requires_grad_(True)
    bias = (0.2 * torch.randn(n, generator=g)).requires_grad_(True)
    return x, branch, weight, bias, g


def test_residual_layer_norm_reference_is_add_then_layer_norm():
    x, branch, weight, bias, _ = _residual_case(4, 9, torch.float32, 0)
    total, normed = residual_layer_norm(x, branch, weight, bias, 1e-5, backend="pytorch")
    torch.testing.assert_close(total, x + branch)
    torch.testing.assert_close(normed, torch.nn.functional.layer_norm(x + branch, (9,), weight, bias, 1e-5))


@pytest.mark.parametrize(
    "tokens,n,dtype,out_dtype",
    [
        (13, 48, torch.float32, None),
        (1, 33, torch.float32, torch.float16),  # one token, a non-power-of-two width
        (0, 40, torch.float32, None),  # no tokens
        (9, 100, torch.float16, torch.float16),
        (7, 96, torch.bfloat16, torch.bfloat16),  # the teacher's dtypes under autocast on the GPU
        (203, 72, torch.float32, None),  # the backward over several programs, the last one short
    ],
)
@pytest.mark.parametrize("stream_used", [True, False])  # the sum read downstream (the residual stream) or not
@pytest.mark.parametrize("with_branch", [True, False])  # False: the stream passes through the norm
def test_residual_layer_norm_triton_matches_reference(tokens, n, dtype, out_dtype, stream_used, with_branch):
    x, branch, weight, bias, g = _residual_case(tokens, n, dtype, seed=tokens * n + stream_used)
    branch = branch if with_branch else None
    upstream_sum, upstream_norm = torch.randn(tokens, n, generator=g), torch.randn(tokens, n, generator=g)
    leaves = [x, branch, weight, bias]
    results = {}
    for backend in ("pytorch", "triton"):
        for leaf in leaves:
            if leaf is not None:
                leaf.grad = None
        # x enters as the output of an op, as the residual stream does in a model.
        total, normed = residual_layer_norm(x * 1, branch, weight, bias, 1e-5, out_dtype=out_dtype, backend=backend)
        loss = (normed * upstream_norm.to(normed.dtype)).sum()
        if stream_used:
            loss = loss + (total * upstream_sum.to(total.dtype)).sum()
        loss.backward()
        results[backend] = (total, normed, [None if leaf is None else leaf.grad.clone() for leaf in leaves])
    (ref_sum, ref_norm, ref_grads), (total, normed, grads) = results["pytorch"], results["triton"]
    assert total.dtype == ref_sum.dtype and normed.dtype == ref_norm.dtype
    torch.testing.assert_close(total, ref_sum, rtol=0, atol=0)  # one float32 add (or none) in both
    # float32 LayerNorm sums in another order; a half-precision output or branch rounds once more.
    low = dtype if dtype != torch.float32 and with_branch else out_dtype or torch.float32
    tol = {k: max(v, 1e-4) for k, v in _tol(low).items()}
    torch.testing.assert_close(normed, ref_norm, **tol)
    for name, a, b in zip(("x", "branch", "weight", "bias"), grads, ref_grads, strict=True):
        if b is None:
            assert a is None, name
            continue
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, **tol, msg=name)


def test_residual_layer_norm_only_the_sum_used():
    """The norm's output unused: both inputs get the sum's gradient, the parameters none."""
    x, branch, weight, bias, g = _residual_case(5, 12, torch.float16, 3)
    total, _ = residual_layer_norm(x, branch, weight, bias, 1e-5, backend="triton")
    upstream = torch.randn(5, 12, generator=g)
    (total * upstream).sum().backward()
    torch.testing.assert_close(x.grad, upstream)
    torch.testing.assert_close(branch.grad, upstream.half())
    assert weight.grad is None and bias.grad is None


@pytest.mark.parametrize("with_branch", [True, False])
@pytest.mark.parametrize("norm_used", [True, False])
def test_residual_layer_norm_picks_rows_whose_gradient_joins_the_stream_s(with_branch, norm_used):
    """Picked rows of the sum (repeats included) against the reference's gather: values and every gradient, with
    the stream read downstream too; the picked rows' gradients must reach x and the branch."""
    picks = torch.tensor([3, 0, 7, 3, 10])
    results = {}
    for backend in ("pytorch", "triton"):
        x, branch, weight, bias, g = _residual_case(11, 24, torch.float16, seed=5)
        branch = branch if with_branch else None
        total, normed, picked = residual_layer_norm(x * 1, branch, weight, bias, 1e-5, picks=picks, backend=backend)
        loss = (total * torch.randn(11, 24, generator=g)).sum() + (picked * torch.randn(5, 24, generator=g)).sum()
        if norm_used:
            loss = loss + (normed * torch.randn(11, 24, generator=g)).sum()
        loss.backward()
        grads = [t.grad for t in (x, branch, weight, bias) if t is not None]
        results[backend] = (picked.detach(), grads)
    (ref_picked, ref_grads), (picked, grads) = results["pytorch"], results["triton"]
    torch.testing.assert_close(picked, ref_picked, rtol=0, atol=0)
    assert len(grads) == len(ref_grads)
    if with_branch and not norm_used:
        # The branch's gradient is the sum's (the picked rows' included) rounded once, as autograd rounds it.
        torch.testing.assert_close(grads[1], ref_grads[1], rtol=0, atol=0)
    for a, b in zip(grads, ref_grads, strict=True):
        if b is None:
            assert a is None
            continue
        torch.testing.assert_close(a, b, **_tol(torch.float16))


def test_residual_layer_norm_rejects_bad_input():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="branch must have"):
        residual_layer_norm(x, torch.randn(3, 7), torch.ones(8), torch.zeros(8), 1e-5)
    with pytest.raises(ValueError, match="weight must be"):
        residual_layer_norm(x, x, torch.ones(7), torch.zeros(8), 1e-5)
    with pytest.raises(ValueError, match="branch must be a floating"):
        residual_layer_norm(x, x.long(), torch.ones(8), torch.zeros(8), 1e-5)
    with pytest.raises(ValueError, match="out_dtype"):
        residual_layer_norm(x, x, torch.ones(8), torch.zeros(8), 1e-5, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="picks must be int64"):
        residual_layer_norm(x, x, torch.ones(8), torch.zeros(8), 1e-5, picks=torch.tensor([0.5]))
    with pytest.raises(ValueError, match="branch_bias needs a branch"):
        residual_layer_norm(x, None, torch.ones(8), torch.zeros(8), 1e-5, branch_bias=torch.zeros(8))
    with pytest.raises(ValueError, match=r"branch_bias must be \[8\]"):
        residual_layer_norm(x, x, torch.ones(8), torch.zeros(8), 1e-5, branch_bias=torch.zeros(3, 8))


@pytest.mark.parametrize("with_bias", [True, False])
def test_residual_layer_norm_on_a_bf16_stream_matches_reference(with_bias):
    """A bf16 residual stream (``stream_dtype="autocast"``): the sum, the norm and every gradient against the
    reference, within bf16 rounding."""
    results = {}
    for backend in ("pytorch", "triton"):
        x, branch, weight, bias, g = _residual_case(37, 64, torch.bfloat16, seed=9)
        x = x.to(torch.bfloat16).detach().requires_grad_()
        branch_bias = (0.5 * torch.randn(64, generator=g)).to(torch.bfloat16).requires_grad_() if with_bias else None
        total, normed = residual_layer_norm(x * 1, branch, weight, bias, 1e-5, branch_bias=branch_bias,
                                            out_dtype=torch.bfloat16, backend=backend)
        loss = (total.float() * torch.randn(37, 64, generator=g)).sum() + (normed.float() * torch.randn(37, 64, generator=g)).sum()
        loss.backward()
        leaves = (x, branch, weight, bias) + ((branch_bias,) if with_bias else ())
        results[backend] = (total.detach(), normed.detach(), [t.grad for t in leaves])
    (ref_sum, ref_norm, ref_grads), (total, normed, grads) = results["pytorch"], results["triton"]
    assert total.dtype == torch.bfloat16 and normed.dtype == torch.bfloat16
    # One rounding of the float32 sum in the kernel (the interpreter's conversion truncates where the GPU's rounds
    # to nearest); the reference rounds x + branch, and again after adding the bias.
    torch.testing.assert_close(total, ref_sum, **_tol(torch.bfloat16))
    torch.testing.assert_close(normed, ref_norm, **_tol(torch.bfloat16))
    names = ("x", "branch", "weight", "bias", "branch_bias")[: len(grads)]
    for name, a, b in zip(names, grads, ref_grads, strict=True):
        assert a.dtype == b.dtype, name
        # Sums over rows of terms that differ by a bf16 rounding of the sum: bounded by the tensor's scale.
        torch.testing.assert_close(a, b, rtol=0, atol=1.6e-2 * float(b.abs().max()), msg=name)


@pytest.mark.parametrize("use", ["norm+stream", "norm+picks", "stream"])
def test_residual_layer_norm_one_gradient_for_stream_and_branch_survives_accumulation(use):
    """With stream, branch and sum in one dtype the backward hands one tensor to both inputs. Each input also feeds
    another op, so autograd sums two gradients into each of them: were that sum done in place in the shared tensor,
    the other input's gradient would change. Both gradients against the reference's."""
    picks = torch.tensor([3, 0, 5, 3]) if "picks" in use else None
    results = {}
    for backend in ("pytorch", "triton"):
        x, branch, weight, bias, g = _residual_case(23, 32, torch.bfloat16, seed=4)
        x = x.to(torch.bfloat16).detach().requires_grad_()
        out = residual_layer_norm(x * 1, branch * 1, weight, bias, 1e-5, picks=picks, out_dtype=torch.bfloat16,
                                  backend=backend)
        loss = (x.float() * 3).sum() + (branch.float() ** 2).sum()  # the inputs' other consumers
        if "stream" in use:
            loss = loss + (out[0].float() * torch.randn(out[0].shape, generator=g)).sum()
        if "norm" in use:
            loss = loss + (out[1].float() * torch.randn(out[1].shape, generator=g)).sum()
        if picks is not None:
            loss = loss + (out[2].float() * torch.randn(out[2].shape, generator=g)).sum()
        loss.backward()
        results[backend] = [x.grad, branch.grad]
    for name, a, b in zip(("x", "branch"), results["triton"], results["pytorch"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1.6e-2 * float(b.abs().max()), msg=name)


def test_residual_layer_norm_of_one_dtype_writes_one_gradient():
    """A bf16 stream and branch: the gradients of both inputs are one tensor (one write of ``[M, N]`` saved); a
    float32 stream with a bf16 branch keeps two."""
    for stream_dtype, shared in ((torch.bfloat16, True), (torch.float32, False)):
        x, branch, weight, bias, _ = _residual_case(9, 16, torch.bfloat16, seed=1)
        x = x.to(stream_dtype).detach().requires_grad_()
        total, normed = residual_layer_norm(x, branch, weight, bias, 1e-5, out_dtype=torch.bfloat16, backend="triton")
        dx, dbranch = torch.autograd.grad((total.float().sum() + normed.float().pow(2).sum()), [x, branch])
        assert (dx.data_ptr() == dbranch.data_ptr()) is shared
        torch.testing.assert_close(dx.float(), dbranch.float(), rtol=0, atol=1e-2 * float(dx.abs().max()))


def test_residual_layer_norm_reference_adds_the_branch_bias():
    x, branch, weight, bias, g = _residual_case(4, 9, torch.float32, 0)
    branch_bias = torch.randn(9, generator=g)
    total, normed = residual_layer_norm(x, branch, weight, bias, 1e-5, branch_bias=branch_bias, backend="pytorch")
    torch.testing.assert_close(total, x + branch + branch_bias)
    torch.testing.assert_close(normed, torch.nn.functional.layer_norm(total, (9,), weight, bias, 1e-5))


@pytest.mark.parametrize(
    "tokens,n,dtype,programs,rows",
    [
        (13, 48, torch.float32, None, 1),
        (0, 40, torch.float32, None, 1),
        (7, 96, torch.bfloat16, None, 1),  # the teacher's: a bf16 branch on a float32 stream under autocast
        (203, 72, torch.float32, 37, 1),  # two full groups of programs and a short one (as on the GPU)
        (203, 72, torch.float32, 37, 4),  # ... on 4-row tiles (26 programs of 8 rows, the last of 3)
    ],
)
@pytest.mark.parametrize("use", ["norm", "norm+stream", "stream", "norm+picks", "picks"])
def test_residual_layer_norm_branch_bias_gradient_is_the_sums(monkeypatch, tokens, n, dtype, programs, rows, use):
    """The branch's bias added in the norm's pass: the sum, the norm and every gradient against the reference (whose
    bias gradient is autograd's reduction of the sum's gradient), whichever of the sum, the norm and picked rows are
    read downstream; the bias gradient from the kernel's partial sums, the picked rows' added on the host, or, with
    the norm unused, from the sum's gradient."""
    from kernels.triton import layer_norm as triton_ln

    if programs:
        monkeypatch.setattr(triton_ln, "_num_programs", lambda m, device: programs)
    monkeypatch.setattr(triton_ln, "BWD_ROWS", rows)
    picks = torch.tensor([3, 0, 5, 3]) if "picks" in use and tokens else None
    results = {}
    for backend in ("pytorch", "triton"):
        x, branch, weight, bias, g = _residual_case(tokens, n, dtype, seed=tokens + n)
        x = x.float().detach().requires_grad_()  # the float32 residual stream
        branch_bias = (0.5 * torch.randn(n, generator=g)).requires_grad_()
        out = residual_layer_norm(x * 1, branch, weight, bias, 1e-5, branch_bias=branch_bias, picks=picks,
                                  backend=backend)
        loss = x.sum() * 0
        if "stream" in use:
            loss = loss + (out[0] * torch.randn(out[0].shape, generator=g)).sum()
        if "norm" in use:
            loss = loss + (out[1].float() * torch.randn(out[1].shape, generator=g)).sum()
        if picks is not None:
            loss = loss + (out[2] * torch.randn(out[2].shape, generator=g)).sum()
        loss.backward()
        leaves = (x, branch, branch_bias, weight, bias)
        results[backend] = ([t.detach() for t in out], [t.grad for t in leaves])
    (ref_out, ref_grads), (got, grads) = results["pytorch"], results["triton"]
    tol = {k: max(v, 1e-4) for k, v in _tol(dtype).items()}
    for a, b in zip(got, ref_out, strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, **tol)
    for name, a, b in zip(("x", "branch", "branch_bias", "weight", "bias"), grads, ref_grads, strict=True):
        if b is None:
            assert a is None, name
            continue
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, **tol, msg=name)
    if tokens:
        assert grads[2] is not None and grads[2].abs().sum() > 0


@pytest.mark.parametrize("backend", ["pytorch", "triton"])
def test_deferred_residual_gives_the_blocks_result(backend, monkeypatch):
    """A PFFN whose output the HSTU block adds in its input norm computes what the two modules compute one after the
    other (same values and gradients), on the references and on the kernels."""
    from foundation.model.hstu import HSTUBlock
    from foundation.model.interformer import PersonalizedFFN

    monkeypatch.setenv("GEM_GLUE_BACKEND", backend)
    torch.manual_seed(0)
    pffn = PersonalizedFFN(16, 3, 4, 24, dropout=0.0)
    block = HSTUBlock(16, 2, 8, 8, dropout=0.0, alpha=None, pos_buckets=8, time_buckets=0, attention_norm=0)
    lengths = torch.tensor([3, 0, 1, 6])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    rows = torch.repeat_interleave(torch.arange(4), lengths)
    x, summary = torch.randn(10, 16, requires_grad=True), torch.randn(4, 3, 16)
    timestamps = torch.arange(10)
    results = []
    for defer in (False, True):
        x.grad = None
        for p in (*pffn.parameters(), *block.parameters()):
            p.grad = None
        if defer:
            seq, branch, bias = pffn(x, rows, summary, defer_residual=True)
            out = block(seq, offsets, 6, timestamps, branch=branch, branch_bias=bias)
        else:
            out = block(pffn(x, rows, summary), offsets, 6, timestamps)
        out.square().sum().backward()
        grads = [x.grad.clone()] + [p.grad.clone() for p in (*pffn.parameters(), *block.parameters())]
        results.append((out.detach(), grads))
    (ref, ref_grads), (out, grads) = results
    # The deferred bias joins the stream after the branch instead of before: float32 rounding apart.
    tol = {"rtol": 1e-5, "atol": 1e-6} if backend == "pytorch" else {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(out, ref, **tol)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("num_seeds", [3, 0])
def test_summary_on_the_stream_runs_on_the_kernels(num_seeds, monkeypatch):
    """The sequence summary reading the combined stream where it lies (the PMA over 2B key sequences, half of them
    without queries; the norm passing the stream through) on the Triton attention and glue kernels, against the
    previous formulation on the references: output, the handed-on stream and every gradient."""
    from tests.test_fewer_launches import outputs_and_grads, summary_case

    new, old, x = summary_case(num_seeds, 4)
    monkeypatch.setenv("GEM_GLUE_BACKEND", "pytorch")
    monkeypatch.setenv("GEM_ATTENTION_BACKEND", "pytorch")
    want = outputs_and_grads(old, x, False, False)
    monkeypatch.setenv("GEM_GLUE_BACKEND", "triton")
    monkeypatch.setenv("GEM_ATTENTION_BACKEND", "triton")
    got = outputs_and_grads(new, x, False, False)
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-5)
    assert got[2].keys() == want[2].keys()
    for name, grad in want[2].items():
        torch.testing.assert_close(got[2][name], grad, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_dropout_references_scale_the_kept_elements():
    """With a keep mask, the references are the op without dropout times ``mask / (1 - p)``."""
    g = torch.Generator().manual_seed(1)
    x, gate, h = torch.randn(6, 10, generator=g), torch.randn(6, 10, generator=g), torch.randn(6, 10, generator=g)
    scale, shift, rows = torch.randn(2, 10, generator=g), torch.randn(2, 10, generator=g), torch.tensor([0, 0, 0, 1, 1, 1])
    mask = torch.rand(6, 10, generator=g) > 0.25
    w, b = torch.ones(10), torch.zeros(10)
    plain = layer_norm(x, w, b, 1e-5, gate=gate, backend="pytorch")
    dropped = layer_norm(x, w, b, 1e-5, gate=gate, dropout_mask=mask, dropout_p=0.25, backend="pytorch")
    torch.testing.assert_close(dropped, torch.where(mask, plain / 0.75, 0.0))
    plain = jagged_silu_modulate(h, scale, shift, rows, backend="pytorch")
    dropped = jagged_silu_modulate(h, scale, shift, rows, dropout_mask=mask, dropout_p=0.25, backend="pytorch")
    torch.testing.assert_close(dropped, torch.where(mask, plain / 0.75, 0.0))


@pytest.mark.parametrize(
    "tokens,n,dtype",
    [(21, 48, torch.float32), (1, 33, torch.float32), (0, 16, torch.float32), (9, 100, torch.float16),
     (7, 96, torch.bfloat16)],
)
def test_layer_norm_dropout_triton_matches_reference(tokens, n, dtype):
    """The gated norm with dropout (the HSTU block's): same mask, same values and gradients on both backends."""
    g = torch.Generator().manual_seed(tokens + n)
    x, gate = _leaf(g, tokens, n, dtype=dtype), _leaf(g, tokens, n, dtype=dtype)
    weight = (1 + 0.3 * torch.randn(n, generator=g)).requires_grad_(True)
    bias = (0.2 * torch.randn(n, generator=g)).requires_grad_(True)
    mask, upstream = torch.rand(tokens, n, generator=g) > 0.3, torch.randn(tokens, n, generator=g)
    leaves = [x, weight, bias, gate]
    results = {}
    for backend in ("pytorch", "triton"):
        for leaf in leaves:
            leaf.grad = None
        out = layer_norm(x, weight, bias, 1e-5, scale=0.7, gate=gate, dropout_mask=mask, dropout_p=0.3, backend=backend)
        (out * upstream.to(dtype)).sum().backward()
        results[backend] = (out, [leaf.grad.clone() for leaf in leaves])
    (ref, ref_grads), (out, grads) = results["pytorch"], results["triton"]
    tol = {k: max(v, 1e-4) for k, v in _tol(dtype).items()}
    torch.testing.assert_close(out, ref, **tol)
    assert not out[~mask].any()  # dropped elements are exactly zero
    for name, a, b in zip(("x", "weight", "bias", "gate"), grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, **tol, msg=name)
    if tokens:  # a dropped element passes no gradient to its gate
        assert not grads[3][~mask].any()


@pytest.mark.parametrize(
    "lengths,n,dtype", [([3, 0, 1, 70, 5], 24, torch.float32), ([33, 2, 0], 130, torch.float16), ([0, 0], 8, torch.float32)]
)
def test_silu_modulate_dropout_triton_matches_reference(lengths, n, dtype):
    """The PFFN's modulation with its dropout: same mask, same values and gradients on both backends."""
    g = torch.Generator().manual_seed(sum(lengths) + n)
    rows = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    h = _leaf(g, rows.numel(), n, dtype=dtype)
    scale, shift = _leaf(g, len(lengths), n, dtype=dtype), _leaf(g, len(lengths), n, dtype=dtype)
    mask, upstream = torch.rand(rows.numel(), n, generator=g) > 0.1, torch.randn(rows.numel(), n, generator=g)
    results = {}
    for backend in ("pytorch", "triton"):
        for leaf in (h, scale, shift):
            leaf.grad = None
        out = jagged_silu_modulate(h, scale, shift, rows, dropout_mask=mask, dropout_p=0.1, backend=backend)
        (out * upstream.to(dtype)).sum().backward()
        results[backend] = (out, [t.grad.clone() for t in (h, scale, shift)])
    (ref, ref_grads), (out, grads) = results["pytorch"], results["triton"]
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(out, ref, **tol)
    for name, a, b in zip(("h", "scale", "shift"), grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, **tol, msg=name)


def test_dropout_mask_keeps_one_minus_p_and_bad_masks_are_refused():
    torch.manual_seed(0)
    mask = draw_dropout_mask((400, 250), 0.1, torch.device("cpu"))
    assert mask.dtype == torch.bool and abs(mask.float().mean().item() - 0.9) < 0.005
    x, w, b = torch.randn(3, 8), torch.ones(8), torch.zeros(8)
    with pytest.raises(ValueError, match="needs a dropout_mask"):
        layer_norm(x, w, b, 1e-5, dropout_p=0.1)
    with pytest.raises(ValueError, match="dropout_mask must be bool"):
        layer_norm(x, w, b, 1e-5, dropout_mask=torch.ones(3, 8), dropout_p=0.1)
    with pytest.raises(ValueError, match="dropout_mask must be bool"):
        layer_norm(x, w, b, 1e-5, dropout_mask=torch.ones(3, 7, dtype=torch.bool), dropout_p=0.1)
    with pytest.raises(ValueError, match="dropout_p must be in"):
        layer_norm(x, w, b, 1e-5, dropout_mask=torch.ones(3, 8, dtype=torch.bool), dropout_p=1.0)
    with pytest.raises(ValueError, match="needs a dropout_mask"):
        jagged_silu_modulate(x, x[:1], x[:1], torch.zeros(3, dtype=torch.int64), dropout_p=0.5)


def test_blocks_without_dropout_take_the_kernels_path_without_a_mask():
    """p = 0, or evaluation: no mask drawn (the generator is untouched) and the output is the plain op's."""
    from foundation.model.norms import fused_dropout

    drop = torch.nn.Dropout(0.2)
    assert fused_dropout(torch.nn.Dropout(0.0), (3, 4), torch.device("cpu")) == {}
    assert fused_dropout(drop.eval(), (3, 4), torch.device("cpu")) == {}
    state = torch.get_rng_state()
    args = fused_dropout(drop.train(), (3, 4), torch.device("cpu"))
    assert args["dropout_p"] == 0.2 and args["dropout_mask"].shape == (3, 4)
    assert not torch.equal(state, torch.get_rng_state())
