"""Where an ML-1M training step spends its host time: data loading, the parts of the step, syncs.

    python -m experiments.bench_ml1m_host --data /tmp/prep/dataset --flavor ml1m_hstu --json runs/host.json

Three measurements on one converted next_item dataset (e.g. ``sequences.tsv`` through
:mod:`experiments.ml1m_hstu`):

- ``data``: seconds per epoch of the train split (read, validate, shuffle, pack, collate) through a
  DataLoader with 2 workers (restarted every epoch, as the script did), in this process, and in this
  process with the row groups cached (the script's setting now); the first epoch warms the page cache;
- ``step``: milliseconds per training step on the real batches (128 users), the step as the script
  runs it, for AdamW in its default and its fused implementation;
- ``parts``: a ``torch.profiler`` pass over ``--profile`` steps: for the forward, the loss, the
  backward and the optimiser, the host time, the operators dispatched and (on CUDA) the device
  synchronisations (``cuda*Synchronize`` calls: every ``.item()``, ``.tolist()`` or ``int()`` of a
  device tensor makes one).

On a GPU the step is host-bound when its host time per step exceeds the GPU time, which the profiler's
CUDA rows give. Figures go to docs/benchmarks.md ("HSTU on MovieLens-1M").
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from foundation.data.io import atomic_write_text
from foundation.data.pipeline import DataConfig, EventStream, build_dataloader
from foundation.data.schema import EventSchema
from foundation.model.teacher import build_teacher, teacher_flavor

PARTS = ("forward", "loss", "backward", "optimizer")
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def epoch_seconds(dataset: Path, cfg: DataConfig, cache: bool, epochs: int) -> float:
    """Mean seconds per epoch over ``epochs`` epochs after a first (warming) one."""
    stream = EventStream(dataset, "train", cfg, training=True, cache_blocks=cache)
    times = []
    for epoch in range(epochs + 1):
        stream.set_epoch(epoch)
        start = time.perf_counter()
        for _ in build_dataloader(stream, cfg):
            pass
        times.append(time.perf_counter() - start)
    return sum(times[1:]) / epochs


def make_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> Callable:
    """One training step as the ML-1M script runs it, each part under a profiler label."""

    def step(batch) -> None:
        batch = batch.to(device, non_blocking=True)
        with record_function("forward"):
            out = model(batch)
        with record_function("loss"):
            loss = model.loss(batch, out)["loss"]
        with record_function("backward"):
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
        with record_function("optimizer"):
            optimizer.step()

    return step


def step_ms(step: Callable, batches: list, device: torch.device, steps: int) -> float:
    for batch in batches[:3]:
        step(batch)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for i in range(steps):
        step(batches[i % len(batches)])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / steps * 1e3


def profile_parts(step: Callable, batches: list, device: torch.device, steps: int) -> dict:
    """Per part: host ms per step, operators per step, device syncs per step (module docstring)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for i in range(steps):
            step(batches[i % len(batches)])
    events = prof.events()
    parts = {}
    for part in PARTS:
        spans = [e for e in events if e.name == part]
        inside = [
            e for e in events
            if any(s.time_range.start <= e.time_range.start and e.time_range.end <= s.time_range.end
                   and e.thread == s.thread for s in spans)
        ]
        parts[part] = {
            "host_ms": sum(s.cpu_time_total for s in spans) / steps / 1e3,
            "ops": sum(e.name.startswith("aten::") for e in inside) / steps,
            "syncs": sum(e.name.startswith(SYNC_EVENTS) for e in inside) / steps,
        }
    # Autograd runs the backward's operators on its own threads: count them by thread, not by span.
    main_threads = {s.thread for s in events if s.name in PARTS}
    parts["backward"]["ops"] += sum(
        e.name.startswith("aten::") and e.thread not in main_threads for e in events
    ) / steps
    return parts


def run(args: argparse.Namespace) -> dict:
    dataset = Path(args.data)
    schema = EventSchema.load(dataset)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.set_float32_matmul_precision("high")
    cfg = teacher_flavor(args.flavor)
    data_cfg = DataConfig(path=str(dataset), max_len=cfg.max_len, batch_size=args.batch_size, num_workers=0)
    report = {
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "flavor": args.flavor,
        "data_s_per_epoch": {
            "workers=2": epoch_seconds(dataset, DataConfig(**{**data_cfg.__dict__, "num_workers": 2}), False, args.epochs),
            "in-process": epoch_seconds(dataset, data_cfg, False, args.epochs),
            "in-process, cached": epoch_seconds(dataset, data_cfg, True, args.epochs),
        },
        "step_ms": {},
    }
    batches = list(build_dataloader(EventStream(dataset, "train", data_cfg, training=True), data_cfg))
    torch.manual_seed(0)
    model = build_teacher(cfg, schema).to(device)
    for name, options in (("AdamW", {}), ("AdamW fused", {"fused": True})):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.98), weight_decay=0.0, **options)
        step = make_step(model, optimizer, device)
        report["step_ms"][name] = step_ms(step, batches, device, args.steps)
    if args.profile:
        report["parts"] = profile_parts(step, batches, device, args.profile)
    return report


def format_report(report: dict) -> str:
    lines = [f"{report['flavor']} on {report['device']} ({report['machine']})"]
    lines += [f"data {k}: {v:.3f} s/epoch" for k, v in report["data_s_per_epoch"].items()]
    lines += [f"step ({k}): {v:.1f} ms" for k, v in report["step_ms"].items()]
    for part, row in report.get("parts", {}).items():
        lines.append(f"{part:<10} host {row['host_ms']:7.2f} ms/step  {row['ops']:7.0f} ops/step  {row['syncs']:4.1f} syncs/step")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="a converted next_item dataset (schema.json)")
    parser.add_argument("--flavor", default="ml1m_hstu")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=3, help="timed data epochs (after one warm-up)")
    parser.add_argument("--steps", type=int, default=20, help="timed training steps per optimiser")
    parser.add_argument("--profile", type=int, default=5, help="profiled steps (0: none)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    report = run(args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.json, json.dumps(report, indent=2))
    print(format_report(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
