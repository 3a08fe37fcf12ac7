"""Where an epoch of ``gem train --flavor ml1m_hstu`` (the Lightning harness) spends its time, against the plain
loop of :mod:`experiments.ml1m_hstu` on the same model and data.

    python -m experiments.bench_ml1m_harness --data data/ml1m --epochs 3 --runs 3 --json runs/harness.json
    python -m experiments.bench_ml1m_harness --data data/ml1m data.max_len=16 model.teacher.max_len=16   # short steps
    python -m experiments.bench_ml1m_harness --data data/ml1m --side harness train.check_val_every_n_epoch=1

Both sides train the flavor's model (``--flavor`` and ``section.field=value`` overrides, applied to both) for
``--epochs`` epochs, ``--runs`` times each (``--side`` one of them), in this process:

- ``harness``: :class:`gem.datamodule.EventDataModule`, :class:`gem.module.RecModule` and the Trainer of
  :func:`gem.train.build_trainer`, with its checkpoints, cadences and callbacks, but no MLflow run (``gem
  train`` adds one MLflow write every ``log_every_n_steps`` steps and after each validation);
- ``loop``: the script's loop: the train split read in this process with its row groups cached, fused
  AdamW with the script's betas and no gradient clipping, :func:`gem.loop.train_step`, validation (the
  valid split only) with the script's ``evaluate`` every ``--eval-every`` epochs and at the last.

Per epoch it records the wall time and the process's CPU time, the steps (``steps_s``: batch start to batch
end, with the harness's per-step logging and step-cadence checkpoints), what lies between steps
(``between_s``: reading, collating and moving the batch, the loop's own code), and the validation passes
(``val_s``, with the harness's checkpoint after each). On a GPU every epoch and validation boundary waits for
the device. The summary gives medians over runs of the epochs after the first (which reads the data for the
first time and, on a GPU, compiles and tunes the kernels): seconds per epoch, the training part of an epoch
(less validation), seconds per validation pass, wall and CPU, and the flavor's ``max_epochs`` projected from
them at each side's validation cadence. On a shared CPU the CPU seconds are the figure to compare: other
jobs stretch wall time. Figures go to docs/benchmarks.md ("HSTU on MovieLens-1M").
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import lightning as L
import torch

from experiments.ml1m_hstu import evaluate
from foundation.config import apply_overrides
from foundation.data.io import atomic_write_text
from foundation.data.pipeline import EventStream, build_dataloader, valid_item_mask
from gem.config import ExperimentConfig
from gem.datamodule import EventDataModule
from gem.flavors import get_flavor
from gem.loop import train_step
from gem.module import RecModule
from gem.train import build_trainer


def device_clock() -> float:
    """``time.perf_counter()`` once the GPU (if any) has finished what was queued: epochs end on the device."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def new_record() -> dict:
    return {
        "wall_s": 0.0, "cpu_s": 0.0, "steps_s": 0.0, "between_s": 0.0, "val_s": 0.0, "val_cpu_s": 0.0, "val_passes": 0,
        "steps": 0,
    }


class EpochClock(L.Callback):
    """Per epoch: wall, time in steps, time between steps, validation passes (append it last)."""

    def __init__(self) -> None:
        self.epochs: list[dict] = []
        self.mark = 0.0

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.epochs.append(new_record())
        self.started, self.cpu_started = device_clock(), time.process_time()
        self.mark = self.started

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        now = time.perf_counter()
        self.epochs[-1]["between_s"] += now - self.mark
        self.mark = now

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        self.epochs[-1]["steps_s"] += now - self.mark
        self.epochs[-1]["steps"] += 1
        self.mark = now

    def on_validation_start(self, trainer, pl_module) -> None:
        self.val_started, self.val_cpu_started = device_clock(), time.process_time()

    def on_validation_end(self, trainer, pl_module) -> None:
        now = device_clock()
        self.epochs[-1]["val_s"] += now - self.val_started
        self.epochs[-1]["val_cpu_s"] += time.process_time() - self.val_cpu_started
        self.epochs[-1]["val_passes"] += 1
        self.mark = now

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.epochs[-1]["wall_s"] = device_clock() - self.started
        self.epochs[-1]["cpu_s"] = time.process_time() - self.cpu_started


def harness_run(cfg: ExperimentConfig, out: Path) -> list[dict]:
    """Epoch records of one fit through the harness's Trainer."""
    L.seed_everything(cfg.train.seed, workers=True, verbose=False)
    datamodule = EventDataModule(cfg.data)
    module = RecModule(cfg.to_dict(), json.loads(datamodule.schema.to_json()))
    cfg.train.out_dir = str(out)
    trainer = build_trainer(cfg, None, None)
    clock = EpochClock()
    trainer.callbacks.append(clock)
    trainer.fit(module, datamodule=datamodule)
    return clock.epochs


def loop_run(cfg: ExperimentConfig, eval_every: int) -> list[dict]:
    """Epoch records of the script's loop (module docstring) on the same model and data."""
    torch.manual_seed(cfg.train.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    schema = EventDataModule(cfg.data).schema
    model = RecModule(cfg.to_dict(), json.loads(schema.to_json())).model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, betas=(0.9, 0.98), weight_decay=0.0, fused=True)
    stream = EventStream(cfg.data.path, cfg.data.train_split, cfg.data, training=True, cache_blocks=True)
    valid = EventStream(cfg.data.path, cfg.data.eval_split, cfg.data, training=False, cache_blocks=True)
    items = valid_item_mask(cfg.data.path, schema.num_items)
    epochs = []
    for epoch in range(cfg.train.max_epochs):
        record = new_record()
        started, cpu_started = device_clock(), time.process_time()
        mark = started
        stream.set_epoch(epoch)
        for batch in build_dataloader(stream, cfg.data):
            batch = batch.to(device, non_blocking=True)
            now = time.perf_counter()
            record["between_s"] += now - mark
            train_step(model, batch, optimizer)
            mark = time.perf_counter()
            record["steps_s"] += mark - now
            record["steps"] += 1
        if (epoch + 1) % eval_every == 0 or epoch + 1 == cfg.train.max_epochs:
            now, cpu = device_clock(), time.process_time()
            evaluate(model, valid, cfg.data, items)
            record["val_s"] += device_clock() - now
            record["val_cpu_s"] += time.process_time() - cpu
            record["val_passes"] += 1
        record["wall_s"] = device_clock() - started
        record["cpu_s"] = time.process_time() - cpu_started
        epochs.append(record)
    return epochs


def summarise(runs: list[list[dict]], max_epochs: int, val_every: int) -> dict:
    """Medians over runs of the epochs after the first; ``projected_s``: ``max_epochs`` at ``val_every``."""
    later = [run[1:] or run for run in runs]

    def median_of(key) -> float:
        return statistics.median(statistics.mean(key(e) for e in epochs) for epochs in later)

    passes = [e for epochs in runs for e in epochs if e["val_passes"]]

    def per_pass(key) -> float:
        return statistics.median(e[key] / e["val_passes"] for e in passes) if passes else 0.0

    validations = -(-max_epochs // val_every)
    train_s, train_cpu_s = median_of(lambda e: e["wall_s"] - e["val_s"]), median_of(lambda e: e["cpu_s"] - e["val_cpu_s"])
    return {
        "epoch_s": median_of(lambda e: e["wall_s"]),
        "epoch_cpu_s": median_of(lambda e: e["cpu_s"]),
        "train_s": train_s,
        "train_cpu_s": train_cpu_s,
        "steps_s": median_of(lambda e: e["steps_s"]),
        "between_s": median_of(lambda e: e["between_s"]),
        "val_pass_s": per_pass("val_s"),
        "val_pass_cpu_s": per_pass("val_cpu_s"),
        "val_every": val_every,
        "projected_s": max_epochs * train_s + validations * per_pass("val_s"),
        "projected_cpu_s": max_epochs * train_cpu_s + validations * per_pass("val_cpu_s"),
    }


def run(args: argparse.Namespace) -> dict:
    cfg = apply_overrides(
        get_flavor(args.flavor),
        [f"data.path={args.data}", "train.progress_bar=false", f"train.max_epochs={args.epochs}", *args.overrides],
    )
    flavor_epochs = get_flavor(args.flavor).train.max_epochs
    harness_every = getattr(cfg.train, "check_val_every_n_epoch", 1)
    report = {
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "flavor": args.flavor,
        "overrides": args.overrides,
        "epochs": args.epochs,
        "runs": {"harness": [], "loop": []},
    }
    sides = ("harness", "loop") if args.side == "both" else (args.side,)
    for _ in range(args.runs):
        if "harness" in sides:
            with tempfile.TemporaryDirectory() as out:
                report["runs"]["harness"].append(harness_run(copy.deepcopy(cfg), Path(out)))
        if "loop" in sides:
            report["runs"]["loop"].append(loop_run(cfg, args.eval_every))
    every = {"harness": harness_every, "loop": args.eval_every}
    report["summary"] = {side: summarise(report["runs"][side], flavor_epochs, every[side]) for side in sides}
    return report


def format_report(report: dict) -> str:
    lines = [f"{report['flavor']} {' '.join(report['overrides'])} on {report['machine']}, torch {report['torch']}"]
    for side, s in report["summary"].items():
        lines.append(
            f"{side:<8} epoch {s['epoch_s']:.3f} s (train {s['train_s']:.3f}: steps {s['steps_s']:.3f}, between "
            f"{s['between_s']:.3f}; {s['train_cpu_s']:.3f} CPU s); validation {s['val_pass_s']:.3f} s/pass "
            f"({s['val_pass_cpu_s']:.3f} CPU s) every {s['val_every']}; {s['projected_s']:.0f} s "
            f"({s['projected_cpu_s']:.0f} CPU s) projected"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="a converted next_item dataset (schema.json)")
    parser.add_argument("--flavor", default="ml1m_hstu")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--side", choices=("both", "harness", "loop"), default="both")
    parser.add_argument("--eval-every", type=int, default=10, help="the loop's validation cadence (the script's default)")
    parser.add_argument("--json")
    parser.add_argument("overrides", nargs="*", help="config overrides for both sides, e.g. data.max_len=16")
    args = parser.parse_intermixed_args(argv)
    report = run(args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.json, json.dumps(report, indent=2))
    print(format_report(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
