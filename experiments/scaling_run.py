"""One run of the compute-scaling sweep: a fixed number of steps under a warm-up + cosine learning-rate schedule.

Usage (``experiments.compute_scaling`` starts one process per run)::

    python -m experiments.scaling_run --data /tmp/world --flavor teacher-small --seed 0 --steps 768 \\
        --lr 7e-4 --warmup-steps 38 --final-lr-frac 0.1 --time-budget 400 --json run.json \\
        model.teacher.d_model=256 train.precision=bf16-mixed data.batch_size=512

Any flavor of :mod:`gem.flavors` (dotted overrides after the options) trains ``--steps`` steps over the train
split, in up to ``--passes`` passes over it (default 1: no row is read twice, and ``steps x batch rows`` at most the
split reads a part of it once). When one pass's batches run out the next pass begins, its rows reshuffled
(``EventStream.set_epoch(p)`` for pass ``p``), so with ``--passes N`` a run can train up to N times the split's rows;
from the second pass on every row it reads has been read before. ``--steps`` stays the run's total optimizer steps
(the schedule's length) whatever the passes. Each step is the harness's (:func:`gem.loop.train_epoch`: AdamW,
``train.weight_decay``, clipping at ``train.grad_clip``, bf16 autocast when ``train.precision`` is ``bf16-mixed``).
The learning rate follows :class:`gem.schedule.WarmupCosine` from ``--lr`` (default the flavor's ``train.lr``): linear warm-up
over ``--warmup-steps``, then a cosine down to ``--final-lr-frac`` of the peak at the end of the run. The end is
``--steps`` or ``--time-budget`` seconds after training began, whichever comes first (the schedule's progress is the
larger of the two fractions; the time fraction counts from the first optimizer step, after the first forward and
backward have compiled the kernels), so a run that its budget cuts still ends at the bottom of its decay and is
scored as a finished run, at the FLOPs it trained. ``--final-lr-frac 1`` with no warm-up is the constant rate of
:mod:`experiments.teacher_vs_baseline`.

Then valid and test are scored once (under the training autocast); the JSON has the format of
:mod:`experiments.teacher_vs_baseline` (one "epoch" in ``history``, ``best_epoch`` 0) plus ``schedule`` (with
``passes``), ``stopped_by`` (``steps``, ``time`` or ``data``: all ``--passes`` passes over the split ran out),
``passes`` (requested), ``passes_started`` (how many were begun: their first batch read) and ``curve``: about
``--curve-points`` spans of the run (a span may straddle two passes), each with its steps, rows, mean train loss,
the learning rate at its end, its TFLOP/s and ``pass``, the pass (1-based) its last batch came from. In the first
pass every row is read once, so a span's train loss is the loss on rows the model has not seen (a held-out loss);
from the second pass on the rows have been trained on before and the curve's loss is no longer held out.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from experiments.teacher_vs_baseline import predict_split, recalibrate
from foundation.config import apply_overrides
from foundation.data.io import atomic_write_text
from foundation.data.pipeline import DataConfig, EventStream, build_dataloader
from foundation.data.schema import EventSchema
from gem.flavors import get_flavor
from gem.loop import autocast, train_epoch
from gem.registry import build_model
from gem.schedule import ScheduledLR, WarmupCosine


class Passes:
    """The batches of up to ``passes`` passes over ``stream``, one after the other: pass ``p`` (0-based) calls
    ``stream.set_epoch(p)`` (its own shuffle) and builds its own loader when the previous pass has run out.

    ``started`` counts the passes begun (a pass begins when its loader is asked for its first batch), so after
    a batch was taken it is the 1-based pass that batch came from.
    """

    def __init__(self, stream: EventStream, cfg: DataConfig, passes: int) -> None:
        self.stream, self.cfg, self.passes = stream, cfg, passes
        self.started = 0

    def __iter__(self) -> Iterator:
        for epoch in range(self.passes):
            self.stream.set_epoch(epoch)
            self.started = epoch + 1
            yield from build_dataloader(self.stream, self.cfg)


def train_spans(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches, scheduled: ScheduledLR, *,
                steps: int, span: int, grad_clip: float, autocast_dtype: torch.dtype | None) -> tuple[list[dict], str]:
    """:func:`gem.loop.train_epoch` over ``batches`` in spans of ``span`` steps until ``scheduled`` finishes or
    the batches run out; returns one record per span and why training stopped (``steps``, ``time``, ``data``).

    One iterator serves every span, so with :class:`Passes` a span runs on across a pass boundary; its record's
    ``pass`` is the pass its last batch came from (``batches.started``; 1 for batches without passes)."""
    iterator, curve, done = iter(batches), [], 0
    while not scheduled.finished():
        began = time.perf_counter()
        record = train_epoch(model, optimizer, itertools.islice(iterator, min(span, steps - done)),
                             grad_clip=grad_clip, autocast_dtype=autocast_dtype, deadline=scheduled.deadline)
        if record["steps"] == 0:
            return curve, "time" if scheduled.finished() else "data"
        done += record["steps"]
        curve.append({**record, "end_step": done, "lr": scheduled.last_lr, "seconds": time.perf_counter() - began,
                      "pass": getattr(batches, "started", 1)})
    return curve, "steps" if done >= steps else "time"


def summarize_spans(curve: list[dict]) -> dict:
    """The whole run's record from its spans: mean loss over every step, steps, rows, FLOPs, throughput."""
    steps = sum(c["steps"] for c in curve)
    seconds = sum(c["seconds"] for c in curve)
    out = {
        "loss": sum(c["loss"] * c["steps"] for c in curve) / max(steps, 1),
        "steps": steps,
        "rows": sum(c["rows"] for c in curve),
        "flops": sum(c["flops"] for c in curve),
        "tokens_per_s": sum(c["tokens_per_s"] * c["seconds"] for c in curve) / max(seconds, 1e-9),
    }
    out["tflops_per_s"] = out["flops"] / max(seconds, 1e-9) / 1e12
    return out


def run(args: argparse.Namespace) -> dict:
    if args.time_budget < 0 or args.curve_points < 1:
        raise ValueError(f"--time-budget {args.time_budget:g} must be >= 0 and --curve-points {args.curve_points} >= 1")
    if args.passes < 1:
        raise ValueError(f"--passes {args.passes} must be >= 1")
    cfg = apply_overrides(
        get_flavor(args.flavor), [*args.overrides, f"data.path={args.data}", f"train.seed={args.seed}"]
    )
    peak = args.lr if args.lr is not None else cfg.train.lr
    schedule = WarmupCosine(peak, args.steps, args.warmup_steps, args.final_lr_frac)
    schema = EventSchema.load(cfg.data.path)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(cfg.train.seed)
    torch.set_float32_matmul_precision("high")
    model = build_model(cfg.model, schema).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=peak, weight_decay=cfg.train.weight_decay)
    dtype = torch.bfloat16 if cfg.train.precision.startswith("bf16") else None
    stream = EventStream(cfg.data.path, cfg.data.train_split, cfg.data, training=True)
    start = time.perf_counter()
    scheduled = ScheduledLR(optimizer, schedule, start + args.time_budget if args.time_budget > 0 else None)
    passes = Passes(stream, cfg.data, args.passes)
    curve, stopped_by = train_spans(
        model, optimizer, passes, scheduled, steps=args.steps,
        span=max(1, math.ceil(args.steps / args.curve_points)), grad_clip=cfg.train.grad_clip, autocast_dtype=dtype,
    )
    scheduled.handle.remove()
    if not curve:
        raise ValueError(f"no step trained within --time-budget {args.time_budget:g} s (stopped by {stopped_by})")
    record = {"epoch": 0, **summarize_spans(curve), "elapsed_s": time.perf_counter() - start}
    eval_cfg = dataclasses.replace(cfg.data, batch_size=args.eval_batch_size, token_budget=0)
    with autocast(device, dtype):
        valid = predict_split(model, cfg.data.path, "valid", eval_cfg)
        test = predict_split(model, cfg.data.path, "test", eval_cfg)
    record["valid"] = valid.metrics(schema.num_domains)
    record["test"] = test.metrics(schema.num_domains)
    record["test_recalibrated"] = recalibrate(valid, test, schema.num_domains).metrics(schema.num_domains)
    print(json.dumps({k: record[k] for k in ("steps", "rows", "loss", "tflops_per_s", "elapsed_s")}
                     | {"stopped_by": stopped_by, "passes_started": passes.started,
                        "valid_click_ne": record["valid"].get("click/ne"),
                        "test_click_ne": record["test"].get("click/ne")}), flush=True)
    result = {
        "flavor": args.flavor,
        "overrides": args.overrides,
        "seed": args.seed,
        "data": cfg.data.path,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_rows": record["rows"],
        "train_flops": record["flops"],
        "train_flops_at_best": record["flops"],
        "flops_per_example": record["flops"] / max(record["rows"], 1),
        "config": cfg.to_dict(),
        "schedule": {**dataclasses.asdict(schedule), "time_budget": args.time_budget, "passes": args.passes,
                     "passes_started": passes.started},
        "stopped_by": stopped_by,
        "passes": args.passes,
        "passes_started": passes.started,
        "curve": [{k: c[k] for k in ("end_step", "rows", "loss", "lr", "tflops_per_s", "seconds", "pass")}
                  for c in curve],
        "best_epoch": 0,
        "test": record["test"],
        "test_recalibrated": record["test_recalibrated"],
        "history": [record],
    }
    if args.json:
        atomic_write_text(args.json, json.dumps(result, indent=2, default=str))
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="a synthetic (ctr) dataset directory")
    parser.add_argument("--flavor", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, required=True, help="optimizer steps of the run (the schedule's length)")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the flavor's train.lr)")
    parser.add_argument("--warmup-steps", type=int, default=0)
    parser.add_argument("--final-lr-frac", type=float, default=1.0, help="the rate at the end, as a fraction of --lr")
    parser.add_argument("--time-budget", type=float, default=0.0, help="seconds of training at most (0: none)")
    parser.add_argument("--passes", type=int, default=1,
                        help="passes over the train split at most, each reshuffled (--steps stays the run's length)")
    parser.add_argument("--curve-points", type=int, default=16, help="spans of the run the train loss is recorded over")
    parser.add_argument("--eval-batch-size", type=int, default=1024)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("overrides", nargs="*", help="dotted overrides of the flavor, e.g. model.teacher.d_model=128")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(argv)
    try:
        run(args)
    except ValueError as exc:
        print(f"scaling_run: {exc}")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
