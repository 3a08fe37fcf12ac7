"""The lazy row AdamW of embedding tables (:func:`kernels.row_adamw`) and the row sums of their sparse gradients
(:func:`kernels.sum_rows`): the Triton kernels against their references and the row AdamW against
``torch.optim.SparseAdam`` over several steps, repeated rows, rows wider than a block, bf16 gradient rows, in
Triton's interpreter; untouched rows never move."""

from __future__ import annotations

import pytest
import torch

from kernels import row_adamw, sum_rows

HYPER = {"lr": 3e-3, "betas": (0.9, 0.98), "eps": 1e-8}


def _table(rows: int, dim: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, dim, generator=g), torch.rand(rows, dim, generator=g) * 0.1,
            torch.rand(rows, dim, generator=g) * 0.01]


@pytest.mark.parametrize("dim", [8, 24, 640], ids=["narrow", "not_a_power_of_two", "two_blocks"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_the_reference_and_leaves_other_rows_alone(dim, grad_dtype):
    g = torch.Generator().manual_seed(1)
    ids = torch.tensor([5, 2, 5, 9, 0, 5, 2, 13])  # 5 three times, 2 twice; rows 1, 3-4, 6-8, 10-12, 14-15 untouched
    grads = torch.randn(ids.numel(), dim, generator=g).to(grad_dtype)
    kernel, ref = _table(16, dim, seed=0), _table(16, dim, seed=0)
    before = [t.clone() for t in kernel]
    row_adamw(*kernel, ids, grads, weight_decay=0.1, step=4, backend="triton", **HYPER)
    row_adamw(*ref, ids, grads, weight_decay=0.1, step=4, backend="pytorch", **HYPER)
    touched = torch.zeros(16, dtype=torch.bool)
    touched[ids] = True
    for name, k, r, b in zip(("param", "exp_avg", "exp_avg_sq"), kernel, ref, before, strict=True):
        torch.testing.assert_close(k, r, rtol=1e-6, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")
        assert torch.equal(k[~touched], b[~touched]), f"{name}: an untouched row moved"
        assert not torch.equal(k[touched], b[touched]), f"{name}: the touched rows did not move"


@pytest.mark.parametrize("backend", ["triton", "pytorch"])
def test_steps_match_torch_sparse_adam(backend):
    """Without weight decay the update is torch.optim.SparseAdam's, step after step, on an embedding's own sparse
    gradients (repeated ids, rows some steps do not touch)."""
    torch.manual_seed(0)
    ours = torch.nn.Embedding(20, 12, sparse=True)
    theirs = torch.nn.Embedding(20, 12, sparse=True)
    theirs.weight.data.copy_(ours.weight.data)
    optimizer = torch.optim.SparseAdam(theirs.parameters(), **HYPER)
    exp_avg, exp_avg_sq = torch.zeros_like(ours.weight), torch.zeros_like(ours.weight)
    for step, ids in enumerate([[1, 4, 4, 7], [4, 9, 1, 1, 1], [19, 0], [7, 4]], start=1):
        ids = torch.tensor(ids)
        target = torch.randn(ids.numel(), 12)
        for table in (ours, theirs):
            table.zero_grad(set_to_none=True)
            ((table(ids) - target) ** 2).sum().backward()
        grad = ours.weight.grad
        with torch.no_grad():
            row_adamw(ours.weight, exp_avg, exp_avg_sq, grad._indices()[0], grad._values(), weight_decay=0.0,
                      step=step, backend=backend, **HYPER)
        optimizer.step()
        torch.testing.assert_close(ours.weight, theirs.weight, rtol=1e-5, atol=1e-6, msg=f"step {step}")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"param": torch.zeros(4, 3, dtype=torch.float64)}, "contiguous float32"),
        ({"exp_avg": torch.zeros(4, 2)}, "exp_avg must be contiguous float32"),
        ({"rows": torch.zeros(2, 1, dtype=torch.int64)}, "1-D integer ids"),
        ({"grad_rows": torch.zeros(3, 3)}, r"grad_rows \(3, 3\), expected \(2, 3\)"),
        ({"step": 0}, "step counts from 1"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(change, message):
    args = {"param": torch.zeros(4, 3), "exp_avg": torch.zeros(4, 3), "exp_avg_sq": torch.zeros(4, 3),
            "rows": torch.tensor([0, 2]), "grad_rows": torch.zeros(2, 3), "step": 1, **change}
    with pytest.raises(ValueError, match=message):
        row_adamw(**args, weight_decay=0.0, backend="pytorch", **HYPER)


def test_a_row_repeated_across_many_chunks_is_summed_once():
    """A row named by most entries (as the padding tokens' id is), its run crossing several of the kernel's chunks
    of sorted entries, and an entry count that is no multiple of a chunk: the same step as the reference."""
    from kernels.triton.adamw import SUM_CHUNK

    g = torch.Generator().manual_seed(2)
    n = 3 * SUM_CHUNK + 5
    ids = torch.randint(0, 40, (n,), generator=g)
    ids[torch.rand(n, generator=g) < 0.7] = 3
    grads = torch.randn(n, 16, generator=g)
    kernel, ref = _table(40, 16, seed=3), _table(40, 16, seed=3)
    row_adamw(*kernel, ids, grads, weight_decay=0.0, step=2, backend="triton", **HYPER)
    row_adamw(*ref, ids, grads, weight_decay=0.0, step=2, backend="pytorch", **HYPER)
    assert int((ids == 3).sum()) > 2 * SUM_CHUNK
    for k, r in zip(kernel, ref, strict=True):
        torch.testing.assert_close(k, r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["triton", "pytorch"])
@pytest.mark.parametrize("values_dtype", [torch.float32, torch.bfloat16])
def test_row_sums_are_the_dense_gradient_rows_in_row_order(backend, values_dtype):
    """:func:`kernels.sum_rows` of an embedding's sparse gradient: its distinct rows' sums in ascending row order
    (as the dense gradient's non-zero rows), then zeros; a row named across several chunks, a count that is no
    multiple of one, int32 ids."""
    from kernels.triton.adamw import SUM_CHUNK

    g = torch.Generator().manual_seed(4)
    n = 2 * SUM_CHUNK + 7
    ids = torch.randint(0, 30, (n,), generator=g)
    ids[torch.rand(n, generator=g) < 0.6] = 11
    values = torch.randn(n, 20, generator=g).to(values_dtype)
    dense = torch.zeros(30, 20).index_add_(0, ids, values.float())
    named = torch.unique(ids)
    sums = sum_rows(ids.to(torch.int32), values, backend=backend)
    assert sums.shape == (n, 20) and sums.dtype == torch.float32
    torch.testing.assert_close(sums[: named.numel()], dense[named], rtol=1e-5, atol=1e-5)
    assert torch.equal(sums[named.numel():], torch.zeros(n - named.numel(), 20))


def test_row_sums_of_no_entries_and_bad_shapes():
    assert sum_rows(torch.zeros(0, dtype=torch.int64), torch.zeros(0, 4), backend="triton").shape == (0, 4)
    with pytest.raises(ValueError, match=r"sum_rows: values \(3, 4\), expected \[2, D\]"):
        sum_rows(torch.tensor([0, 1]), torch.zeros(3, 4), backend="pytorch")
    with pytest.raises(ValueError, match="sum_rows: rows must be 1-D integer ids"):
        sum_rows(torch.tensor([0.0, 1.0]), torch.zeros(2, 4), backend="pytorch")
