"""The deferred rows' catch-up alone: :func:`kernels.catch_up_rows` on a table of the ``large`` teacher's size.

A table of ``--rows x --dim`` float32 values (the ``large`` teacher's items: 500,000 x 256) whose moments and last
steps are drawn at random, ``--steps`` steps of a schedule (lr 1e-4, weight decay 0.01), and one step's lookups
(``--entries`` ids, the history tokens, candidates and negatives of a 16,384-token batch). First the Triton kernel
against its reference on the same tensors (largest differences); then the kernel's time per call, median of
``--repeats``, for four states of the looked-up rows: all at least the window behind, gaps spread over
``1..--steps``, all one step behind and all current; then a flush of the whole table. Usage::

    python -m experiments.bench_catch_up --json /tmp/catch_up.json
    python -m experiments.bench_catch_up --device cpu --rows 2000 --dim 16 --entries 500 --steps 300 --repeats 1

On the CPU the Triton path needs ``TRITON_INTERPRET=1`` (slow: use small sizes).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from foundation.data.io import atomic_write_text
from foundation.model.deferred_rows import WINDOW, schedule_entry
from kernels import catch_up_rows

BETAS, EPS, LR, WEIGHT_DECAY = (0.9, 0.999), 1e-8, 1e-4, 0.01


def build_schedule(steps: int, capacity: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``schedule[capacity, 3]`` and ``log_decay[capacity]`` of steps ``1..steps`` at a constant rate."""
    schedule = torch.zeros(capacity, 3)
    log_decay = torch.zeros(capacity, dtype=torch.float64)
    total = 0.0
    for u in range(1, steps + 1):
        schedule[u] = torch.tensor(schedule_entry(u, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY))
        total += math.log1p(-LR * WEIGHT_DECAY)
        log_decay[u] = total
    return schedule.to(device), log_decay.to(device)


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    g = torch.Generator(device=device).manual_seed(0)
    table = [torch.randn(args.rows, args.dim, device=device, generator=g) * 0.02,
             torch.randn(args.rows, args.dim, device=device, generator=g) * 1e-4,
             torch.rand(args.rows, args.dim, device=device, generator=g) * 1e-8]
    last = torch.randint(0, args.steps, (args.rows,), dtype=torch.int32, device=device, generator=g)
    rows = torch.randint(0, args.rows, (args.entries,), device=device, generator=g)
    schedule, log_decay = build_schedule(args.steps, max(4096, args.steps + 1), device)
    clock = torch.tensor([args.steps, 0], dtype=torch.int32, device=device)

    def call(backend: str, last_step: torch.Tensor, ids: torch.Tensor) -> list[torch.Tensor]:
        out = [t.clone() for t in table] + [last_step.clone()]
        catch_up_rows(*out, ids, clock, schedule, log_decay, betas=BETAS, eps=EPS, window=WINDOW, backend=backend)
        return out

    checks = {}
    for name, ours, ref in zip(("param", "exp_avg", "exp_avg_sq", "last_step"), call("triton", last, rows),
                               call("pytorch", last, rows), strict=True):
        checks[name] = {"max_abs_diff": float((ours.double() - ref.double()).abs().max()),
                        "max_abs_ref": float(ref.double().abs().max())}

    def timed(make_last: Callable[[], torch.Tensor], ids: torch.Tensor, repeats: int) -> float:
        times = []
        for _ in range(repeats):
            out = [t.clone() for t in table] + [make_last()]
            sync(device)
            start = time.perf_counter()
            catch_up_rows(*out, ids, clock, schedule, log_decay, betas=BETAS, eps=EPS, window=WINDOW, backend="triton")
            sync(device)
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    def filled(value: int) -> Callable[[], torch.Tensor]:
        return lambda: torch.full((args.rows,), value, dtype=torch.int32, device=device)

    cases = {"behind_by_the_window": filled(0), "gaps_1_to_steps": last.clone,
             "one_step_behind": filled(args.steps - 1), "current": filled(args.steps)}
    times = {name: timed(make, rows, args.repeats) for name, make in cases.items()}
    times["flush_behind_by_the_window"] = timed(cases["behind_by_the_window"], torch.arange(args.rows, device=device),
                                                max(1, args.repeats // 5))
    return {"rows": args.rows, "dim": args.dim, "entries": args.entries, "distinct_rows": int(torch.unique(rows).numel()),
            "steps": args.steps, "window": WINDOW, "repeats": args.repeats, "device": device_name(device),
            "checks": checks, "ms_median": times}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=500_000)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--entries", type=int, default=16_384 + 640)
    parser.add_argument("--steps", type=int, default=1_000, help="steps taken so far (the largest gap)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if min(args.rows, args.dim, args.entries, args.steps, args.repeats) < 1:
        parser.error("--rows, --dim, --entries, --steps and --repeats must be positive")
    result = run(args)
    for name, check in result["checks"].items():
        print(f"{name}: largest |triton - reference| {check['max_abs_diff']:.3e} (values up to {check['max_abs_ref']:.3e})")
    print(f"{result['entries']} entries naming {result['distinct_rows']} rows of {result['rows']} x {result['dim']}")
    for name, ms in result["ms_median"].items():
        print(f"{name}: {ms:.3f} ms")
    if args.json is not None:
        atomic_write_text(args.json, json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
