"""Training throughput of a GEM teacher flavor through ``gem train``'s Lightning harness, on the world and with the
figures of :mod:`experiments.bench_teacher` (tokens/s, TFLOP/s, MFU, median step, start-up).

Usage::

    python -m experiments.bench_teacher_harness --flavor teacher-large --data /tmp/world --examples 80000 \\
        --steps 60 data.max_len=512 'train.bucket_rows=(64,72)' --json /tmp/harness_512.json
    python -m experiments.bench_teacher_harness --flavor teacher-debug --steps 3 --examples 2000 \\
        --data /tmp/world-small data.max_len=64 data.num_workers=0   # CPU smoke test

The flavor, with its ``section.field=value`` overrides, trains through the harness: :class:`gem.datamodule.EventDataModule`,
:class:`gem.module.RecModule` (its step as the flavor's switches make it: parameters cast once, padded batches
through :class:`gem.loop.StaticStep`, CUDA graphs; :mod:`gem.step_options`) and the Trainer of
:func:`gem.train.build_trainer` (precision, determinism, callbacks, checkpoint cadence; no MLflow logger), for
``--steps`` optimizer steps (``train.max_steps``) in a temporary run directory. ``data.path`` is ``--data``,
holding bench_teacher's synthetic world (generated there when absent, from the same ``--examples``,
``--users``, ``--items``, ``--world-max-history`` and ``--seed``).

Each step is timed end to end, the wait for data included, up to a device sync at its end (as bench_teacher
times its steps); its tokens and model FLOPs are the module's own count of the batch (a padded batch's real
rows). Reported as bench_teacher reports them (steady state after ``--warmup`` steps, ``--json``,
``--compare-losses`` against a bench_teacher or harness ``--json``, ``--record``), with the step's form: padded
steps, buckets, graphs captured, parameters cast once. ``--matmul-precision`` sets
``torch.set_float32_matmul_precision`` (``gem train`` leaves torch's default; bench_teacher sets ``high``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch

from experiments.bench_teacher import compare_losses, prepare_world, record_row, summarize
from foundation.config import apply_overrides
from foundation.model.flops import peak_flops
from foundation.model.padding import PaddedBatch
from gem.datamodule import EventDataModule
from gem.flavors import FLAVORS, get_flavor
from gem.module import RecModule
from gem.train import build_trainer


class StepClock(L.Callback):
    """Per training step: wall time since the previous step ended (synced), tokens, FLOPs, rows, longest row,
    loss, and whether the batch came padded; prints one line per step."""

    def __init__(self, build_start: float) -> None:
        self.build_start = build_start
        self.trace: dict[str, list] = {k: [] for k in ("times", "flops", "tokens", "rows", "max_lens", "losses", "padded")}
        self.first_step_from_build_s: float | None = None
        self.last = 0.0

    def on_train_start(self, trainer, pl_module) -> None:
        self.last = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        now = time.perf_counter()
        real = batch.real_rows if isinstance(batch, PaddedBatch) else batch.batch_size
        lengths = batch.lengths[:real]
        trace = self.trace
        trace["times"].append(now - self.last)
        trace["flops"].append(pl_module.throughput.flops)
        trace["tokens"].append(pl_module.throughput.tokens)
        trace["rows"].append(real)
        trace["max_lens"].append(int(lengths.max()) if real else 0)
        trace["losses"].append(float(pl_module.step_losses["loss"]))
        trace["padded"].append(isinstance(batch, PaddedBatch))
        self.last = now
        if self.first_step_from_build_s is None:
            self.first_step_from_build_s = now - self.build_start
        print(
            f"step {len(trace['times']):4d}  {trace['times'][-1] * 1e3:8.1f} ms  rows {real:5d}  tokens {trace['tokens'][-1]:7d}"
            f"  max_len {trace['max_lens'][-1]:5d}  loss {trace['losses'][-1]:.4f}",
            flush=True,
        )


def step_form(module: RecModule, padded: list[bool]) -> dict:
    """What the module's step was: the resolved switches, and what the static step and the cast did."""
    options, static = module.step_options, module.static_step
    return {
        "autocast_dtype": str(options.autocast_dtype) if options.autocast_dtype else None,
        "cast_once_parameters": len(module.cast_once.names) if module.cast_once is not None else 0,
        "bucket_rows": list(options.shapes.rows) if options.shapes else None,
        "padded_steps": sum(padded),
        "eager_steps": len(padded) - sum(padded),
        "buckets_used": len(static.slots) if static else 0,
        "graphs_captured": static.graphs if static else 0,
        "cuda_graphs": bool(static and options.graphs.cuda_graphs and not static.graphs_off),
        "notes": module.step_notes,
    }


def run(args: argparse.Namespace) -> dict:
    if args.matmul_precision:
        torch.set_float32_matmul_precision(args.matmul_precision)
    with tempfile.TemporaryDirectory(prefix="bench_teacher_harness_") as tmp:
        data_dir = Path(args.data) if args.data else Path(tmp) / "world"
        world = prepare_world(args, data_dir)
        print(f"world: {json.dumps(world)}", flush=True)
        cfg = get_flavor(args.flavor)
        apply_overrides(cfg, [
            f"data.path={data_dir}", f"train.out_dir={Path(tmp) / 'runs'}", f"train.max_steps={args.steps}",
            "train.progress_bar=false", *args.overrides,
        ])
        L.seed_everything(cfg.train.seed, workers=True, verbose=False)
        build_start = time.perf_counter()
        datamodule = EventDataModule(cfg.data)
        module = RecModule(cfg.to_dict(), json.loads(datamodule.schema.to_json()))
        trainer = build_trainer(cfg, None, None)
        clock = StepClock(build_start)
        trainer.callbacks.append(clock)
        trainer.fit(module, datamodule=datamodule)
        device = module.device
        device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        peak = peak_flops(device_name, cfg.train.precision) if device.type == "cuda" else None
        trace = clock.trace
        return {
            "flavor": args.flavor,
            "overrides": args.overrides,
            "precision": cfg.train.precision,
            "token_budget": cfg.data.token_budget,
            "max_history": cfg.data.max_len,
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "device_name": device_name,
            "torch": torch.__version__,
            "parameters": sum(p.numel() for p in module.model.parameters()),
            "peak_flops": peak,
            "world": world,
            "first_step_from_build_s": clock.first_step_from_build_s,
            "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
            "step": step_form(module, trace["padded"]),
            **summarize(trace, args.warmup, peak),
            "trace": trace,
            "args": vars(args),
        }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="teacher-large", choices=sorted(f for f in FLAVORS if f.startswith("teacher")))
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps (train.max_steps)")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the steady state")
    parser.add_argument("--data", default=None, help="world dir: reused if it holds a dataset, else generated")
    parser.add_argument("--examples", type=int, default=80_000, help="impressions of a generated world")
    parser.add_argument("--users", type=int, default=0, help="users of a generated world (0: examples / 10)")
    parser.add_argument("--items", type=int, default=0, help="items of a generated world (0: the preset's 500,000)")
    parser.add_argument("--world-max-history", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0, help="the generated world's seed (training: train.seed)")
    parser.add_argument(
        "--matmul-precision", default=None, choices=("highest", "high", "medium"),
        help="torch.set_float32_matmul_precision before training (default: leave it, as gem train does)",
    )
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--compare-losses", default=None, metavar="REF.json", help="another run's --json to compare losses with")
    parser.add_argument("--record", default=None, metavar="PATH", help="append the headline figures to this JSON table")
    parser.add_argument("--record-label", default=None, help="a label for the recorded row")
    parser.add_argument("overrides", nargs="*", help="experiment config overrides, e.g. data.max_len=512 'train.bucket_rows=(64,72)'")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_intermixed_args(argv)
    if args.compare_losses and not Path(args.compare_losses).is_file():
        raise SystemExit(f"--compare-losses: {args.compare_losses} does not exist")
    result = run(args)
    result["command"] = "python -m experiments.bench_teacher_harness " + shlex.join(argv)
    if args.compare_losses:
        result["loss_comparison"] = compare_losses(result["trace"], args.compare_losses)
    if args.record:
        result["recorded_row"] = record_row(Path(args.record), result, result["command"], args.record_label)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k not in ("trace", "args", "world")}, indent=2), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
