"""Check and time the jagged attention kernels on one GPU; print a table, optionally write JSON.

One call does everything: measures the device's bf16 matmul and copy ceilings, checks the bf16
Triton kernels against the float32 reference (every activation and flag, forward and every
gradient, as ``||out - ref|| / ||ref||``, plus a rerun to catch races), then times forward,
backward and forward+backward for self-attention (B=32, H=4, D=128, N in {1024, 4096, 8192};
full, uniform and heavy-tailed lengths; 0 and 20 targets) against the padded PyTorch path (SDPA
for softmax, batched matmul for pointwise) and PyTorch's varlen flash attention, and the
GEM-like cross-attention shapes. TFLOP/s count valid pairs only (``kernels.flops``).
``--ptr`` adds ``triton-ptr`` rows with pointer loads instead of TMA descriptors. Triton rows are
also timed as CUDA-graph replays (``graph``), which leaves out the host's launch cost. Checks and
compiles run first in parallel worker processes. ``--bias`` gives every self-attention row HSTU's
position and time bias tables (no padded or varlen baselines then).

``--teacher`` instead times the ``large`` teacher's attention (H=8, D=128, SiLU, causal, 5 target
tokens, position table [8, 4102], time table [8, 128]) at N=512 and 4,096, biased against unbiased,
forward, backward and both, in one process: bf16 checks against the float32 reference first (each
variant's first call, autotuned or not), then ``--repeats`` rounds of ``do_bench`` medians, and the
biased/unbiased time ratios. ``--write-tuned PATH`` writes the checked-in table
``kernels/triton/tuned_configs.json`` plus the run's autotuner picks to PATH (autotuning on).
``--dtype fp32`` checks and times float32 inputs instead of bf16 (their own tiles, ``kernels/triton/configs.py``).
``--pma`` times the ``large`` teacher's PMA cross-attention (8 seeds per row over heavy-tailed histories of at most
``--teacher-n`` events, ``--pma-tokens`` in all; H=8, D=128) on key chunks against one program per (row, head).
``--device cpu`` runs the same on tiny shapes under ``TRITON_INTERPRET=1`` (a dry run of the
script, not a measurement).

    PYTHONUNBUFFERED=1 python experiments/bench_jagged_attention.py --json bench.json
    PYTHONUNBUFFERED=1 python experiments/bench_jagged_attention.py --teacher --json teacher.json
"""

from __future__ import annotations

import argparse
import datetime
import functools
import inspect
import json
import math
import multiprocessing
import os
import shutil
import statistics
import sys
import time
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from experiments.kernel_groups import profile_calls
from kernels.flops import attention_flops, cross_attention_pairs, valid_pairs
from kernels.pytorch.jagged_attention import (
    jagged_attention as ref_backend,
)
from kernels.pytorch.jagged_attention import (
    jagged_cross_attention as ref_cross_attention,
)
from kernels.pytorch.jagged_attention import (
    pad_jagged,
    self_attention_mask,
)
from kernels.spec import AttentionSpec
from kernels.triton import jagged_attention as triton_backend
from kernels.triton.configs import TUNED_PATH, write_tuned
from kernels.triton.jagged_attention import jagged_cross_attention as tri_cross_attention

DEVICE = "cuda"
DTYPE = torch.bfloat16


def tri_attention(q, k, v, offsets, n, **options):
    """The Triton backend, called directly (no dispatcher checks in the timed path)."""
    return triton_backend.jagged_attention(q, k, v, offsets, n, AttentionSpec(**options))


def ref_attention(q, k, v, offsets, n, **options):
    return ref_backend(q, k, v, offsets, n, AttentionSpec(**options))


def make_lengths(kind: str, batch: int, n: int, gen: torch.Generator) -> list[int]:
    """``full``: all N; ``uniform``: U[1, N]; ``heavy``: log-uniform on [16, N]."""
    if kind == "full":
        return [n] * batch
    if kind == "uniform":
        return torch.randint(1, n + 1, (batch,), generator=gen).tolist()
    u = torch.rand(batch, generator=gen, dtype=torch.float64)
    return torch.exp(math.log(16) + u * (math.log(n) - math.log(16))).round().long().clamp(16, n).tolist()


def offsets_of(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64, device=DEVICE)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def median_ms(fn, grad_to_none=None, rep: int = 100) -> float:
    if DEVICE == "cpu":
        return cpu_median_ms(fn, grad_to_none)
    return do_bench(fn, warmup=25, rep=rep, grad_to_none=grad_to_none, return_mode="median")


def cpu_median_ms(fn, grad_to_none=None) -> float:
    """Wall-clock time of one call: the CPU dry run checks the script, it measures nothing."""
    for x in grad_to_none or []:
        x.grad = None
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def peak_gb(fn) -> float:
    """Peak device memory above what was allocated before ``fn`` ran, in GB."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 1e9


def ceilings() -> dict:
    a = torch.randn(8192, 8192, device=DEVICE, dtype=DTYPE)
    b = torch.randn(8192, 8192, device=DEVICE, dtype=DTYPE)
    mm = median_ms(lambda: a @ b)
    src = torch.randn(512 * 1024 * 1024, device=DEVICE, dtype=torch.float32)
    dst = torch.empty_like(src)
    cp = median_ms(lambda: dst.copy_(src))
    return {"matmul_tflops": 2 * 8192**3 / mm / 1e9, "copy_tbps": 2 * src.numel() * 4 / cp / 1e9}


def leaves(total: int, heads: int, dqk: int, dv: int, gen: torch.Generator):
    def leaf(*shape):
        return torch.randn(*shape, generator=gen, device=DEVICE).to(DTYPE).requires_grad_(True)

    return leaf(total, heads, dqk), leaf(total, heads, dqk), leaf(total, heads, dv)


def fwd_bwd(fn, tensors, upstream_seed: int):
    for x in tensors:
        x.grad = None
    out = fn()
    g = torch.randn(out.shape, generator=torch.Generator(DEVICE).manual_seed(upstream_seed), device=DEVICE).to(out.dtype)
    out.backward(g)
    return [out.detach().clone()] + [x.grad.clone() for x in tensors]


def check_self(name, lengths, heads, dqk, dv, gen, *, pos=0, time=0, **kwargs) -> dict:
    offsets = offsets_of(lengths)
    n = max(lengths)
    q, k, v = leaves(sum(lengths), heads, dqk, dv, gen)
    pb = torch.randn(heads, pos, device=DEVICE, generator=gen).requires_grad_(True) if pos else None
    tb = torch.randn(1, time, device=DEVICE, generator=gen).requires_grad_(True) if time else None
    ts = torch.randint(0, 3000, (sum(lengths),), device=DEVICE, generator=gen).cumsum(0) if time else None
    tensors = [x for x in (q, k, v, pb, tb) if x is not None]
    extra = dict(pos_bias=pb, time_bias=tb, timestamps=ts, **kwargs)
    got = fwd_bwd(lambda: tri_attention(q, k, v, offsets, n, **extra), tensors, 1)
    again = fwd_bwd(lambda: tri_attention(q, k, v, offsets, n, **extra), tensors, 1)
    want = fwd_bwd(lambda: ref_attention(q.float(), k.float(), v.float(), offsets, n, **extra), tensors, 1)
    names = ["out", "dq", "dk", "dv"] + (["dpos"] if pb is not None else []) + (["dtime"] if tb is not None else [])
    errs = {nm: rel_err(a, b) for nm, a, b in zip(names, got, want, strict=True)}
    rerun = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, again, strict=True))
    finite = all(torch.isfinite(a).all().item() for a in got)
    return {"case": name, "errors": errs, "rerun_max_diff": rerun, "finite": finite}


def check_cross(name, q_lens, kv_lens, heads, d, gen, activation) -> dict:
    q_off, kv_off = offsets_of(q_lens), offsets_of(kv_lens)
    q, _, _ = leaves(sum(q_lens), heads, d, d, gen)
    _, k, v = leaves(sum(kv_lens), heads, d, d, gen)
    tensors = [q, k, v]
    args = (q_off, kv_off, max(q_lens), max(kv_lens))
    got = fwd_bwd(lambda: tri_cross_attention(q, k, v, *args, activation=activation), tensors, 2)
    again = fwd_bwd(lambda: tri_cross_attention(q, k, v, *args, activation=activation), tensors, 2)
    want = fwd_bwd(lambda: ref_cross_attention(q.float(), k.float(), v.float(), *args, activation=activation), tensors, 2)
    errs = {nm: rel_err(a, b) for nm, a, b in zip(["out", "dq", "dk", "dv"], got, want, strict=True)}
    rerun = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, again, strict=True))
    return {"case": name, "errors": errs, "rerun_max_diff": rerun, "finite": all(torch.isfinite(a).all().item() for a in got)}


CHECK_LENGTHS = [0, 1, 700, 333, 64, 17, 700, 129]
CHECK_TARGETS = [0, 1, 20, 3, 0, 17, 5, 2]


def check_jobs(ptr: bool = False) -> list[tuple]:
    """Every checked variant: (kind, name, arguments); run in worker processes. ``ptr`` adds the
    kernels with pointer loads instead of TMA descriptors."""
    jobs = []
    if ptr:
        for act in ("softmax", "silu"):
            jobs.append(("self", f"{act} causal D=128 pointer loads",
                         dict(heads=2, dqk=128, dv=128, activation=act, causal=True, ptr=True)))
            jobs.append(("self", f"{act} causal targets+window+pos+time pointer loads",
                         dict(heads=2, dqk=128, dv=128, activation=act, causal=True, targets=True, window=100, pos=64,
                              time=32, ptr=True)))
    for act in ("softmax", "silu", "gelu", "relu", "identity"):
        jobs.append(("self", f"{act} causal D=128", dict(heads=2, dqk=128, dv=128, activation=act, causal=True)))
    for act in ("softmax", "silu"):
        jobs.append(("self", f"{act} non-causal D=64", dict(heads=2, dqk=64, dv=64, activation=act, causal=False)))
        jobs.append(("self", f"{act} causal targets+window+pos+time D=128",
                     dict(heads=2, dqk=128, dv=128, activation=act, causal=True, targets=True, window=100, pos=64, time=32)))
        # The first call of a new tuning key autotunes, as the first training step of every new
        # length bucket does; the trials must not disturb the gradients of that call.
        jobs.append(("self", f"{act} causal targets+window+pos+time autotuned",
                     dict(heads=2, dqk=128, dv=128, activation=act, causal=True, targets=True, window=100, pos=64, time=32,
                          autotune=True)))
        jobs.append(("self", f"{act} causal D=128 autotuned",
                     dict(heads=2, dqk=128, dv=128, activation=act, causal=True, autotune=True)))
        jobs.append(("self", f"{act} causal targets Dqk=96 Dv=80",
                     dict(heads=3, dqk=96, dv=80, activation=act, causal=True, targets=True)))
        jobs.append(("cross", f"cross {act} short-q long-kv", dict(q_lens=[5, 0, 192, 7], kv_lens=[900, 30, 256, 0], heads=4, activation=act)))
        jobs.append(("cross", f"cross {act} long-q short-kv", dict(q_lens=[900, 30, 256], kv_lens=[192, 5, 1], heads=3, activation=act)))
    return jobs


def warm_jobs(acts, targets, heads, dim, cross: bool) -> list[tuple]:
    """Autotuned variants the timing phase will use: compiled ahead, in parallel, into Triton's cache."""
    jobs = [("warm-self", f"{a} tg={t}", dict(activation=a, targets=bool(t), heads=heads, dim=dim)) for a in acts for t in targets]
    if cross:
        jobs += [("warm-cross", f"cross {a} H={h}", dict(activation=a, heads=h)) for a in ("softmax", "silu") for h in (3, 4)]
    return jobs


def run_job(job: tuple) -> dict | None:
    global DTYPE
    kind, name, kw = job
    kw = dict(kw)
    DTYPE = kw.pop("dtype")  # a spawned worker starts from the module's default
    gen = torch.Generator(DEVICE).manual_seed(zlib.crc32(name.encode()))
    if kind == "warm-teacher":
        # The parent's autotuning switch holds: the workers compile what the timed run will use.
        teacher_check(kw["n"], kw["biased"], gen)
        return None
    if kind.startswith("warm"):
        os.environ.pop("GEM_KERNELS_AUTOTUNE", None)
        if kind == "warm-self":
            lengths = [1000, 37, 300, 5]
            offsets = offsets_of(lengths)
            q, k, v = leaves(sum(lengths), kw["heads"], kw["dim"], kw["dim"], gen)
            nt = torch.tensor([20, 20, 20, 5], device=DEVICE) if kw["targets"] else None
            fwd_bwd(lambda: tri_attention(q, k, v, offsets, 1000, activation=kw["activation"], causal=True,
                                          num_targets=nt), [q, k, v], 0)
        else:
            q_off, kv_off = offsets_of([192, 192]), offsets_of([300, 1000])
            q, _, _ = leaves(384, kw["heads"], 128, 128, gen)
            _, k, v = leaves(1300, kw["heads"], 128, 128, gen)
            fwd_bwd(lambda: tri_cross_attention(q, k, v, q_off, kv_off, 192, 1000, activation=kw["activation"]), [q, k, v], 0)
        return None
    # Checks compile one config per variant (autotuning every one would cost minutes), except the
    # autotuned ones. Workers run several jobs, so every switch is set afresh.
    if kw.pop("autotune", False):
        os.environ.pop("GEM_KERNELS_AUTOTUNE", None)
    else:
        os.environ["GEM_KERNELS_AUTOTUNE"] = "0"
    os.environ.pop("GEM_KERNELS_TMA", None)
    if kw.pop("ptr", False):
        os.environ["GEM_KERNELS_TMA"] = "0"
    if kind == "cross":
        return check_cross(name, kw.pop("q_lens"), kw.pop("kv_lens"), kw.pop("heads"), 128, gen, kw.pop("activation"))
    if kw.pop("targets", False):
        kw["num_targets"] = torch.tensor(CHECK_TARGETS, device=DEVICE)
    return check_self(name, CHECK_LENGTHS, kw.pop("heads"), kw.pop("dqk"), kw.pop("dv"), gen, **kw)


def run_parallel(jobs: list[tuple], workers: int) -> list[dict]:
    """Run jobs in spawned processes (at this run's ``DTYPE``): Triton compiles on one core each, and the box has
    many."""
    jobs = [(kind, name, {**kw, "dtype": DTYPE}) for kind, name, kw in jobs]
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers) as pool:
        return [r for r in pool.map(run_job, jobs, chunksize=1) if r is not None]


def padded_self(q, k, v, offsets, n, lengths_t, activation, num_targets):
    """The padded PyTorch path: dense [B, H, N, D] tensors, SDPA or batched matmuls."""
    qp, valid = pad_jagged(q, offsets, n)
    kp, _ = pad_jagged(k, offsets, n)
    vp, _ = pad_jagged(v, offsets, n)
    qp, kp, vp = (x.transpose(1, 2) for x in (qp, kp, vp))
    if num_targets is None:
        mask = None
    else:
        mask = self_attention_mask(lengths_t, n, causal=True, num_targets=num_targets)[0][:, None]
    if activation == "softmax":
        if mask is None:
            out = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask | torch.eye(n, dtype=torch.bool, device=DEVICE))
    else:
        s = (qp @ kp.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
        if mask is None:
            mask = torch.ones(n, n, dtype=torch.bool, device=DEVICE).tril()
        a = torch.where(mask, F.silu(s), 0.0) / n
        out = a @ vp
    return out.transpose(1, 2)[valid]


def varlen_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters

    def call(q, k, v, q_offsets, kv_offsets, max_q, max_kv, causal):
        cq, ck = q_offsets.to(torch.int32), kv_offsets.to(torch.int32)
        if not causal:
            return varlen_attn(q, k, v, cq, ck, max_q, max_kv)
        if "is_causal" in params:
            return varlen_attn(q, k, v, cq, ck, max_q, max_kv, is_causal=True)
        return varlen_attn(q, k, v, cq, ck, max_q, max_kv, window_size=(-1, 0))

    return call


def graph_ms(step, tensors, grad: bool) -> float:
    """Median time of ``step`` replayed from a CUDA graph: the kernels without the host's launch cost."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.set_grad_enabled(grad):
        for _ in range(3):
            for x in tensors:
                x.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    for x in tensors:
        x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.set_grad_enabled(grad):
        step()
    ms = median_ms(graph.replay)
    del graph
    for x in tensors:
        x.grad = None
    return ms


def _forward_backward(fn, upstream):
    fn().backward(upstream)


def time_variants(name_fns: dict, tensors, flops_fwd: float, rep: int) -> list[dict]:
    """Forward, backward and forward+backward of each callable; OOM is reported, not raised."""
    rows = []
    for impl, fn in name_fns.items():
        row = {"impl": impl}
        # "-ptr" rows load tiles with pointer loads instead of TMA descriptors.
        os.environ["GEM_KERNELS_TMA"] = "0" if impl.endswith("-ptr") else "1"
        # The padded path runs ~100 ms a step at N=8192: a few repeats give a stable median.
        rep_ms = 30 if impl == "padded" else rep
        try:
            with torch.no_grad():
                t_f = median_ms(fn, rep=rep_ms)
            out = fn()
            g = torch.randn_like(out)
            t_b = median_ms(lambda out=out, g=g: out.backward(g, retain_graph=True), grad_to_none=tensors, rep=rep_ms)
            del out
            step = functools.partial(_forward_backward, fn, g)
            t_fb = median_ms(step, grad_to_none=tensors, rep=rep_ms)
            for x in tensors:
                x.grad = None
            mem = peak_gb(step)
            if impl.startswith("triton"):
                t_fg = graph_ms(fn, tensors, grad=False)
                t_fbg = graph_ms(step, tensors, grad=True)
                row.update(fwd_graph_ms=t_fg, fwdbwd_graph_ms=t_fbg,
                           fwd_graph_tflops=flops_fwd / t_fg / 1e9, fwdbwd_graph_tflops=flops_fwd * 3.5 / t_fbg / 1e9)
            row.update(
                fwd_ms=t_f, bwd_ms=t_b, fwdbwd_ms=t_fb, peak_gb=mem,
                fwd_tflops=flops_fwd / t_f / 1e9,
                bwd_tflops=flops_fwd * 2.5 / t_b / 1e9,
                fwdbwd_tflops=flops_fwd * 3.5 / t_fb / 1e9,
            )
        except torch.OutOfMemoryError:
            row["error"] = "OOM"
        except RuntimeError as e:
            row["error"] = f"failed: {str(e).splitlines()[0][:100]}"
        for x in tensors:
            x.grad = None
        torch.cuda.empty_cache()
        rows.append(row)
    return rows


def hstu_bias(tokens: int, heads: int, n: int, gen) -> dict:
    """HSTU's relative bias as the teacher uses it: per-head position ``[H, N+1]`` and time ``[H, 64]`` tables."""
    pb = (0.1 * torch.randn(heads, n + 1, device=DEVICE, generator=gen)).requires_grad_(True)
    tb = (0.1 * torch.randn(heads, 64, device=DEVICE, generator=gen)).requires_grad_(True)
    ts = torch.randint(0, 3000, (tokens,), device=DEVICE, generator=gen).cumsum(0)
    return dict(pos_bias=pb, time_bias=tb, timestamps=ts)


def bench_self(ns, kinds, targets, acts, batch, heads, dim, padded: bool, bias: bool, ptr: bool) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    dgen = torch.Generator(DEVICE).manual_seed(1)
    varlen = varlen_fn()
    rows = []
    for n in ns:
        for kind in kinds:
            lengths = make_lengths(kind, batch, n, gen)
            offsets = offsets_of(lengths)
            lengths_t = offsets[1:] - offsets[:-1]
            q, k, v = leaves(sum(lengths), heads, dim, dim, dgen)
            extra = hstu_bias(sum(lengths), heads, n, dgen) if bias else {}
            grad_leaves = [q, k, v] + ([extra["pos_bias"], extra["time_bias"]] if bias else [])
            for n_t in targets:
                num_targets = torch.clamp(lengths_t, max=n_t) if n_t else None
                pairs = valid_pairs(offsets, n, causal=True, num_targets=num_targets)
                flops = attention_flops(pairs, heads, dim, dim)
                for act in acts:
                    tri = functools.partial(tri_attention, q, k, v, offsets, n, activation=act, causal=True,
                                            num_targets=num_targets, **extra)
                    fns = {"triton": tri}
                    if ptr:
                        fns["triton-ptr"] = tri
                    if padded and not bias:
                        fns["padded"] = functools.partial(padded_self, q, k, v, offsets, n, lengths_t, act, num_targets)
                    if act == "softmax" and n_t == 0 and varlen is not None and not bias:
                        fns["torch_varlen"] = functools.partial(varlen, q, k, v, offsets, offsets, n, n, True)
                    rep = 100 if n <= 4096 else 200
                    for row in time_variants(fns, grad_leaves, flops, rep):
                        row.update(op="self+bias" if bias else "self", act=act, N=n, lengths=kind, targets=n_t, B=batch,
                                   H=heads, D=dim, tokens=sum(lengths), pairs=pairs)
                        rows.append(row)
                        print(fmt_row(row), flush=True)
            torch.cuda.empty_cache()
    return rows


def padded_cross(q, k, v, q_off, kv_off, nq, nk):
    """Padded softmax cross-attention through SDPA with a key-padding mask."""
    qp, q_valid = pad_jagged(q, q_off, nq)
    kp, kv_valid = pad_jagged(k, kv_off, nk)
    vp, _ = pad_jagged(v, kv_off, nk)
    qp, kp, vp = (x.transpose(1, 2) for x in (qp, kp, vp))
    mask = kv_valid[:, None, None, :]
    out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask)
    return out.transpose(1, 2)[q_valid]


def bench_cross(batch: int, padded: bool) -> list[dict]:
    gen = torch.Generator().manual_seed(2)
    dgen = torch.Generator(DEVICE).manual_seed(2)
    varlen = varlen_fn()
    rows = []
    shapes = [
        ("short-q long-kv", [192] * batch, torch.randint(256, 1001, (batch,), generator=gen).tolist(), 4),
        ("long-q short-kv", torch.randint(256, 1001, (batch,), generator=gen).tolist(), [192] * batch, 3),
    ]
    for name, q_lens, kv_lens, heads in shapes:
        q_off, kv_off = offsets_of(q_lens), offsets_of(kv_lens)
        nq, nk = max(q_lens), max(kv_lens)
        q, _, _ = leaves(sum(q_lens), heads, 128, 128, dgen)
        _, k, v = leaves(sum(kv_lens), heads, 128, 128, dgen)
        flops = attention_flops(cross_attention_pairs(q_off, kv_off), heads, 128, 128)
        for act in ("softmax", "silu"):
            fns = {"triton": functools.partial(tri_cross_attention, q, k, v, q_off, kv_off, nq, nk, activation=act)}
            if act == "softmax" and padded:
                fns["padded"] = functools.partial(padded_cross, q, k, v, q_off, kv_off, nq, nk)
            if act == "softmax" and varlen is not None:
                fns["torch_varlen"] = functools.partial(varlen, q, k, v, q_off, kv_off, nq, nk, False)
            for row in time_variants(fns, [q, k, v], flops, 100):
                row.update(op="cross", act=act, case=name, B=batch, H=heads, D=128, N=nk, lengths=name, targets=0)
                rows.append(row)
                print(fmt_row(row), flush=True)
    return rows


# The ``large`` teacher's attention (foundation/model/teacher_config.py): 8 heads of 128, SiLU, causal,
# num_cls=4 CLS tokens plus the candidate as targets, 128 time buckets, and HSTU's position table of every distance
# (max_len + num_cls + 2 buckets; the flavor's own since session 38 is ``--teacher-position-window 128``).
TEACHER = dict(heads=8, dim=128, targets=5, pos_buckets=4102, time_buckets=128)


# The teacher's attention variants: which bias tables each has. ``position`` and ``time`` (``--teacher-tables``)
# split the biased variant's cost between its two tables; ``window`` (``--teacher-position-window``) is the biased
# variant with a position table of that many exact distances and one bucket for the farther ones.
TEACHER_VARIANTS = {"unbiased": (), "biased": ("position", "time"), "position": ("position",), "time": ("time",),
                    "window": ("position", "time")}


def teacher_batch(lengths: list[int], gen: torch.Generator, tables: tuple = (), position_window: int = 0) -> dict:
    """Leaves and options of one teacher-shaped self-attention batch (times: cumulative gaps of 0-1 h), with the
    bias tables named in ``tables`` (``"position"``, ``"time"``; a variant of :data:`TEACHER_VARIANTS`); a position
    table of ``position_window + 1`` entries where that is set (the teacher's ``position_window``)."""
    heads, dim, total = TEACHER["heads"], TEACHER["dim"], sum(lengths)
    q, k, v = leaves(total, heads, dim, dim, gen)
    offsets = offsets_of(lengths)
    options = dict(activation="silu", causal=True,
                   num_targets=torch.clamp(offsets[1:] - offsets[:-1], max=TEACHER["targets"]))
    grads = [q, k, v]
    if "position" in tables:
        size = position_window + 1 if position_window else TEACHER["pos_buckets"]
        pb = (0.1 * torch.randn(heads, size, device=DEVICE, generator=gen)).requires_grad_(True)
        options.update(pos_bias=pb)
        grads.append(pb)
    if "time" in tables:
        tb = (0.1 * torch.randn(heads, TEACHER["time_buckets"], device=DEVICE, generator=gen)).requires_grad_(True)
        ts = torch.randint(0, 3600, (total,), device=DEVICE, generator=gen).cumsum(0)
        options.update(time_bias=tb, timestamps=ts)
        grads.append(tb)
    return dict(q=q, k=k, v=v, offsets=offsets, n=max(lengths), options=options, grads=grads)


def teacher_check(n: int, biased: bool, gen: torch.Generator, position_window: int = 0) -> dict:
    """The variant's first call in this process (autotuned or not) against the float32 reference:
    lengths 0, 1, 17, n/3 and n, every gradient."""
    b = teacher_batch([n, 0, 1, max(n // 3, 2), 17], gen, TEACHER_VARIANTS["biased" if biased else "unbiased"],
                      position_window)
    q, k, v, offsets, longest, options = b["q"], b["k"], b["v"], b["offsets"], b["n"], b["options"]
    got = fwd_bwd(lambda: tri_attention(q, k, v, offsets, longest, **options), b["grads"], 3)
    want = fwd_bwd(lambda: ref_attention(q.float(), k.float(), v.float(), offsets, longest, **options), b["grads"], 3)
    names = ["out", "dq", "dk", "dv", "dpos", "dtime"][: len(got)]
    errs = {nm: rel_err(a, w) for nm, a, w in zip(names, got, want, strict=True)}
    finite = all(torch.isfinite(a).all().item() for a in got)
    name = f"window {position_window}" if position_window else "biased" if biased else "unbiased"
    return {"case": f"teacher N={n} {name}", "errors": errs, "finite": finite}


def teacher_times(b: dict, rep: int) -> dict:
    """Forward, backward and forward+backward medians (ms) of one batch."""
    q, k, v, offsets, n, options = b["q"], b["k"], b["v"], b["offsets"], b["n"], b["options"]

    def fn():
        return tri_attention(q, k, v, offsets, n, **options)

    with torch.no_grad():
        fwd = median_ms(fn, rep=rep)
    out = fn()
    g = torch.randn_like(out)
    bwd = median_ms(lambda: out.backward(g, retain_graph=True), grad_to_none=b["grads"], rep=rep)
    both = median_ms(functools.partial(_forward_backward, fn, g), grad_to_none=b["grads"], rep=rep)
    for x in b["grads"]:
        x.grad = None
    return {"fwd_ms": fwd, "bwd_ms": bwd, "fwdbwd_ms": both}


def kernel_times(b: dict, calls: int = 5) -> dict[str, float]:
    """Milliseconds per forward+backward call of each kernel (CUDA) or operator (CPU dry run), slowest first: the
    busiest entries of :func:`experiments.kernel_groups.kernel_breakdown` over ``calls`` calls after a warm-up, to
    see which of the three passes a change moved."""
    q, k, v, offsets, n, options = b["q"], b["k"], b["v"], b["offsets"], b["n"], b["options"]
    upstream = None
    for _ in range(2):
        out = tri_attention(q, k, v, offsets, n, **options)
        upstream = torch.randn_like(out) if upstream is None else upstream
        out.backward(upstream)

    def call():
        # Fresh gradients each call: accumulating into the last call's would add kernels the op does not run.
        for x in b["grads"]:
            x.grad = None
        tri_attention(q, k, v, offsets, n, **options).backward(upstream)

    busiest = profile_calls(call, calls, DEVICE == "cuda")["top_kernels"]
    for x in b["grads"]:
        x.grad = None
    return {kernel["name"]: kernel["ms_per_step"] for kernel in busiest if kernel["ms_per_step"] > 0}


def teacher_row(n: int, kind: str, lengths: list[int], rounds: dict) -> dict:
    """Medians over rounds, TFLOP/s on valid pairs, and the biased/unbiased time ratios."""
    offsets = offsets_of(lengths)
    nt = torch.clamp(offsets[1:] - offsets[:-1], max=TEACHER["targets"])
    pairs = valid_pairs(offsets, n, causal=True, num_targets=nt)
    flops = attention_flops(pairs, TEACHER["heads"], TEACHER["dim"], TEACHER["dim"])
    row = {"N": n, "lengths": kind, "B": len(lengths), "tokens": sum(lengths), "pairs": pairs}
    for variant in rounds:
        for part, factor in (("fwd", 1.0), ("bwd", 2.5), ("fwdbwd", 3.5)):
            runs = [r[f"{part}_ms"] for r in rounds[variant]]
            ms = statistics.median(runs)
            row[f"{variant}_{part}_ms"] = ms
            row[f"{variant}_{part}_runs_ms"] = runs
            row[f"{variant}_{part}_tflops"] = flops * factor / ms / 1e9
    for part in ("fwd", "bwd", "fwdbwd"):
        row[f"ratio_{part}"] = row[f"biased_{part}_ms"] / row[f"unbiased_{part}_ms"]
        for variant in set(rounds) - {"unbiased", "biased"}:
            row[f"{variant}_ratio_{part}"] = row[f"{variant}_{part}_ms"] / row[f"unbiased_{part}_ms"]
    return row


def fmt_teacher(r: dict) -> str:
    parts = []
    for part in ("fwd", "bwd", "fwdbwd"):
        parts.append(f"{part} {r[f'unbiased_{part}_ms']:7.3f} -> {r[f'biased_{part}_ms']:7.3f} ms "
                     f"({r[f'unbiased_{part}_tflops']:5.0f} -> {r[f'biased_{part}_tflops']:5.0f} TF, x{r[f'ratio_{part}']:.2f})")
    line = f"teacher N={r['N']:5d} {r['lengths']:6s} B={r['B']:4d} | " + " | ".join(parts)
    for variant, what in (("position", "position table only"), ("time", "time table only"),
                          ("window", "short position table")):
        if f"{variant}_fwdbwd_ms" in r:
            line += f"\n  {what}: " + " | ".join(
                f"{part} {r[f'{variant}_{part}_ms']:7.3f} ms (x{r[f'{variant}_ratio_{part}']:.2f})" for part in ("fwd", "bwd", "fwdbwd"))
    return line


def bench_teacher(ns: list[int], kinds: list[str], tokens: int, repeats: int, rep: int,
                  profile: bool = False, tables: bool = False, position_window: int = 0) -> tuple[list, list]:
    """Checks, then ``repeats`` rounds of unbiased and biased timings (alternating, so drift hits both), of each
    table alone with ``tables`` and of a ``position_window`` table where that is set; with ``profile`` each row also
    gets each variant's per-kernel times (:func:`kernel_times`)."""
    variants = ["unbiased", "biased"] + (["position", "time"] if tables else []) + (["window"] if position_window else [])
    gen = torch.Generator().manual_seed(5)
    dgen = torch.Generator(DEVICE).manual_seed(5)
    checks, rows = [], []
    for n in ns:
        for biased in (False, True):
            checks.append(teacher_check(n, biased, dgen))
            print(fmt_check(checks[-1]), flush=True)
        if position_window:
            checks.append(teacher_check(n, True, dgen, position_window))
            print(fmt_check(checks[-1]), flush=True)
        for kind in kinds:
            lengths = make_lengths(kind, max(tokens // n, 1), n, gen)
            batches = {variant: teacher_batch(lengths, dgen, TEACHER_VARIANTS[variant],
                                              position_window if variant == "window" else 0) for variant in variants}
            rounds = {variant: [] for variant in variants}
            for _ in range(repeats):
                for variant, b in batches.items():
                    rounds[variant].append(teacher_times(b, rep))
            rows.append(teacher_row(n, kind, lengths, rounds))
            print(fmt_teacher(rows[-1]), flush=True)
            if profile:
                for variant, b in batches.items():
                    rows[-1][f"{variant}_kernels_ms"] = kernel_times(b)
                    top = list(rows[-1][f"{variant}_kernels_ms"].items())[:4]
                    print(f"  {variant} per call: " + ", ".join(f"{name[:40]} {ms:.3f} ms" for name, ms in top),
                          flush=True)
            del batches
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    return checks, rows


# The ``large`` teacher's PMA: 8 learned seeds per row attend (softmax) to the row's history, 8 heads of 128.
PMA = dict(heads=8, dim=128, seeds=8)


def pma_lengths(tokens: int, n: int, gen: torch.Generator) -> list[int]:
    """Heavy-tailed histories (:func:`make_lengths`) of at most ``n`` events until they hold ``tokens``."""
    lengths: list[int] = []
    while sum(lengths) < tokens:
        lengths += make_lengths("heavy", 64, n, gen)
    total, out = 0, []
    for length in lengths:
        out.append(min(length, tokens - total))
        total += out[-1]
        if total == tokens:
            return out
    return out


def bench_pma(ns: list[int], tokens: int, repeats: int, rep: int) -> tuple[list, list]:
    """The PMA's cross-attention, key chunks (``GEM_KERNELS_SPLIT_KEYS=1``) against one program per (row, head),
    alternating in ``repeats`` rounds: bf16 checks against the float32 reference, then forward and forward+backward
    medians."""
    gen = torch.Generator().manual_seed(7)
    dgen = torch.Generator(DEVICE).manual_seed(7)
    checks, rows = [], []
    for n in ns:
        case_checks, row = pma_case(pma_lengths(tokens, n, gen), n, repeats, rep, dgen)
        checks += case_checks
        rows.append(row)
        print(fmt_pma(row), flush=True)
    os.environ.pop("GEM_KERNELS_SPLIT_KEYS", None)
    return checks, rows


def pma_case(kv_lens: list[int], n: int, repeats: int, rep: int, dgen: torch.Generator) -> tuple[list, dict]:
    heads, dim, seeds = PMA["heads"], PMA["dim"], PMA["seeds"]
    q_lens = [seeds] * len(kv_lens)
    q, _, _ = leaves(sum(q_lens), heads, dim, dim, dgen)
    _, k, v = leaves(sum(kv_lens), heads, dim, dim, dgen)
    args = (offsets_of(q_lens), offsets_of(kv_lens), seeds, max(kv_lens))

    def attend():
        return tri_cross_attention(q, k, v, *args)

    want = fwd_bwd(lambda: ref_cross_attention(q.float(), k.float(), v.float(), *args), [q, k, v], 3)
    checks = []
    for split in ("0", "1"):
        os.environ["GEM_KERNELS_SPLIT_KEYS"] = split
        got = fwd_bwd(attend, [q, k, v], 3)
        checks.append({"case": f"pma N={n} split={split}", "finite": all(bool(x.isfinite().all()) for x in got),
                       "errors": {name: rel_err(a, b)
                                  for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True)}})
        print(fmt_check(checks[-1]), flush=True)
    upstream = torch.randn(sum(q_lens), heads, dim, device=DEVICE, generator=dgen).to(DTYPE)
    step = functools.partial(_forward_backward, attend, upstream)
    times = {split: {"fwd": [], "fwdbwd": []} for split in ("0", "1")}
    for _ in range(repeats):
        for split in ("0", "1"):
            os.environ["GEM_KERNELS_SPLIT_KEYS"] = split
            with torch.no_grad():
                times[split]["fwd"].append(median_ms(attend, rep=rep))
            times[split]["fwdbwd"].append(median_ms(step, grad_to_none=[q, k, v], rep=rep))
    row = {"op": "pma", "N": n, "rows": len(kv_lens), "tokens": sum(kv_lens), "longest": max(kv_lens), "H": heads,
           "D": dim, "seeds": seeds}
    for split, name in (("0", "unsplit"), ("1", "split")):
        for mode, values in times[split].items():
            row[f"{name}_{mode}_ms"] = statistics.median(values)
            row[f"{name}_{mode}_runs"] = values
    return checks, row


def fmt_pma(r: dict) -> str:
    return (f"pma N={r['N']} rows={r['rows']} longest={r['longest']}: fwd {r['unsplit_fwd_ms']:.4f} -> "
            f"{r['split_fwd_ms']:.4f} ms, fwd+bwd {r['unsplit_fwdbwd_ms']:.4f} -> {r['split_fwdbwd_ms']:.4f} ms "
            f"(unsplit -> split, medians of {len(r['split_fwd_runs'])})")


def main_pma(args, meta: dict) -> int:
    print(json.dumps(meta), flush=True)
    checks, rows = bench_pma(args.teacher_n, args.pma_tokens, args.repeats, args.rep)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "checks": checks, "rows": rows}, f, indent=1)
    return 0


def fmt_check(c: dict) -> str:
    errs = " ".join(f"{k}={v:.1e}" for k, v in c["errors"].items())
    rerun = f" rerun={c['rerun_max_diff']:.1e}" if "rerun_max_diff" in c else ""
    return f"check {c['case']:48s} {errs}{rerun} finite={c['finite']}"


def fmt_row(r: dict) -> str:
    head = f"{r['op']:9s} {r['act']:7s} N={r['N']:5d} {r['lengths']:15s} tg={r['targets']:2d} {r['impl']:12s}"
    if "error" in r:
        return f"{head} {r['error']}"
    line = (f"{head} fwd {r['fwd_ms']:8.3f}ms {r['fwd_tflops']:6.1f}TF | bwd {r['bwd_ms']:8.3f}ms {r['bwd_tflops']:6.1f}TF"
            f" | f+b {r['fwdbwd_ms']:8.3f}ms {r['fwdbwd_tflops']:6.1f}TF | peak {r['peak_gb']:6.2f}GB")
    if "fwdbwd_graph_ms" in r:
        line += f" | graph fwd {r['fwd_graph_tflops']:6.1f}TF f+b {r['fwdbwd_graph_tflops']:6.1f}TF"
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--lengths", nargs="+", default=["full", "uniform", "heavy"])
    parser.add_argument("--targets", type=int, nargs="+", default=[0, 20])
    parser.add_argument("--acts", nargs="+", default=["silu", "softmax"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--cross-batch", type=int, default=1024)
    parser.add_argument("--no-padded", action="store_true", help="skip the padded PyTorch baselines")
    parser.add_argument("--no-checks", action="store_true")
    parser.add_argument("--no-cross", action="store_true")
    parser.add_argument("--bias", action="store_true", help="self-attention with HSTU's position and time bias tables")
    parser.add_argument("--ptr", action="store_true",
                        help="also check and time the kernels with pointer loads (GEM_KERNELS_TMA=0)")
    parser.add_argument("--workers", type=int, default=12, help="processes for checks and compiles")
    parser.add_argument("--json", type=str, default=None, help="write every row here")
    parser.add_argument("--teacher", action="store_true", help="the large teacher's attention, biased vs unbiased")
    parser.add_argument("--pma", action="store_true",
                        help="the large teacher's PMA cross-attention, on key chunks against unsplit (--teacher-n)")
    parser.add_argument("--pma-tokens", type=int, default=16384, help="history tokens per PMA batch")
    parser.add_argument("--teacher-n", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--teacher-lengths", nargs="+", default=["full", "heavy"])
    parser.add_argument("--teacher-tokens", type=int, default=65536, help="tokens per teacher batch (B = tokens / N)")
    parser.add_argument("--repeats", type=int, default=3, help="teacher timing rounds; rows report their median")
    parser.add_argument("--rep", type=int, default=100, help="do_bench milliseconds per timing")
    parser.add_argument("--teacher-tables", action="store_true",
                        help="also time each bias table alone (what each costs of the biased variant's time)")
    parser.add_argument("--teacher-position-window", type=int, default=0, metavar="W",
                        help="also time the biased attention with a position table of W exact distances and one "
                             "bucket for the farther ones (the teacher's position_window)")
    parser.add_argument("--kernel-profile", action="store_true",
                        help="teacher rows: also each kernel's time per forward+backward call (torch.profiler)")
    parser.add_argument("--write-tuned", type=str, default=None, metavar="PATH",
                        help="write the checked-in table plus this run's autotuner picks here (then copy it to "
                             "kernels/triton/tuned_configs.json)")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                        help="the kernels' inputs on the GPU (fp32: their float32 tiles; the CPU runs fp32)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: a dry run under TRITON_INTERPRET=1 (use tiny --teacher-n/--teacher-tokens)")
    args = parser.parse_args(argv)
    if args.teacher_position_window < 0:
        parser.error(f"--teacher-position-window must be 0 (HSTU's full table) or positive, got {args.teacher_position_window}")
    global DEVICE, DTYPE
    DEVICE = args.device
    # The interpreter computes through numpy, which has no bfloat16.
    DTYPE = torch.bfloat16 if DEVICE == "cuda" and args.dtype == "bf16" else torch.float32
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA device (or --device cpu with TRITON_INTERPRET=1 for a dry run)", file=sys.stderr)
        return 2
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("--device cpu runs the Triton kernels in the interpreter: set TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    import triton

    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "torch": torch.__version__,
            "triton": triton.__version__, "argv": sys.argv,
            "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (interpreter)",
            "autotune": os.environ.get("GEM_KERNELS_AUTOTUNE", "default"), "dtype": str(DTYPE).removeprefix("torch.")}
    if args.teacher:
        return main_teacher(args, meta)
    if args.pma:
        return main_pma(args, meta)
    if DEVICE == "cpu":
        print("only --teacher and --pma have a CPU dry run", file=sys.stderr)
        return 2
    meta.update(ceilings())
    print(json.dumps(meta), flush=True)
    jobs = [] if args.no_checks else check_jobs(args.ptr)
    jobs += warm_jobs(args.acts, args.targets, args.heads, args.dim, not args.no_cross)
    checks = run_parallel(jobs, args.workers)
    print(f"checks and compiles done in parallel: {len(jobs)} jobs", flush=True)
    for c in checks:
        print(fmt_check(c), flush=True)
    rows = bench_self(args.n, args.lengths, args.targets, args.acts, args.batch, args.heads, args.dim, not args.no_padded,
                      args.bias, args.ptr)
    if not args.no_cross:
        rows += bench_cross(args.cross_batch, not args.no_padded)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "checks": checks, "rows": rows}, f, indent=1)
    print("\n== summary ==")
    for r in rows:
        print(fmt_row(r))
    return 0


def main_teacher(args, meta: dict) -> int:
    print(json.dumps(meta), flush=True)
    start = time.perf_counter()
    if DEVICE == "cuda":
        jobs = [("warm-teacher", f"N={n} biased={b}", dict(n=n, biased=b)) for n in args.teacher_n for b in (False, True)]
        run_parallel(jobs, args.workers)
        print(f"compiled in parallel: {time.perf_counter() - start:.0f} s", flush=True)
    checks, rows = bench_teacher(args.teacher_n, args.teacher_lengths, args.teacher_tokens, args.repeats, args.rep,
                                 args.kernel_profile, args.teacher_tables, args.teacher_position_window)
    meta["wall_s"] = time.perf_counter() - start
    if args.write_tuned and DEVICE == "cuda":
        path = Path(args.write_tuned)
        if TUNED_PATH.exists() and not path.exists():
            shutil.copyfile(TUNED_PATH, path)
        write_tuned(triton_backend.TUNED, torch.device("cuda"), path)
        print(f"wrote {len(triton_backend.TUNED)} autotuned picks to {path}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "checks": checks, "rows": rows}, f, indent=1)
    print(f"\n== teacher summary ({meta['wall_s']:.0f} s) ==")
    for c in checks:
        print(fmt_check(c))
    for r in rows:
        print(fmt_teacher(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
