"""The attention's compact grid: the work list against the full grid's programs, and the kernels on both grids."""

from __future__ import annotations

import os

import pytest
import torch

from kernels import jagged_attention, settings
from kernels.triton import per_batch as per_batch_module
from kernels.triton.per_batch import per_batch
from kernels.triton.work_list import build_work_list, compact_programs


def full_grid(lengths: list[int], order: list[int], heads: int, block: int, descending: bool) -> list[tuple]:
    """``(sequence, head, block)`` of every program of the full grid that holds rows, in launch order."""
    blocks = -(-max(lengths) // block)
    owned = []
    for pid in range(len(lengths) * heads * blocks):
        rank, index = divmod(pid, blocks)
        if descending:
            index = blocks - 1 - index
        sequence, head = order[rank // heads], rank % heads
        if index * block < lengths[sequence]:
            owned.append((sequence, head, index))
    return owned


@pytest.mark.parametrize("descending", [True, False])
@pytest.mark.parametrize("lengths", [[70, 0, 5, 33, 5, 5, 1, 17], [4, 4, 4], [0, 0, 9], [128, 3]])
def test_the_work_list_holds_the_full_grids_programs_with_rows_in_order(lengths, descending):
    heads, block = 3, 16
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    order = torch.argsort(torch.tensor(lengths), descending=True, stable=True).to(torch.int32)
    programs = -(-sum(lengths) // block) + len(lengths)
    work = build_work_list(offsets, order, heads, block, programs, descending, "test_work")
    assert work.shape == (heads * programs, 2) and work.dtype == torch.int32
    pairs = [tuple(row) for row in work.tolist()]
    want = full_grid(lengths, order.tolist(), heads, block, descending)
    got = [(sh // heads, sh % heads, index) for sh, index in pairs[: len(want)]]
    assert got == want
    # The rest start past every sequence, so they return at once.
    assert all(index * block >= 1 << 29 for _, index in pairs[len(want) :])


def test_the_compact_grid_is_used_only_where_it_has_fewer_programs():
    assert compact_programs(total_rows=16_704, batch=64, max_rows=4_101, block=64) == 261 + 64
    # One full-length sequence: the full grid is no larger.
    assert compact_programs(total_rows=4_101, batch=1, max_rows=4_101, block=64) is None
    assert compact_programs(total_rows=16, batch=4, max_rows=4, block=16) is None


def test_the_work_list_is_built_once_per_batch_and_pass():
    offsets = torch.tensor([0, 5, 40])
    order = torch.tensor([1, 0], dtype=torch.int32)
    first = build_work_list(offsets, order, 2, 16, 5, True, "test_once")
    assert build_work_list(offsets, order, 2, 16, 5, True, "test_once") is first
    assert build_work_list(offsets, order, 2, 32, 4, True, "test_once") is not first
    assert per_batch("test_once", (offsets, order), lambda: None, extra=(2, 16, 5, True)) is first


def per_batch_slots(name: str) -> list:
    return per_batch_module._LAST.get(name, [])


@pytest.fixture
def compact_switch():
    saved = os.environ.get("GEM_KERNELS_COMPACT_GRID")
    yield
    if saved is None:
        os.environ.pop("GEM_KERNELS_COMPACT_GRID", None)
    else:
        os.environ["GEM_KERNELS_COMPACT_GRID"] = saved


@pytest.mark.parametrize("activation", ["silu", "softmax"])
def test_the_kernels_give_the_full_grids_results_on_the_compact_grid(compact_switch, activation):
    """Heavy-tailed rows and rows of targets only (a padded batch): outputs and every gradient as on the full grid
    (the table gradients up to the order of their float atomics)."""
    gen = torch.Generator().manual_seed(0)
    lengths = [70, 0, 5, 33, 5, 5, 1, 17]
    heads, dim = 2, 16
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, dim, generator=gen).requires_grad_(True) for _ in range(3))
    pos = (0.1 * torch.randn(heads, 9, generator=gen)).requires_grad_(True)
    time = (0.1 * torch.randn(heads, 32, generator=gen)).requires_grad_(True)
    times = torch.randint(0, 3000, (total,), generator=gen).cumsum(0)
    targets = torch.tensor([min(5, n) for n in lengths])
    leaves = (q, k, v, pos, time)

    def run(flag: str) -> list[torch.Tensor]:
        os.environ["GEM_KERNELS_COMPACT_GRID"] = flag
        for x in leaves:
            x.grad = None
        out = jagged_attention(q, k, v, offsets, max(lengths), activation=activation, causal=True,
                               num_targets=targets, pos_bias=pos, time_bias=time, timestamps=times, backend="triton")
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
        return [out.detach(), *(x.grad for x in leaves)]

    full, compact = run("0"), run("1")
    assert settings.compact_grid()
    # Each pass launched on its compact grid (its work list was built for these offsets).
    for slot in ("work_fwd", "work_dq", "work_dkdv"):
        assert any(key[1][0] is offsets for key, _ in per_batch_slots(slot)), slot
    for name, a, b in zip(("out", "dq", "dk", "dv"), full, compact, strict=False):
        assert torch.equal(a, b), name
    for name, a, b in zip(("position table", "time table"), full[4:], compact[4:], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=name)
