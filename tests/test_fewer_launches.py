"""Blocks rewritten to launch fewer copies, casts and reductions (issue 15) compute what their previous
formulation computed: outputs and every gradient, in float32 and under bf16 autocast (with and without
:class:`~foundation.model.precision.CastOnce`), with unchanged parameter names and shapes."""

from __future__ import annotations

import pytest
import torch

from foundation.model.interaction import WukongBlock
from foundation.model.precision import CastOnce


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def wukong_before(block: WukongBlock, x: torch.Tensor) -> torch.Tensor:
    """``[B, n_in, d]`` -> ``[B, n_out, d]``: the block as it was, one contraction per weight."""
    interactions = x @ torch.einsum("bnd,nr->bdr", x, block.projection)
    fm = block.fm_mlp(interactions.flatten(1)).view(x.shape[0], block.n_fm, block.d)
    compressed = torch.einsum("oi,bid->bod", block.compress.weight, x)
    residual = torch.einsum("oi,bid->bod", block.residual.weight, x)
    return block.norm(torch.cat([fm, compressed], dim=1) + residual)


def outputs_and_grads(block: torch.nn.Module, forward, x: torch.Tensor, autocast: bool, cast_once: bool):
    """``(output, input grad, {name: grad})`` of ``forward(x)`` under a fixed random cotangent."""
    x = x.detach().clone().requires_grad_()
    block.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        if cast_once:
            once = CastOnce(block)
            once.run(lambda _: {"loss": forward(x).float().sum()})  # discovery step, discarded
            block.zero_grad(set_to_none=True)
            x.grad = None
            out = once.run(lambda f: {"loss": f(x)})["loss"]
        else:
            out = forward(x)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    out.float().backward(cotangent)
    if cast_once:
        once.collect_grads()
    return out.float(), x.grad, {n: p.grad for n, p in block.named_parameters()}


@pytest.mark.parametrize(("autocast", "cast_once"), [(False, False), (True, False), (True, True)])
def test_wukong_block_equals_its_previous_formulation(autocast, cast_once):
    torch.manual_seed(0)
    block = WukongBlock(7, 6, 16, rank=3, hidden=12, dropout=0.0)
    assert {n: tuple(p.shape) for n, p in block.named_parameters()} == {
        "projection": (7, 3), "fm_mlp.0.weight": (21,), "fm_mlp.0.bias": (21,), "fm_mlp.1.weight": (12, 21),
        "fm_mlp.1.bias": (12,), "fm_mlp.4.weight": (48, 12), "fm_mlp.4.bias": (48,), "compress.weight": (3, 7),
        "residual.weight": (6, 7), "norm.weight": (16,), "norm.bias": (16,),
    }
    x = torch.randn(5, 7, 16)
    new = outputs_and_grads(block, block, x, autocast, cast_once)
    old = outputs_and_grads(block, lambda t: wukong_before(block, t), x, autocast, False)
    tol = {"atol": 2e-2, "rtol": 2e-2} if autocast else {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(new[0], old[0], **tol)
    torch.testing.assert_close(new[1], old[1], **tol)
    for name, grad in old[2].items():
        torch.testing.assert_close(new[2][name], grad, **tol, msg=name)
