"""The multi-tensor AdamW (:func:`kernels.multi_adamw`) against its reference and against ``torch.optim.AdamW``:
float32 and bf16 gradients (some transposed), tensors of every size around the block, copies written in the same
pass, in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from kernels import multi_adamw
from kernels.triton import adamw as triton_adamw

BLOCK = triton_adamw.BLOCK
SHAPES = [(0,), (1,), (3, 5), (BLOCK,), (BLOCK + 1,), (2, BLOCK + 7), (4, 3, 2)]
HYPER = {"lr": 3e-3, "betas": (0.9, 0.98), "eps": 1e-8, "weight_decay": 0.1}


def _state(shapes, grad_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g) for s in shapes]
    grads = [torch.randn(s, generator=g).to(grad_dtype) for s in shapes]
    moments = [torch.rand(s, generator=g) * 0.1 for s in shapes]
    squares = [torch.rand(s, generator=g) * 0.01 for s in shapes]
    return params, grads, moments, squares


def _clone(tensors):
    return [t.clone() for t in tensors]


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_copies", [False, True])
def test_triton_matches_the_reference_for_every_size(grad_dtype, with_copies):
    params, grads, moments, squares = _state(SHAPES, grad_dtype, seed=0)
    ref = [_clone(params), grads, _clone(moments), _clone(squares)]
    copies = [torch.full(s, 7.0, dtype=torch.bfloat16) for s in SHAPES] if with_copies else None
    ref_copies = [c.clone() for c in copies] if with_copies else None
    multi_adamw(params, grads, moments, squares, copies=copies, step=3, backend="triton", **HYPER)
    multi_adamw(*ref, copies=ref_copies, step=3, backend="pytorch", **HYPER)
    for i, shape in enumerate(SHAPES):
        for name, got, want in (("param", params[i], ref[0][i]), ("exp_avg", moments[i], ref[2][i]),
                                ("exp_avg_sq", squares[i], ref[3][i])):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=lambda m, n=name, s=shape: f"{n} {s}: {m}")
        if with_copies:
            # The copy is the updated parameter rounded to bf16, as a cast rounds it.
            assert torch.equal(copies[i], params[i].to(torch.bfloat16)), f"copy {shape}"


def test_gradients_laid_out_otherwise_than_their_parameters():
    """A transposed 2-D gradient goes through the strided path, a permuted 3-D one through the reference; the
    result is the update with the gradient read in the parameter's order."""
    g = torch.Generator().manual_seed(1)
    shapes = [(5, 7), (2, BLOCK + 3), (4, 5, 3)]
    grads = [torch.randn(7, 5, generator=g).to(torch.bfloat16).t(),
             torch.randn(BLOCK + 3, 2, generator=g).to(torch.bfloat16).t(),
             torch.randn(3, 4, 5, generator=g).to(torch.bfloat16).permute(1, 2, 0)]
    assert not any(t.is_contiguous() for t in grads)
    params, _, moments, squares = _state(shapes, torch.float32, seed=2)
    ref = [_clone(params), [t.contiguous() for t in grads], _clone(moments), _clone(squares)]
    multi_adamw(params, grads, moments, squares, step=1, backend="triton", **HYPER)
    multi_adamw(*ref, step=1, backend="pytorch", **HYPER)
    for got, want in zip(params + moments + squares, ref[0] + ref[2] + ref[3], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_steps_follow_torch_adamw():
    """Ten steps of both backends from zero moments against ``torch.optim.AdamW`` on the same gradients, the
    step counter's bias corrections included."""
    g = torch.Generator().manual_seed(3)
    shapes = [(33, 17), (BLOCK + 5,)]
    start = [torch.randn(s, generator=g) for s in shapes]
    torch_params = [torch.nn.Parameter(t.clone()) for t in start]
    optimizer = torch.optim.AdamW(torch_params, **HYPER)
    runs = {b: ([t.clone() for t in start], [torch.zeros(s) for s in shapes], [torch.zeros(s) for s in shapes])
            for b in ("triton", "pytorch")}
    for step in range(1, 11):
        grads = [torch.randn(s, generator=g) for s in shapes]
        for p, grad in zip(torch_params, grads, strict=True):
            p.grad = grad.clone()
        optimizer.step()
        for backend, (params, moments, squares) in runs.items():
            multi_adamw(params, grads, moments, squares, step=step, backend=backend, **HYPER)
    for backend, (params, moments, _) in runs.items():
        for got, want, m in zip(params, torch_params, moments, strict=True):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6, msg=lambda s, b=backend: f"{b}: {s}")
            torch.testing.assert_close(m, optimizer.state[want]["exp_avg"], rtol=1e-5, atol=1e-7)


def test_tables_are_kept_per_set_of_addresses():
    params, grads, moments, squares = _state([(10,), (3, 3)], torch.float32, seed=4)
    triton_adamw._TABLES.clear()
    multi_adamw(params, grads, moments, squares, step=1, backend="triton", **HYPER)
    multi_adamw(params, grads, moments, squares, step=2, backend="triton", **HYPER)
    assert len(triton_adamw._TABLES) == 1
    # Copies are a second set of addresses (and another launch variant).
    copies = [torch.empty(10, dtype=torch.bfloat16), torch.empty(3, 3, dtype=torch.bfloat16)]
    multi_adamw(params, grads, moments, squares, copies=copies, step=3, backend="triton", **HYPER)
    assert len(triton_adamw._TABLES) == 2 and torch.equal(copies[1], params[1].to(torch.bfloat16))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"step": 0}, "step counts from 1"),
        ({"grads": "short"}, "2 params but 1 grads"),
        ({"exp_avgs": "half"}, "tensor 0: exp_avg is torch.bfloat16"),
        ({"copies": "wrong_shape"}, "tensor 1: copy (2,) and param (3, 3) differ"),
    ],
)
def test_bad_arguments_get_one_line_errors(change, message):
    params, grads, moments, squares = _state([(10,), (3, 3)], torch.float32, seed=5)
    kwargs = {"grads": grads, "exp_avgs": moments, "copies": None, "step": 1}
    if change.get("grads") == "short":
        kwargs["grads"] = grads[:1]
    elif change.get("exp_avgs") == "half":
        kwargs["exp_avgs"] = [m.to(torch.bfloat16) for m in moments]
    elif change.get("copies") == "wrong_shape":
        kwargs["copies"] = [None, torch.empty(2, dtype=torch.bfloat16)]
    else:
        kwargs.update(change)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        multi_adamw(params, kwargs["grads"], kwargs["exp_avgs"], squares, copies=kwargs["copies"],
                    step=kwargs["step"], backend="pytorch", **HYPER)


def test_bench_adamw_times_every_variant_and_lists_what_the_profiler_saw(tmp_path):
    """``experiments.bench_adamw`` on CPU (the Triton kernel in the interpreter): every variant timed ``--repeats``
    times, and the profiled call's work listed."""
    import json

    from experiments import bench_adamw

    out = tmp_path / "adamw.json"
    assert bench_adamw.main(["--sizes", "10,2049,3", "--repeats", "2", "--backend", "triton", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["values"] == 2062 and result["tensors"] == 3 and result["device"] == "cpu"
    assert set(result["variants"]) == {"multi_adamw_bf16_grads_copies", "multi_adamw_float32", "torch_fused_adamw"}
    assert all(len(v["ms_all"]) == 2 and v["ms_median"] > 0 for v in result["variants"].values())
    assert result["profiled"] and all(e["ms"] > 0 for e in result["profiled"])
    assert bench_adamw.main(["--scale", "0"]) == 2
