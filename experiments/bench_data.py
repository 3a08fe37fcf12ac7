"""Data benchmark: synthetic-world generation rows/s, and pipeline examples/s and tokens/s.

    python -m experiments.bench_data --preset default --out data/bench --json runs/bench_data.json

The pipeline is timed over one pass of the train split (read, validate, shuffle, pack, collate),
for each ``--workers`` setting, at the flavor's ``max_len`` and token budget. The first pass also
warms the page cache, so every timed pass reads from memory.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from foundation.data.io import atomic_write_text
from foundation.data.pipeline import DataConfig, EventStream, build_dataloader
from foundation.data.synthetic import generate_world
from gem.flavors import synth_preset


def time_pipeline(path: str, cfg: DataConfig) -> dict[str, float]:
    stream = EventStream(path, cfg.train_split, cfg, training=True)
    start = time.perf_counter()
    rows = tokens = batches = 0
    for batch in build_dataloader(stream, cfg):
        rows += batch.batch_size
        tokens += batch.num_tokens
        batches += 1
    seconds = time.perf_counter() - start
    return {
        "workers": cfg.num_workers,
        "max_len": cfg.max_len,
        "token_budget": cfg.token_budget,
        "batches": batches,
        "examples_per_s": rows / seconds,
        "tokens_per_s": tokens / seconds,
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="default")
    parser.add_argument("--out", default="data/bench")
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--token-budget", type=int, default=65536)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--json")
    args = parser.parse_args()

    out = Path(args.out) / args.preset
    gen = generate_world(synth_preset(args.preset), out, progress=True)
    report = {
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads",
        "generator": {k: gen[k] for k in ("total_rows", "seconds", "rows_per_s", "history_events_per_s")},
        "pipeline": [],
    }
    base = DataConfig(path=str(out), max_len=args.max_len, batch_size=args.batch_size, token_budget=args.token_budget)
    time_pipeline(str(out), base)
    for workers in args.workers:
        cfg = DataConfig(**{**base.__dict__, "num_workers": workers})
        report["pipeline"].append(time_pipeline(str(out), cfg))
    print(json.dumps(report, indent=2))
    if args.json:
        atomic_write_text(Path(args.json), json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
