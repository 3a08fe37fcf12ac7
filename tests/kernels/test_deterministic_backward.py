"""``GEM_KERNELS_DETERMINISTIC=1``: the Triton backward (interpreted on CPU) without float atomics (the
attention's bias tables, the LayerNorm's totals).

On a GPU, atomics add in the order programs and threads happen to run, so two identical backward passes can
differ in their last bits; the interpreter runs programs one after another, so a plain rerun here would
always agree. These tests instead run the grid's programs in reverse order, which changes the atomic
path's sums and must not change the deterministic ones, and count the atomics the interpreter executes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from triton.runtime import interpreter

from kernels import jagged_attention, residual_layer_norm, silu_split
from kernels.triton import jagged_attention as triton_backend
from kernels.triton import layer_norm as triton_ln
from kernels.triton import silu_split as triton_split
from kernels.triton.bias_rows import BiasGradRows, sum_position_rows

LEAVES = ("q", "k", "v", "pos_bias", "time_bias")
REPO = Path(__file__).resolve().parents[2]
# The biased dQ kernel compiled for sm_90 by Triton's own toolchain (no GPU needed; outside the interpreter);
# prints the float atomics (``atom``/``red``) of its PTX.
COUNT_PTX_ATOMICS = """
import re, sys, triton
from experiments.kernel_sass import compile_sm90
from kernels.triton.jagged_attention import _bwd_dq_kernel
det = sys.argv[1] == "1"
constexprs = dict(ACT=1, CAUSAL=True, HAS_TARGETS=True, HAS_WINDOW=False, HAS_PB=True, HAS_TB=True, FAST=True,
                  PTX=True, DQK=64, DV=64, BLOCK_DQK=64, BLOCK_DV=64, BLOCK_M=64, BLOCK_N=32, DETERMINISTIC=det,
                  BLOCK_T=128 if det else 16, SPLIT=True, TILE_Q=64, TILE_K=64)
config = triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=2)
ptx = compile_sm90(_bwd_dq_kernel, constexprs, config).asm["ptx"]
print(len(re.findall(r"\\b(?:atom|red)\\.[a-z.]*f32", ptx)))
"""


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)


def _batch(lengths, seed, *, pos, time, table_rows=2, ordered_times=True):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    leaves = {name: torch.randn(total, 2, 16, generator=g) for name in ("q", "k", "v")}
    leaves["pos_bias"] = torch.randn(table_rows, pos, generator=g)
    leaves["time_bias"] = torch.randn(table_rows, time, generator=g)
    times = torch.randint(0, 5000, (total,), generator=g)
    timestamps = times.cumsum(0) if ordered_times else times * 97
    upstream = torch.randn(total, 2, 16, generator=g)
    return dict(leaves=leaves, timestamps=timestamps, offsets=_offsets(lengths), max_len=max(lengths),
                upstream=upstream)


def _grads(b, backend, **options):
    """Output and the leaves' gradients of ``<out, upstream>``."""
    leaves = {name: x.clone().requires_grad_(True) for name, x in b["leaves"].items()}
    out = jagged_attention(
        leaves["q"], leaves["k"], leaves["v"], b["offsets"], b["max_len"], pos_bias=leaves["pos_bias"],
        time_bias=leaves["time_bias"], timestamps=b["timestamps"], backend=backend, **options,
    )
    (out * b["upstream"]).sum().backward()
    return [out.detach()] + [leaves[name].grad for name in LEAVES]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


@pytest.fixture
def programs_in_reverse(monkeypatch):
    """The interpreter runs the grid's programs last to first (``program_id`` is all a program knows of it)."""
    builder = interpreter.interpreter_builder
    real = builder.set_grid_idx

    def reversed_idx(x, y, z):
        real(builder.grid_dim[0] - 1 - x, y, z)

    def reverse():
        monkeypatch.setattr(builder, "set_grid_idx", reversed_idx)

    return reverse


@pytest.mark.parametrize(
    "case",
    [
        # Targets, times out of order (buckets change at every key), a position table shorter than the rows.
        dict(activation="silu", causal=True, targets=[2, 1, 0, 5], pos=11, time=30, ordered_times=False),
        # No causal mask (negative distances), a window, a shared table longer than the rows.
        dict(activation="softmax", causal=False, targets=[0, 1, 0, 3], window=7, pos=64, time=9, table_rows=1),
    ],
    ids=["causal-targets", "bidirectional-window-shared"],
)
def test_deterministic_gradients_equal_the_atomic_path_and_the_reference(case, monkeypatch):
    case = dict(case)
    lengths = [37, 1, 0, 22]
    b = _batch(lengths, 3, pos=case.pop("pos"), time=case.pop("time"), table_rows=case.pop("table_rows", 2),
               ordered_times=case.pop("ordered_times", True))
    targets = torch.tensor(case.pop("targets"))
    options = dict(case, num_targets=targets)
    want = _grads(b, "pytorch", **options)
    monkeypatch.setenv("GEM_KERNELS_DETERMINISTIC", "0")
    atomic = _grads(b, "triton", **options)
    monkeypatch.setenv("GEM_KERNELS_DETERMINISTIC", "1")
    got = _grads(b, "triton", **options)
    for name, g, a, w in zip(("out", *LEAVES), got, atomic, want, strict=True):
        assert _rel(g, a) < 1e-5, f"{name}: deterministic vs atomic {_rel(g, a):.2e}"
        assert _rel(g, w) < 1e-4, f"{name}: deterministic vs reference {_rel(g, w):.2e}"


def test_deterministic_backward_does_not_depend_on_the_order_programs_run(programs_in_reverse, monkeypatch):
    """With one shared accumulator every program's atomics hit the same entries, so reversing the programs
    changes the atomic path's table gradients; the deterministic path's rows are summed in a fixed order."""
    monkeypatch.setattr(triton_backend, "_MAX_BIAS_GRAD_REPLICAS", 1)
    b = _batch([37, 1, 0, 22, 17], 5, pos=9, time=20)
    options = dict(activation="silu", causal=True, num_targets=torch.tensor([2, 1, 0, 5, 0]))
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("GEM_KERNELS_DETERMINISTIC", flag)
        runs[flag] = _grads(b, "triton", **options)
    programs_in_reverse()
    for flag in ("0", "1"):
        monkeypatch.setenv("GEM_KERNELS_DETERMINISTIC", flag)
        runs[flag + "-reversed"] = _grads(b, "triton", **options)
    tables = slice(4, 6)
    assert not all(torch.equal(a, r) for a, r in zip(runs["0"][tables], runs["0-reversed"][tables], strict=True))
    for name, a, r in zip(("out", *LEAVES), runs["1"], runs["1-reversed"], strict=True):
        assert torch.equal(a, r), f"deterministic {name} changed with the program order"


def test_deterministic_backward_runs_no_atomics(monkeypatch):
    builder = interpreter.interpreter_builder
    real = builder.create_atomic_rmw
    count = {"atomics": 0}

    def counting(*args, **kwargs):
        count["atomics"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(builder, "create_atomic_rmw", counting)
    b = _batch([20, 1, 9], 7, pos=6, time=12)
    options = dict(activation="softmax", causal=True, num_targets=torch.tensor([3, 0, 1]))
    monkeypatch.setenv("GEM_KERNELS_DETERMINISTIC", "0")
    _grads(b, "triton", **options)
    assert count["atomics"] > 0
    count["atomics"] = 0
    monkeypatch.setenv("GEM_KERNELS_DETERMINISTIC", "1")
    _grads(b, "triton", **options)
    assert count["atomics"] == 0


@pytest.mark.parametrize("size", [1, 2, 5, 40])
def test_position_rows_fold_every_signed_distance_into_its_clamped_entry(size):
    """Rows by ``e = offset + d`` (history half: any sign; target half: d >= 1) -> entry ``min(|d|, size - 1)``,
    per head of an ``[H, P]`` table and over all heads of a shared ``[1, P]`` one."""
    g = torch.Generator().manual_seed(size)
    heads, blocks, offset, width = 2, 3, 7, 20
    position = torch.randn(2 * heads * blocks, 2, width, generator=g)
    position[:, 1, : offset + 1] = 0.0
    rows = BiasGradRows(position=position, time=None, offset=offset, blocks=blocks)
    entry = (torch.arange(width) - offset).abs().clamp(max=size - 1)
    per_head = position.view(2, heads, blocks, 2, width).sum(dim=(0, 2, 3)).double()
    want = torch.zeros(heads, size, dtype=torch.float64).index_add_(1, entry, per_head)
    torch.testing.assert_close(sum_position_rows(rows, heads, heads, size).double(), want, rtol=1e-5, atol=1e-5)
    shared = sum_position_rows(rows, heads, 1, size).double()
    torch.testing.assert_close(shared, want.sum(0, keepdim=True), rtol=1e-5, atol=1e-5)


def _ptx_atomics(deterministic: bool) -> int:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(REPO), TRITON_DEFAULT_FP_FUSION="1")
    done = subprocess.run([sys.executable, "-c", COUNT_PTX_ATOMICS, "1" if deterministic else "0"], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.split()[-1])


def test_deterministic_dq_kernel_compiles_for_sm90_without_float_atomics():
    """What runs on the GPU: the biased dQ kernel's PTX (its table gradients use inline-PTX reductions there,
    which the interpreter never runs) has float atomics on the default path and none when deterministic."""
    assert _ptx_atomics(False) > 0
    assert _ptx_atomics(True) == 0


def _layer_norm_grads(seed: int) -> list[torch.Tensor]:
    """Every gradient of a residual LayerNorm with a branch bias (the teacher's), through the Triton backward with
    37 programs: two full groups of ``BWD_GROUP`` and a short one, whose sums meet in the totals."""
    g = torch.Generator().manual_seed(seed)
    tokens, n = 203, 72
    leaves = [torch.randn(tokens, n, generator=g), torch.randn(tokens, n, generator=g),
              0.5 * torch.randn(n, generator=g), 1 + 0.3 * torch.randn(n, generator=g), 0.2 * torch.randn(n, generator=g)]
    leaves = [t.requires_grad_(True) for t in leaves]
    x, branch, branch_bias, weight, bias = leaves
    total, normed = residual_layer_norm(x, branch, weight, bias, 1e-5, branch_bias=branch_bias, backend="triton")
    ((total * torch.randn(tokens, n, generator=g)).sum() + (normed * torch.randn(tokens, n, generator=g)).sum()).backward()
    return [t.grad for t in leaves]


def test_layer_norm_totals_by_atomics_or_in_order_match_and_only_the_ordered_ignore_the_program_order(
    programs_in_reverse, monkeypatch
):
    """The LayerNorm backward's weight, bias and branch-bias gradients: each group's sum added into the totals by
    float atomics (default), or stored per group and summed in group order (``GEM_KERNELS_DETERMINISTIC=1``). Both
    agree; with the programs run last to first the groups finish in another order, and the deterministic totals stay
    bitwise the same."""
    monkeypatch.setattr(triton_ln, "_num_programs", lambda m, device: 37)
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("GEM_KERNELS_DETERMINISTIC", flag)
        runs[flag] = _layer_norm_grads(5)
    programs_in_reverse()
    monkeypatch.setenv("GEM_KERNELS_DETERMINISTIC", "1")
    reversed_run = _layer_norm_grads(5)
    names = ("x", "branch", "branch_bias", "weight", "bias")
    for name, a, d, r in zip(names, runs["0"], runs["1"], reversed_run, strict=True):
        assert _rel(a, d) < 1e-6, f"{name}: atomic vs ordered totals {_rel(a, d):.2e}"
        assert torch.equal(d, r), f"deterministic {name} changed with the program order"


def test_modulation_row_sums_of_several_chunks_do_not_depend_on_the_order_programs_run(programs_in_reverse,
                                                                                         monkeypatch):
    """The PFFN modulation's backward: a row cut into chunks (here of 4 tokens) has its sums added by whichever of
    its chunks finishes last, always in chunk order, so running the programs last to first changes no bit."""
    from kernels import jagged_silu_modulate
    from kernels.triton import row_modulate

    monkeypatch.setattr(row_modulate, "BLOCK_L", 4)
    monkeypatch.setattr(row_modulate, "CHUNK_TILES", 1)

    def grads() -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(9)
        lengths = [37, 0, 5, 22]
        rows = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        leaves = [torch.randn(rows.numel(), 24, generator=g), torch.randn(4, 24, generator=g),
                  torch.randn(4, 24, generator=g), torch.randn(24, generator=g)]
        leaves = [t.requires_grad_(True) for t in leaves]
        h, scale, shift, bias = leaves
        out = jagged_silu_modulate(h, scale, shift, rows, bias=bias, scale_offset=1.0, backend="triton")
        (out * torch.randn(out.shape, generator=g)).sum().backward()
        return [t.grad for t in leaves]

    forward = grads()
    programs_in_reverse()
    for name, a, r in zip(("h", "scale", "shift", "bias"), forward, grads(), strict=True):
        assert torch.equal(a, r), f"{name} changed with the program order"


def _silu_split_bias_grad() -> torch.Tensor:
    g = torch.Generator().manual_seed(4)
    h = torch.randn(77, 50, generator=g, requires_grad=True)
    bias = torch.randn(50, generator=g, requires_grad=True)
    parts = silu_split(h, [20, 17, 13], bias=bias, backend="triton")
    sum((p * torch.randn(p.shape, generator=g)).sum() for p in parts).backward()
    return bias.grad


def test_silu_split_bias_totals_by_atomics_or_in_order_match_and_only_the_ordered_ignore_the_program_order(
    programs_in_reverse, monkeypatch
):
    """The SiLU split's bias gradient: row tiles' column sums added up by the last tile of each group to finish,
    into the totals by float atomics or stored per group and summed in group order. Both agree; with the programs
    run last to first the deterministic totals stay bitwise the same."""
    monkeypatch.setattr(triton_split, "BLOCK_M", 4)
    monkeypatch.setattr(triton_split, "BLOCK_N", 16)
    monkeypatch.setattr(triton_split, "GROUP", 3)
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("GEM_KERNELS_DETERMINISTIC", flag)
        runs[flag] = _silu_split_bias_grad()
    programs_in_reverse()
    monkeypatch.setenv("GEM_KERNELS_DETERMINISTIC", "1")
    assert _rel(runs["0"], runs["1"]) < 1e-6
    assert torch.equal(runs["1"], _silu_split_bias_grad()), "deterministic bias gradient changed with the program order"
