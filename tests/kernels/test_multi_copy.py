"""The multi-tensor copy (:func:`kernels.multi_copy`) against one ``copy_`` per pair: float32 parameters into bf16
copies and bf16 gradients (some transposed) into float32 buffers, in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from kernels import multi_copy
from kernels.triton import multi_copy as triton_multi_copy

BLOCK = triton_multi_copy.BLOCK
SHAPES = [(0,), (1,), (3, 5), (BLOCK,), (BLOCK + 1,), (2, BLOCK + 7), (4, 3, 2)]


def _expected(dsts, srcs):
    return [s.to(d.dtype) for d, s in zip(dsts, srcs, strict=True)]


@pytest.mark.parametrize("direction", ["to_bf16", "to_float32"])
def test_contiguous_tensors_of_every_size_convert_exactly(direction):
    torch.manual_seed(0)
    src_dtype, dst_dtype = (torch.float32, torch.bfloat16) if direction == "to_bf16" else (torch.bfloat16, torch.float32)
    srcs = [torch.randn(shape).to(src_dtype) for shape in SHAPES]
    dsts = [torch.full(shape, 7.0, dtype=dst_dtype) for shape in SHAPES]
    multi_copy(dsts, srcs, backend="triton")
    for i, (got, want) in enumerate(zip(dsts, _expected(dsts, srcs), strict=True)):
        assert torch.equal(got, want), f"tensor {i} of shape {SHAPES[i]}"


def test_sources_laid_out_otherwise_than_their_destinations():
    """Transposed 2-D gradients go through the strided path, a permuted 3-D one through a plain copy; a
    destination next to them in memory is not written past its end."""
    torch.manual_seed(1)
    grads = [torch.randn(7, 5).to(torch.bfloat16).t(), torch.randn(BLOCK + 3, 2).to(torch.bfloat16).t(),
             torch.randn(3, 4, 5).to(torch.bfloat16).permute(2, 0, 1), torch.randn(6).to(torch.bfloat16)]
    assert not grads[0].is_contiguous() and not grads[2].is_contiguous()
    flat = torch.zeros(sum(g.numel() for g in grads) + 8)
    dsts, start = [], 0
    for g in grads:
        dsts.append(flat[start:start + g.numel()].view(g.shape))
        start += g.numel()
    multi_copy(dsts, grads, backend="triton")
    for got, want in zip(dsts, _expected(dsts, grads), strict=True):
        assert torch.equal(got, want)
    assert torch.equal(flat[start:], torch.zeros(8))


def test_tables_are_kept_per_set_of_addresses():
    srcs = [torch.randn(10), torch.randn(3, 3)]
    dsts = [torch.empty(10, dtype=torch.bfloat16), torch.empty(3, 3, dtype=torch.bfloat16)]
    triton_multi_copy._TABLES.clear()
    multi_copy(dsts, srcs, backend="triton")
    srcs[0].mul_(2)  # same addresses, new values: the kept table copies them
    multi_copy(dsts, srcs, backend="triton")
    assert len(triton_multi_copy._TABLES) == 1 and torch.equal(dsts[0], srcs[0].to(torch.bfloat16))
    multi_copy([torch.empty(4, dtype=torch.bfloat16)], [torch.randn(4)], backend="triton")
    assert len(triton_multi_copy._TABLES) == 2


def test_the_reference_and_the_kernel_agree_and_bad_pairs_are_named():
    srcs = [torch.randn(5, 3).t(), torch.randn(9)]
    outs = []
    for backend in ("pytorch", "triton"):
        dsts = [torch.empty(3, 5, dtype=torch.bfloat16), torch.empty(9, dtype=torch.bfloat16)]
        multi_copy(dsts, srcs, backend=backend)
        outs.append(dsts)
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))
    with pytest.raises(ValueError, match="pair 1: destination \\(8,\\) and source \\(9,\\) differ"):
        multi_copy([torch.empty(3, 5), torch.empty(8)], srcs)
    with pytest.raises(ValueError, match="as many sources as destinations"):
        multi_copy([torch.empty(3)], [])


def test_float32_to_bf16_rounds_as_torch_on_special_values():
    """Ties go to even, overflow to infinity, NaN stays NaN, signed zeros and subnormals keep their bits."""
    halfway = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8)])  # exactly between two bf16 values
    special = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 3.4e38, -3.4e38, 1e-40, -1e-40, 2**-126])
    src = torch.cat([halfway, special, torch.randn(5000) * 1e3])
    dst, nan = torch.empty_like(src, dtype=torch.bfloat16), torch.empty(1, dtype=torch.bfloat16)
    multi_copy([dst, nan], [src, torch.tensor([float("nan")])], backend="triton")
    assert torch.equal(dst.view(torch.int16), src.to(torch.bfloat16).view(torch.int16))
    assert torch.isnan(nan).all()
