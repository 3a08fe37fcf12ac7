"""Whether the Triton attention backward repeats bit for bit, with ``GEM_KERNELS_DETERMINISTIC`` off and on.

The ``large`` teacher's biased attention (``bench_jagged_attention.TEACHER``: H=8, D=128, SiLU, causal, 5 targets,
position table [8, 4102], time table [8, 128]) on one batch, forward and backward ``--runs`` times with the same
inputs and upstream gradient, per switch value. Prints each output's largest ``|run_i - run_0|`` (off: the atomic
table gradients may differ in their last bits; on: every figure must be 0), the deterministic path's relative
difference from the atomic one (``||det - atomic|| / ||atomic||``), and the backward's median time.
``--device cpu`` runs tiny shapes under ``TRITON_INTERPRET=1``, a dry run of the script (the interpreter runs
programs one at a time, so both switch values repeat there).

    PYTHONUNBUFFERED=1 PYTHONPATH=$PWD python experiments/check_deterministic_backward.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from experiments import bench_jagged_attention as bench

NAMES = ("out", "dq", "dk", "dv", "dpos", "dtime")


def runs_of(batch: dict, runs: int) -> tuple[list[list[torch.Tensor]], list[float]]:
    """``runs`` forward+backward results of one batch, and each backward's wall time (ms)."""
    q, k, v, offsets, n, options = (batch[key] for key in ("q", "k", "v", "offsets", "n", "options"))
    results, times = [], []
    for _ in range(runs):
        for x in batch["grads"]:
            x.grad = None
        out = bench.tri_attention(q, k, v, offsets, n, **options)
        upstream = torch.randn(out.shape, generator=torch.Generator(bench.DEVICE).manual_seed(1), device=bench.DEVICE)
        if bench.DEVICE == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out.backward(upstream.to(out.dtype))
        if bench.DEVICE == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
        results.append([out.detach().clone()] + [x.grad.clone() for x in batch["grads"]])
    return results, times


def report(flag: str, results: list[list[torch.Tensor]], times: list[float]) -> None:
    spread = {
        name: max((r[i].float() - results[0][i].float()).abs().max().item() for r in results[1:])
        for i, name in enumerate(NAMES)
    }
    figures = "  ".join(f"{name} {value:.3e}" for name, value in spread.items())
    # The first backward compiles (or tunes); the median of the others is the figure.
    median = statistics.median(times[1:]) if len(times) > 1 else times[0]
    print(f"GEM_KERNELS_DETERMINISTIC={flag}: max |run_i - run_0|  {figures}  | backward {median:.2f} ms", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4096, help="longest sequence")
    parser.add_argument("--tokens", type=int, default=65536, help="tokens per batch (B = tokens / N)")
    parser.add_argument("--lengths", choices=["full", "uniform", "heavy"], default="full")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args(argv)
    if args.runs < 2:
        parser.error("--runs must be at least 2")
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("--device cpu runs the Triton kernels in the interpreter: set TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA device (or --device cpu with TRITON_INTERPRET=1 for a dry run)", file=sys.stderr)
        return 2
    bench.DEVICE = args.device
    bench.DTYPE = torch.bfloat16 if args.device == "cuda" else torch.float32
    lengths = bench.make_lengths(args.lengths, max(args.tokens // args.n, 1), args.n, torch.Generator().manual_seed(0))
    batch = bench.teacher_batch(lengths, torch.Generator(args.device).manual_seed(0),
                                bench.TEACHER_VARIANTS["biased"])
    print(f"teacher attention: N={args.n} {args.lengths} B={len(lengths)} tokens={sum(lengths)}", flush=True)
    first = {}
    for flag in ("0", "1"):
        os.environ["GEM_KERNELS_DETERMINISTIC"] = flag
        results, times = runs_of(batch, args.runs)
        report(flag, results, times)
        first[flag] = results[0]
    rel = "  ".join(f"{name} {bench.rel_err(d, a):.2e}" for name, d, a in zip(NAMES, first["1"], first["0"], strict=True))
    print(f"deterministic vs atomic, relative: {rel}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
