"""Evaluation of a checkpoint on a split: NE/AUC/calibration beside the oracle and the base rate, or
full-ranking HR@K/NDCG@K for next-item data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from foundation.data.pipeline import DataConfig, EventStream, build_dataloader, valid_item_mask
from foundation.data.schema import TASKS, EventSchema
from foundation.metrics import PredictionLog, RankingMetrics
from gem.datamodule import estimate_batches
from gem.module import RecModule, load_module, rank_batch


@torch.inference_mode()
def predict_split(module: RecModule, data_cfg: DataConfig, split: str) -> PredictionLog | RankingMetrics:
    """Predictions over a split: a :class:`PredictionLog` (``ctr``) or :class:`RankingMetrics` (``next_item``)."""
    from tqdm import tqdm

    next_item = module.schema.task == "next_item"
    result = RankingMetrics() if next_item else PredictionLog()
    valid_items = valid_item_mask(data_cfg.path, module.schema.num_items) if next_item else None
    stream = EventStream(data_cfg.path, split, data_cfg, training=False)
    device = next(module.parameters()).device
    batches = tqdm(
        build_dataloader(stream, data_cfg), desc=f"eval {split}", unit="batch", leave=False,
        total=estimate_batches(data_cfg, split, world_size=1),
    )
    for batch in batches:
        batch = batch.to(device)
        if next_item:
            rank_batch(module.model, batch, result, valid_items)
        else:
            result.add(batch, module.forward_batch(batch, split).logits)
    return result


def evaluate(ckpt_path: str | Path, split: str = "test", *, data_path: str | None = None) -> dict[str, Any]:
    """Score ``split`` with a checkpoint.

    ``ctr`` data: NE/AUC/calibration per task, overall and per domain, beside the oracle and the
    base-rate predictor. ``next_item`` data: HR@K, NDCG@K and MRR with full ranking.
    """
    module = load_module(ckpt_path)
    data_cfg = module.cfg.data
    if data_path:
        data_cfg.path = data_path
    result = predict_split(module, data_cfg, split)
    if isinstance(result, RankingMetrics):
        metrics = result.compute()
    else:
        metrics = result.metrics(module.schema.num_domains)
        metrics.update(base_rate_metrics(result, module.schema.num_domains, data_cfg))
    return {"checkpoint": str(ckpt_path), "split": split, "flavor": module.cfg.name, "metrics": metrics}


def base_rate_metrics(log: PredictionLog, num_domains: int, data_cfg: DataConfig) -> dict[str, float]:
    """Metrics of the trivial predictor: each row gets its domain's training base rate of the task.

    Keys are ``{task}/base_rate_{metric}[/d{k}]``, beside the model's ``{task}/{metric}[/d{k}]``.
    """
    from foundation.data.io import iter_valid_row_groups, list_shards

    schema = EventSchema.load(data_cfg.path)
    positives = {t: np.zeros(num_domains) for t in TASKS}
    labelled = {t: np.zeros(num_domains) for t in TASKS}
    for shard in list_shards(data_cfg.path, data_cfg.train_split):
        for _, table in iter_valid_row_groups(shard, schema, policy="quarantine", quarantine=_NullQuarantine()):
            domain = table.column("domain").to_numpy()
            for task in TASKS:
                labels = table.column(task).to_numpy(zero_copy_only=False).astype(np.float64)
                present = ~np.isnan(labels)
                positives[task] += np.bincount(domain[present], labels[present], minlength=num_domains)
                labelled[task] += np.bincount(domain[present], minlength=num_domains)
    trivial = PredictionLog()
    trivial.rows = {k: list(v) for k, v in log.rows.items() if not k.endswith("/oracle")}
    domain = torch.cat(log.rows["domain"])
    for task in TASKS:
        if f"{task}/prob" in log.rows:
            rate = torch.from_numpy(positives[task] / np.maximum(labelled[task], 1)).float()
            trivial.rows[f"{task}/prob"] = [rate[domain]]
    out = {}
    for key, value in trivial.metrics(num_domains).items():
        task, metric, *rest = key.split("/")
        out["/".join([task, f"base_rate_{metric}", *rest])] = value
    return out


class _NullQuarantine:
    """Counts bad rows without writing them (base-rate estimation must not touch the dataset)."""

    count = 0

    def add(self, bad, source, row_group) -> None:
        self.count += bad.num_rows
