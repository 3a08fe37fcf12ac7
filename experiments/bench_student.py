"""How long one epoch of a student ranker takes through the harness (CPU by default).

``python -m experiments.bench_student --flavor student-default`` trains the flavor for one epoch on its
dataset's ``--split`` (Lightning, MLflow logging and the end-of-epoch validation included, as a transfer
report runs it) and prints wall seconds and training rows/s as JSON. The figure says
whether students of a transfer report fit on a CPU machine while the teacher trains on a GPU.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import pyarrow.parquet as pq

from foundation.config import apply_overrides
from foundation.data.io import list_shards
from gem.flavors import get_flavor
from gem.train import train


def split_rows(dataset: str, split: str) -> int:
    return sum(pq.ParquetFile(p).metadata.num_rows for p in list_shards(dataset, split))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="student-default")
    parser.add_argument("--split", default="train", help="split to train on")
    parser.add_argument("overrides", nargs="*", help="section.field=value overrides of the flavor")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = apply_overrides(get_flavor(args.flavor), args.overrides)
        cfg.data.train_split = args.split
        cfg.train.max_epochs, cfg.train.out_dir, cfg.train.progress_bar = 1, tmp, False
        cfg.train.accelerator = "cpu"
        cfg.train.tracking_uri = cfg.train.tracking_uri or f"sqlite:///{tmp}/mlflow.db"
        rows = split_rows(cfg.data.path, args.split)
        start = time.perf_counter()
        result = train(cfg, resume=False)
        seconds = time.perf_counter() - start
    print(json.dumps({
        "flavor": args.flavor, "split": args.split, "rows": rows, "batch_size": cfg.data.batch_size,
        "epoch_seconds": round(seconds, 1), "rows_per_s": round(rows / seconds, 1),
        "val_click_ne": result["metrics"].get("val/click/ne"),
    }, indent=2))


if __name__ == "__main__":
    main()
