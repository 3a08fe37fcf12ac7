"""The optimizer step alone: :func:`kernels.multi_adamw` against torch's fused AdamW at the teacher's tensor sizes.

Three ways to step the same parameters, alternated ``--repeats`` times, median milliseconds and the bandwidth they
imply (28 bytes per value for each: parameter, gradient and both moments read, parameter and moments written; the
bf16 variant reads a 2-byte gradient and writes a 2-byte copy):

- ``multi_adamw``, bf16 gradients into bf16 copies (what :class:`foundation.model.precision.MasterAdamW` does for the
  weights a :class:`~foundation.model.precision.CastOnce` keeps);
- ``multi_adamw``, float32 gradients, no copies (the tables and the other parameters);
- ``torch._fused_adamw_`` on float32 gradients (``torch.optim.AdamW(fused=True)``; on the GPU, and on the CPU from
  torch 2.4).

Then one profiled call of the first: the kernels the profiler saw and their device time, which checks that a
profile of the training step accounts for the update (it did not appear in session 30's step profile;
docs/benchmarks.md). Sizes (``--sizes large``): the ``large`` teacher's biggest tensors and a tail of ~4M and ~1M
ones, 561M values in all; ``--scale`` divides every size (``--scale 1000`` runs on a CPU in seconds). Usage::

    python -m experiments.bench_adamw --repeats 10 --json /tmp/adamw.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from experiments.kernel_groups import device_kernel_us
from foundation.data.io import atomic_write_text
from kernels import multi_adamw

# The `large` teacher's parameter sizes, grouped: its item table, the first expert layer, the advertiser table, the
# user tower, then 40 tensors of ~4M values, 100 of ~1M and 300 small ones (561M in all, as it holds).
LARGE_SIZES = [128_000_000, 91_212_800, 20_480_000, 12_058_624] + [4_194_304] * 40 + [1_048_576] * 100 + [1_024] * 300
HYPER = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
BYTES_PER_VALUE = 28


def build_state(sizes: list[int], device: torch.device) -> dict[str, list[torch.Tensor]]:
    """Parameters, bf16 and float32 gradients, zero moments, bf16 copies and step counters for ``sizes``."""
    g = torch.Generator(device=device).manual_seed(0)
    params = [torch.randn(n, device=device, generator=g) for n in sizes]
    grads16 = [torch.randn(n, device=device, generator=g).to(torch.bfloat16) for n in sizes]
    return {
        "params": params,
        "grads16": grads16,
        "grads32": [t.float() for t in grads16],
        "exp_avgs": [torch.zeros(n, device=device) for n in sizes],
        "exp_avg_sqs": [torch.zeros(n, device=device) for n in sizes],
        "copies": [torch.empty(n, device=device, dtype=torch.bfloat16) for n in sizes],
        "steps": [torch.zeros((), device=device) for _ in sizes],
    }


def build_variants(state: dict, backend: str) -> dict[str, Callable[[int], None]]:
    """``name -> step(k)``: one optimizer step (the ``k``-th) of the state's parameters."""
    p, m, v = state["params"], state["exp_avgs"], state["exp_avg_sqs"]

    def bf16_copies(k: int) -> None:
        multi_adamw(p, state["grads16"], m, v, copies=state["copies"], step=k, backend=backend, **HYPER)

    def float32(k: int) -> None:
        multi_adamw(p, state["grads32"], m, v, step=k, backend=backend, **HYPER)

    def torch_fused(k: int) -> None:
        beta1, beta2 = HYPER["betas"]
        torch._fused_adamw_(p, state["grads32"], m, v, [], state["steps"], lr=HYPER["lr"], beta1=beta1, beta2=beta2,
                            weight_decay=HYPER["weight_decay"], eps=HYPER["eps"], amsgrad=False, maximize=False)

    return {"multi_adamw_bf16_grads_copies": bf16_copies, "multi_adamw_float32": float32, "torch_fused_adamw": torch_fused}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_variants(variants: dict, device: torch.device, repeats: int) -> dict[str, list[float]]:
    """Milliseconds of each variant's step, the variants alternated ``repeats`` times after one warm-up each."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    k = 0
    for fn in variants.values():
        k += 1
        fn(k)
    for _ in range(repeats):
        for name, fn in variants.items():
            k += 1
            sync(device)
            start = time.perf_counter()
            fn(k)
            sync(device)
            times[name].append((time.perf_counter() - start) * 1e3)
    return times


def profiled_kernels(fn: Callable[[int], None], device: torch.device) -> list[dict]:
    """What the profiler saw of one call: on a GPU the device's own records of its kernels and copies
    (:func:`experiments.kernel_groups.device_kernel_us`) and the device time the host ops were credited with (the
    step profile's source), on a CPU the ops' host time."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn(10**6)
        sync(device)
    if device.type == "cuda":
        credited = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3
        seen = [{"name": name[:120], "ms": us / 1e3, "credited_to_host_ops_ms": credited}
                for name, us in device_kernel_us(prof).items()]
    else:
        seen = [{"name": e.key[:120], "ms": e.self_cpu_time_total / 1e3} for e in prof.key_averages()
                if e.self_cpu_time_total > 0]
    return sorted(seen, key=lambda e: -e["ms"])[:8]


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sizes = [max(1, n // args.scale) for n in (LARGE_SIZES if args.sizes == "large" else [int(s) for s in args.sizes.split(",")])]
    values = sum(sizes)
    state = build_state(sizes, device)
    variants = build_variants(state, args.backend)
    times = time_variants(variants, device, args.repeats)
    rows = {}
    for name, ms in times.items():
        median = statistics.median(ms)
        rows[name] = {"ms_median": median, "ms_all": ms, "tb_per_s": BYTES_PER_VALUE * values / median / 1e9}
        print(f"{name:32s} {median:9.3f} ms  {rows[name]['tb_per_s']:6.2f} TB/s  ({values / 1e6:.1f}M values)", flush=True)
    seen = profiled_kernels(variants["multi_adamw_bf16_grads_copies"], device)
    print("profiled call of multi_adamw_bf16_grads_copies: " + json.dumps(seen), flush=True)
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "values": values,
            "tensors": len(sizes), "repeats": args.repeats, "backend": args.backend, "variants": rows, "profiled": seen,
            "date": time.strftime("%Y-%m-%d")}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="large", help="'large' or comma-separated tensor sizes")
    parser.add_argument("--scale", type=int, default=1, help="divide every size by this (>= 1)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--backend", default="auto", choices=("auto", "pytorch", "triton"))
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--json", default=None, help="write the results here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.scale < 1 or args.repeats < 1:
        print(f"bench_adamw: --scale and --repeats must be >= 1, got {args.scale} and {args.repeats}", file=sys.stderr)
        return 2
    result = run(args)
    if args.json:
        atomic_write_text(args.json, json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
