"""The glue kernels (fused LayerNorm, per-row SiLU modulation): Triton (interpreted on CPU) against the PyTorch
references, forward and every gradient, on random shapes incl. empty, single and non-power-of-two ones.

The references are first checked against plain eager PyTorch (``nn.LayerNorm`` then the gate; advanced
indexing), so a shared misunderstanding cannot pass both.
"""

from __future__ import annotations

import pytest
import torch

from kernels import jagged_silu_modulate, layer_norm, unbind_pair
from kernels.triton import row_modulate


def _leaf(g: torch.Generator, *shape: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(dtype).requires_grad_(True)


def _grads(out: torch.Tensor, upstream: torch.Tensor, leaves: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    for x in leaves:
        if x is not None:
            x.grad = None
    out.backward(upstream.to(out.dtype))
    return [None if x is None else x.grad.clone() for x in leaves]


def _ln_case(rows: int, n: int, dtype: torch.dtype, with_gate: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = _leaf(g, rows, n, dtype=dtype)
    weight = (1 + 0.3 * torch.randn(n, generator=g)).requires_grad_(True)
    bias = (0.2 * torch.randn(n, generator=g)).requires_grad_(True)
    gate = _leaf(g, rows, n, dtype=dtype) if with_gate else None
    return x, weight, bias, gate, torch.randn(rows, n, generator=g)


def test_layer_norm_reference_is_eager_layer_norm_then_gate():
    x, weight, bias, gate, _ = _ln_case(5, 12, torch.float32, True, 0)
    norm = torch.nn.LayerNorm(12)
    with torch.no_grad():
        norm.weight.copy_(weight)
        norm.bias.copy_(bias)
    expected = norm(x * 0.5) * gate
    torch.testing.assert_close(layer_norm(x, weight, bias, norm.eps, scale=0.5, gate=gate, backend="pytorch"), expected)


@pytest.mark.parametrize(
    "rows,n,dtype,with_gate,scale,out_dtype",
    [
        (7, 48, torch.float32, False, 1.0, None),
        (9, 100, torch.float32, True, 0.37, None),
        (1, 33, torch.float32, True, 2.0, torch.float16),
        (6, 64, torch.float16, True, 1.0, torch.float32),
        (5, 128, torch.float16, False, 3.0, torch.float16),
        (8, 96, torch.bfloat16, True, 0.7, torch.bfloat16),  # the HSTU attention norm's dtypes on the GPU
        (0, 40, torch.float32, True, 1.0, None),
        # the backward over several programs of many rows each, the last program short
        (301, 100, torch.float32, True, 0.5, None),
        (75, 1000, torch.float32, True, 1.0, torch.bfloat16),
    ],
)
def test_layer_norm_triton_matches_reference(rows, n, dtype, with_gate, scale, out_dtype):
    x, weight, bias, gate, upstream = _ln_case(rows, n, dtype, with_gate, seed=rows * n)
    leaves = [x, weight, bias, gate]
    results = {}
    for backend in ("pytorch", "triton"):
        out = layer_norm(x, weight, bias, 1e-5, scale=scale, gate=gate, out_dtype=out_dtype, backend=backend)
        results[backend] = (out, _grads(out, upstream, leaves))
    (ref, ref_grads), (out, grads) = results["pytorch"], results["triton"]
    assert out.dtype == ref.dtype and out.shape == ref.shape
    low = {dtype, out_dtype} - {torch.float32, None}
    tol = {"rtol": 1e-4, "atol": 1e-4}
    if low:  # the reference rounds at every eager step, the kernel once
        tol = {"rtol": 3e-2, "atol": 3e-2} if torch.bfloat16 in low else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(out, ref, **tol)
    for name, a, b in zip(("x", "weight", "bias", "gate"), grads, ref_grads, strict=True):
        if b is None:
            assert a is None
            continue
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, **tol, msg=name)


@pytest.mark.parametrize("programs", [16, 37])
def test_layer_norm_backward_groups_add_every_programs_partial_sums(monkeypatch, programs):
    """On the GPU the backward runs thousands of programs; the last of each group of ``BWD_GROUP`` to finish adds
    the group's partial sums. Forced here to 16 (one full group) and 37 (two full groups and a short one, some
    programs with no rows): the weight and bias gradients match the reference, whichever program adds a group."""
    from kernels.triton import layer_norm as triton_ln

    monkeypatch.setattr(triton_ln, "_num_programs", lambda m, device: programs)
    x, weight, bias, gate, upstream = _ln_case(70, 48, torch.float32, True, seed=11)
    leaves = [x, weight, bias, gate]
    grads = {}
    for backend in ("pytorch", "triton"):
        out = layer_norm(x, weight, bias, 1e-5, gate=gate, backend=backend)
        grads[backend] = _grads(out, upstream, leaves)
    for name, a, b in zip(("x", "weight", "bias", "gate"), grads["triton"], grads["pytorch"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=name)


def test_layer_norm_three_dimensional_input_and_gate():
    g = torch.Generator().manual_seed(3)
    x, gate = _leaf(g, 4, 3, 10), _leaf(g, 4, 3, 10)
    weight, bias = torch.ones(10, requires_grad=True), torch.zeros(10, requires_grad=True)
    upstream = torch.randn(4, 3, 10, generator=g)
    outs = {}
    for backend in ("pytorch", "triton"):
        out = layer_norm(x, weight, bias, 1e-6, gate=gate, backend=backend)
        outs[backend] = (out, _grads(out, upstream, [x, weight, bias, gate]))
    torch.testing.assert_close(outs["triton"][0], outs["pytorch"][0], rtol=1e-4, atol=1e-5)
    for a, b in zip(outs["triton"][1], outs["pytorch"][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_layer_norm_rejects_bad_input():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="weight must be"):
        layer_norm(x, torch.ones(7), torch.zeros(8), 1e-5)
    with pytest.raises(ValueError, match="gate must have"):
        layer_norm(x, torch.ones(8), torch.zeros(8), 1e-5, gate=torch.ones(3, 4))
    with pytest.raises(ValueError, match="x must be a floating"):
        layer_norm(x.long(), torch.ones(8), torch.zeros(8), 1e-5)
    with pytest.raises(ValueError, match="backend"):
        layer_norm(x, torch.ones(8), torch.zeros(8), 1e-5, backend="cuda")


def _rows(lengths: list[int]) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.int64))


def test_silu_modulate_reference_is_silu_then_row_affine():
    h, scale, shift = torch.randn(6, 4), torch.randn(3, 4), torch.randn(3, 4)
    rows = _rows([2, 0, 4])
    expected = torch.nn.functional.silu(h) * scale[rows] + shift[rows]
    torch.testing.assert_close(jagged_silu_modulate(h, scale, shift, rows, backend="pytorch"), expected)


@pytest.mark.parametrize(
    "lengths,n,dtype",
    [
        ([3, 0, 1, 70, 5], 24, torch.float32),  # empty and single rows, one longer than a token tile
        ([0, 0, 0], 8, torch.float32),  # no tokens at all
        ([33, 2, 0], 130, torch.float16),  # wider than a column block
        ([64, 1], 1, torch.float32),  # one column
        ([5, 9, 2], 48, torch.bfloat16),  # the PFFN's dtype under autocast on the GPU
    ],
)
@pytest.mark.parametrize(
    "block_l,chunk_tiles,stages",
    [(row_modulate.BLOCK_L, row_modulate.CHUNK_TILES, row_modulate.STAGES), (4, row_modulate.CHUNK_TILES, 1), (4, 1, 1),
     (4, row_modulate.CHUNK_TILES, 3)],
)  # 4: several token tiles per row, and rows of several chunks of 16 or of 4 tokens; 3 stages: the pipelined walk
def test_silu_modulate_triton_matches_reference(lengths, n, dtype, block_l, chunk_tiles, stages, monkeypatch):
    monkeypatch.setattr(row_modulate, "BLOCK_L", block_l)
    monkeypatch.setattr(row_modulate, "CHUNK_TILES", chunk_tiles)
    monkeypatch.setattr(row_modulate, "STAGES", stages)
    g = torch.Generator().manual_seed(sum(lengths) + n)
    rows = _rows(lengths)
    h = _leaf(g, rows.numel(), n, dtype=dtype)
    scale, shift = _leaf(g, len(lengths), n, dtype=dtype), _leaf(g, len(lengths), n, dtype=dtype)
    upstream = torch.randn(rows.numel(), n, generator=g)
    results = {}
    for backend in ("pytorch", "triton"):
        out = jagged_silu_modulate(h, scale, shift, rows, backend=backend)
        results[backend] = (out, _grads(out, upstream, [h, scale, shift]))
    (ref, ref_grads), (out, grads) = results["pytorch"], results["triton"]
    tol = {"rtol": 1e-5, "atol": 1e-5}
    if dtype != torch.float32:  # the reference rounds after each eager op, the kernel once
        tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.float16 else {"rtol": 5e-2, "atol": 5e-2}
    assert out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, **tol)
    for name, a, b in zip(("h", "scale", "shift"), grads, ref_grads, strict=True):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, **tol, msg=name)
    # The row sums accumulate in float32 before their cast: close to the exact sums.
    exact = torch.zeros(len(lengths), n, dtype=torch.float64).index_add_(0, rows, upstream.to(dtype).double())
    torch.testing.assert_close(grads[2].double(), exact, **tol)


def test_silu_modulate_reference_adds_bias_and_scale_offset():
    h, scale, shift, bias = torch.randn(6, 4), torch.randn(3, 4), torch.randn(3, 4), torch.randn(4)
    rows = _rows([2, 0, 4])
    expected = torch.nn.functional.silu(h + bias) * (1.0 + scale[rows]) + shift[rows]
    out = jagged_silu_modulate(h, scale, shift, rows, bias=bias, scale_offset=1.0, backend="pytorch")
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize(
    "lengths,n,dtype",
    [
        ([3, 0, 1, 70, 5], 24, torch.float32),  # empty and single rows, several token tiles
        ([0, 0, 0], 8, torch.float32),  # no tokens: a zero bias gradient
        ([5, 9, 2], 48, torch.bfloat16),  # the PFFN's dtype under autocast on the GPU
    ],
)
def test_silu_modulate_bias_and_offset_triton_matches_reference(lengths, n, dtype, monkeypatch):
    """The bias's gradient from the per-row partial sums equals autograd's sum over every token."""
    monkeypatch.setattr(row_modulate, "BLOCK_L", 4)
    g = torch.Generator().manual_seed(sum(lengths) + n + 1)
    rows = _rows(lengths)
    h = _leaf(g, rows.numel(), n, dtype=dtype)
    scale, shift = _leaf(g, len(lengths), n, dtype=dtype), _leaf(g, len(lengths), n, dtype=dtype)
    bias = _leaf(g, n)
    upstream = torch.randn(rows.numel(), n, generator=g)
    results = {}
    for backend in ("pytorch", "triton"):
        out = jagged_silu_modulate(h, scale, shift, rows, bias=bias, scale_offset=1.0, backend=backend)
        results[backend] = (out, _grads(out, upstream, [h, scale, shift, bias]))
    (ref, ref_grads), (out, grads) = results["pytorch"], results["triton"]
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 5e-2, "atol": 5e-2}
    assert out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, **tol)
    for name, a, b in zip(("h", "scale", "shift"), grads[:3], ref_grads[:3], strict=True):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, **tol, msg=name)
    assert grads[3].dtype == torch.float32
    torch.testing.assert_close(grads[3], ref_grads[3], rtol=tol["rtol"], atol=tol["atol"] * max(rows.numel(), 1))


def test_silu_modulate_rejects_bad_input():
    h, scale = torch.randn(4, 3), torch.randn(2, 3)
    rows = torch.tensor([0, 0, 1, 1])
    with pytest.raises(ValueError, match="rows must be"):
        jagged_silu_modulate(h, scale, scale, rows.int())
    with pytest.raises(ValueError, match="rows must be"):
        jagged_silu_modulate(h, scale, scale, rows[:3])
    with pytest.raises(ValueError, match="shift must be"):
        jagged_silu_modulate(h, scale, torch.randn(2, 4), rows)
    with pytest.raises(ValueError, match="h must be"):
        jagged_silu_modulate(h[None], scale, scale, rows)


@pytest.mark.parametrize("interleave", [True, False])
def test_teacher_step_is_the_same_on_the_glue_kernels(monkeypatch, interleave):
    """A whole teacher forward+backward with every glue op on Triton equals the one on the references."""
    from foundation.model.teacher import build_teacher
    from tests.teacher_batches import CTR_SCHEMA, make_batch, tiny_config

    cfg = tiny_config(generative=True, dropout=0.0, interleave=interleave)
    batch = make_batch(CTR_SCHEMA, [0, 1, 6, 3, 9])
    results = {}
    for backend in ("pytorch", "triton"):
        monkeypatch.setenv("GEM_GLUE_BACKEND", backend)  # the switch's environment override
        torch.manual_seed(0)
        model = build_teacher(cfg, CTR_SCHEMA)
        loss = model.loss(batch, model(batch))["loss"]
        loss.backward()
        results[backend] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    (ref_loss, ref_grads), (loss, grads) = results["pytorch"], results["triton"]
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_unbind_pair_is_unbind_and_stacks_gradients_laid_out_otherwise():
    """``unbind_pair`` gives ``unbind(1)``'s views; gradients that are not the halves of one tensor (separate
    tensors, one of them missing, a pair in the other order) are stacked as ``unbind``'s backward does."""
    g = torch.Generator().manual_seed(0)
    pair = torch.randn(5, 2, 3, 4, generator=g, requires_grad=True)
    first, second = unbind_pair(pair)
    assert first.data_ptr() == pair.data_ptr() and torch.equal(second, pair.detach()[:, 1])
    da, db = torch.randn(5, 3, 4, generator=g), torch.randn(5, 3, 4, generator=g)
    (grad,) = torch.autograd.grad([first, second], [pair], [da, db])
    torch.testing.assert_close(grad, torch.stack([da, db], 1), rtol=0, atol=0)
    (grad,) = torch.autograd.grad(unbind_pair(pair)[1], [pair], [db])
    torch.testing.assert_close(grad, torch.stack([torch.zeros_like(db), db], 1), rtol=0, atol=0)
    swapped = torch.randn(5, 2, 3, 4, generator=g)
    first, second = unbind_pair(pair)
    (grad,) = torch.autograd.grad([first, second], [pair], [swapped[:, 1], swapped[:, 0]])
    torch.testing.assert_close(grad, swapped.flip(1), rtol=0, atol=0)


def test_unbind_pair_hands_on_the_halves_of_one_gradient_tensor():
    """Gradients that are ``buffer[:, 0]`` and ``buffer[:, 1]`` of one contiguous tensor come back as that tensor."""
    pair = torch.randn(6, 2, 8, requires_grad=True)
    buffer = torch.randn(6, 2, 8)
    (grad,) = torch.autograd.grad(list(unbind_pair(pair)), [pair], [buffer[:, 0], buffer[:, 1]])
    assert grad.data_ptr() == buffer.data_ptr() and torch.equal(grad, buffer)


def test_unbind_pair_rejects_a_tensor_without_a_pair_axis():
    with pytest.raises(ValueError, match=r"\[L, 2, \.\.\.\]"):
        unbind_pair(torch.randn(4, 3, 2))
