"""Teacher against baseline on the synthetic ads world: one experiment flavor, one seed, one JSON.

Usage::

    gem data synth --preset default --out /tmp/world max_history=1024
    python -m experiments.teacher_vs_baseline --data /tmp/world --flavor default --seed 0 --json dlrm0.json
    python -m experiments.teacher_vs_baseline --data /tmp/world --flavor teacher-small --seed 0 \\
        --json t512.json model.teacher.max_len=512 data.max_len=512
    python -m experiments.teacher_vs_baseline --data /tmp/world --flavor teacher-small --seed 0 \\
        --json t32.json model.teacher.max_len=32 data.max_len=32          # the short-history ablation

Any flavor of :mod:`experiments.flavors` (dotted overrides after the options) is trained for
``--epochs`` passes over the train split (cut short after ``--time-budget`` seconds of training)
with the harness's optimiser (AdamW, ``train.lr`` under the harness's schedule: ``train.warmup_steps`` and a cosine
to ``train.final_lr_frac`` at ``train.max_steps`` or at ``--time-budget``, :mod:`gem.schedule`; ``train.weight_decay``,
gradient clipping at ``train.grad_clip``; with ``model.teacher.sparse_tables`` only the rows a step looked up step, in ``MasterAdamW``, with AdamW's result), under
bf16 autocast when ``train.precision`` is ``bf16-mixed``, and in the harness's form of the step
(:mod:`gem.step_options`): with ``train.bucket_rows`` (``teacher-large``) padded batches through
:class:`gem.loop.StaticStep`, replayed from CUDA graphs with ``train.cuda_graphs``, parameters cast once with
``train.cast_once``. ``--max-steps`` caps the steps of an epoch (dry runs, fixed data budgets). After every epoch
the valid and test splits are scored (under the training autocast); the reported figures are the test metrics of
the epoch with the best valid click NE (early stopping on the earlier time window, never on test).
``test_recalibrated`` repeats them after a per-task, per-domain Platt scaling fitted on valid: it separates
ranking quality from calibration under the world's drift. Metrics are the harness's
(:class:`foundation.metrics.PredictionLog`): NE, AUC and calibration per task, overall and per
domain, with the oracle's beside them. The JSON also records the model FLOPs trained (the sum of
the model's ``flops(batch)`` over its steps): ``train_flops`` in all, ``train_flops_at_best`` up to
the end of the best valid epoch, and ``flops_per_example`` (training FLOPs per row, averaged over
the rows trained), with ``train_rows``.

The loop is plain PyTorch, not the Lightning harness, so that it runs on a GPU machine that has
no MLflow; ``gem train`` + ``gem eval`` give the same metrics through the harness. Many runs
share one GPU well (the models are small), so a sweep starts one process per run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from foundation.config import apply_overrides
from foundation.data.io import atomic_write_text
from foundation.data.pipeline import DataConfig, EventStream, build_dataloader
from foundation.data.schema import TASKS, EventSchema
from foundation.metrics import PredictionLog
from foundation.model.padding import PaddedBatches
from foundation.model.precision import MasterAdamW
from gem.flavors import get_flavor
from gem.loop import autocast, build_static_step, train_epoch
from gem.registry import build_model
from gem.schedule import ScheduledLR, build_lr_schedule
from gem.step_options import step_options


@torch.no_grad()
def predict_split(model: torch.nn.Module, dataset: str, split: str, data_cfg: DataConfig) -> PredictionLog:
    """The model's predictions (with labels, masks, domains and the oracle) over one split."""
    model.eval()
    device = next(model.parameters()).device
    log = PredictionLog()
    for batch in build_dataloader(EventStream(dataset, split, data_cfg, training=False), data_cfg):
        batch = batch.to(device, non_blocking=True)
        log.add(batch, model(batch).logits)
    model.train()
    return log


def fit_platt(logits: torch.Tensor, labels: torch.Tensor, steps: int = 50) -> tuple[float, float]:
    """``(a, b)`` minimising the BCE of ``sigmoid(a * logit + b)`` on ``logits[S]``, ``labels[S]``."""
    params = torch.tensor([1.0, 0.0], dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([params], max_iter=steps, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = F.binary_cross_entropy_with_logits(params[0] * logits + params[1], labels)
        loss.backward()
        return loss

    optimizer.step(closure)
    a, b = params.detach().tolist()
    return a, b


def recalibrate(valid: PredictionLog, test: PredictionLog, num_domains: int) -> PredictionLog:
    """``test`` with each task's probabilities Platt-scaled per domain, fitted on ``valid`` (the earlier window).

    Separates ranking from calibration under drift: NE after recalibration is what a model would score
    with the per-surface calibration layer production rankers refit on recent data.
    """
    out = PredictionLog()
    out.rows = {k: list(v) for k, v in test.rows.items()}
    v_dom, t_dom = torch.cat(valid.rows["domain"]), torch.cat(test.rows["domain"])
    for task in TASKS:
        if f"{task}/prob" not in test.rows:
            continue
        v_logit = torch.logit(torch.cat(valid.rows[f"{task}/prob"]).double(), eps=1e-7)
        v_label = torch.cat(valid.rows[f"{task}/label"]).double()
        v_mask = torch.cat(valid.rows[f"{task}/mask"])
        t_logit = torch.logit(torch.cat(test.rows[f"{task}/prob"]).double(), eps=1e-7)
        for d in range(num_domains):
            fit = v_mask & (v_dom == d)
            if v_label[fit].sum() > 0:
                a, b = fit_platt(v_logit[fit], v_label[fit])
                rows = t_dom == d
                t_logit[rows] = a * t_logit[rows] + b
        out.rows[f"{task}/prob"] = [torch.sigmoid(t_logit).float()]
    return out


def run(args: argparse.Namespace) -> dict:
    cfg = apply_overrides(
        get_flavor(args.flavor), [*args.overrides, f"data.path={args.data}", f"train.seed={args.seed}"]
    )
    schema = EventSchema.load(cfg.data.path)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(cfg.train.seed)
    torch.set_float32_matmul_precision("high")
    model = build_model(cfg.model, schema).to(device)
    options, notes = step_options(cfg, has_lookups=hasattr(model, "look_up"))
    for note in notes:
        print(note, flush=True)
    # As the harness chooses (gem.module.RecModule.configure_optimizers): MasterAdamW, AdamW's update, steps the
    # sparse tables' rows and keeps the static step's cast-once copies; torch's AdamW otherwise.
    master = options.sparse_tables or (options.shapes is not None and options.cast_once)
    adamw = MasterAdamW if master else torch.optim.AdamW
    optimizer = adamw(model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    if master:
        optimizer.defer_rows(model)
    autocast_dtype = torch.bfloat16 if cfg.train.precision.startswith("bf16") else None
    eval_cfg = dataclasses.replace(cfg.data, batch_size=args.eval_batch_size, token_budget=0)
    stream = EventStream(cfg.data.path, cfg.data.train_split, cfg.data, training=True)
    static_step = None
    if options.shapes is not None:
        static_step = build_static_step(model, optimizer, autocast_dtype=autocast_dtype, config=options.graphs,
                                        cast_once=options.cast_once, grad_clip=cfg.train.grad_clip)
    train_data = PaddedBatches(stream, options.shapes) if options.shapes is not None else stream
    history: list[dict] = []
    start = time.perf_counter()
    deadline = start + args.time_budget if args.time_budget > 0 else None
    schedule = build_lr_schedule(cfg.train)
    scheduled = ScheduledLR(optimizer, schedule, deadline) if schedule is not None else None
    for epoch in range(args.epochs):
        if history and deadline is not None and time.perf_counter() > deadline:
            break
        stream.set_epoch(epoch)
        record = {
            "epoch": epoch,
            **train_epoch(
                model,
                optimizer,
                build_dataloader(train_data, cfg.data),
                grad_clip=cfg.train.grad_clip,
                autocast_dtype=autocast_dtype,
                max_steps=args.max_steps,
                deadline=deadline,
                static_step=static_step,
                prepare=options.shapes if options.graphs.cuda_graphs else None,
            ),
            "elapsed_s": time.perf_counter() - start,
            "lr": scheduled.last_lr if scheduled is not None else cfg.train.lr,
        }
        with autocast(device, autocast_dtype):  # scored as trained (the harness evaluates bf16-mixed runs so too)
            valid = predict_split(model, cfg.data.path, "valid", eval_cfg)
            test = predict_split(model, cfg.data.path, "test", eval_cfg)
        record["valid"] = valid.metrics(schema.num_domains)
        record["test"] = test.metrics(schema.num_domains)
        record["test_recalibrated"] = recalibrate(valid, test, schema.num_domains).metrics(schema.num_domains)
        history.append(record)
        print(
            json.dumps(
                {k: record[k] for k in ("epoch", "loss", "tokens_per_s")}
                | {
                    "valid_click_ne": record["valid"].get("click/ne"),
                    "test_click_ne": record["test"].get("click/ne"),
                    "test_recalibrated_click_ne": record["test_recalibrated"].get("click/ne"),
                }
            ),
            flush=True,
        )
    best = min(history, key=lambda r: r["valid"].get("click/ne", float("inf")))
    train_flops, train_rows = sum(r["flops"] for r in history), sum(r["rows"] for r in history)
    result = {
        "flavor": args.flavor,
        "overrides": args.overrides,
        "seed": args.seed,
        "data": cfg.data.path,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_rows": train_rows,
        "train_flops": train_flops,
        "train_flops_at_best": sum(r["flops"] for r in history[: best["epoch"] + 1]),
        "flops_per_example": train_flops / max(train_rows, 1),
        "config": cfg.to_dict(),
        "best_epoch": best["epoch"],
        "test": best["test"],
        "test_recalibrated": best["test_recalibrated"],
        "history": history,
    }
    if args.json:
        atomic_write_text(args.json, json.dumps(result, indent=2, default=str))
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="a synthetic (ctr) dataset directory")
    parser.add_argument("--flavor", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument(
        "--time-budget", type=float, default=0.0, help="seconds of training, then stop (0: none)"
    )
    parser.add_argument("--max-steps", type=int, default=-1, help="steps per epoch at most (-1: the whole split)")
    parser.add_argument("--eval-batch-size", type=int, default=1024)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "overrides", nargs="*", help="dotted overrides of the flavor, e.g. model.teacher.max_len=32"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    result = run(build_parser().parse_intermixed_args(argv))
    test = result["test"]
    print(
        json.dumps(
            {"best_epoch": result["best_epoch"]} | {k: v for k, v in test.items() if "/d" not in k}, indent=2
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
