"""The main job on the embedded default: synthetic world -> training -> held-out evaluation.

It trains the flavor and its pooled-history-free variant, evaluates both on the test split (the
latest time window), and prints them beside the base-rate predictor and the oracle (the world's
true probabilities). Every step is an MLflow run in the local store; the comparison table is
logged as an artifact of a ``quickstart-report`` run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlflow

from foundation.config import apply_overrides
from foundation.data.schema import TASKS, EventSchema
from gem.config import ExperimentConfig
from gem.evaluate import evaluate
from gem.flavors import get_flavor, synth_preset
from gem.train import tracking_uri, train


def ensure_dataset(preset: str, path: str) -> dict[str, Any] | None:
    """Generate the synthetic world at ``path`` unless a complete dataset is already there."""
    if Path(path, "schema.json").is_file():
        return None
    from foundation.data.synthetic import generate_world

    return generate_world(synth_preset(preset), path, progress=True)


def build_variants(cfg: ExperimentConfig) -> dict[str, ExperimentConfig]:
    """The model under test and its ablation without pooled history."""
    no_history = apply_overrides(get_flavor(cfg.name), [f"data.path={cfg.data.path}", "model.dlrm.use_history=false"])
    no_history.name = f"{cfg.name}-no-history"
    no_history.train = cfg.train
    return {"model": cfg, "no_history": no_history}


def format_table(rows: dict[str, dict[str, float]], schema: EventSchema) -> str:
    domains = [f"d{k}" for k in range(schema.num_domains)]
    names = schema.domain_names or domains
    header = ["predictor", *(f"{t} NE" for t in TASKS), *(f"{t} AUC" for t in TASKS)]
    header += [f"click NE {n}" for n in names]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for name, m in rows.items():
        cells = [name]
        cells += [f"{m.get(f'{t}/ne', float('nan')):.4f}" for t in TASKS]
        cells += [f"{m.get(f'{t}/auc', float('nan')):.4f}" for t in TASKS]
        cells += [f"{m.get(f'click/ne/{d}', float('nan')):.4f}" for d in domains]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _pick(metrics: dict[str, float], prefix: str) -> dict[str, float]:
    """Rename ``click/oracle_ne/d0``-style keys of one predictor to ``click/ne/d0``."""
    out = {}
    for key, value in metrics.items():
        task, metric, *rest = key.split("/")
        if metric.startswith(prefix):
            out["/".join([task, metric.removeprefix(prefix), *rest])] = value
    return out


def run_quickstart(preset: str = "default", flavor: str = "default", overrides: list[str] | None = None) -> dict[str, Any]:
    cfg = apply_overrides(get_flavor(flavor), overrides or [])
    synth_stats = ensure_dataset(preset, cfg.data.path)
    schema = EventSchema.load(cfg.data.path)
    results, rows = {}, {}
    for label, variant in build_variants(cfg).items():
        trained = train(variant, resume=False)
        report = evaluate(trained["checkpoint"], cfg.data.test_split)
        with mlflow.start_run(run_id=trained["run_id"]):
            mlflow.log_metrics({f"test/{k}": v for k, v in report["metrics"].items() if v == v})
        results[label] = {"run_id": trained["run_id"], "checkpoint": trained["checkpoint"], **report}
        rows[variant.name] = {k: v for k, v in report["metrics"].items() if "oracle" not in k and "base_rate" not in k}
        if label == "model":
            rows["base rate (trivial)"] = _pick(report["metrics"], "base_rate_")
            rows["oracle (true p)"] = _pick(report["metrics"], "oracle_")
    table = format_table(rows, schema)
    mlflow.set_tracking_uri(tracking_uri(cfg))
    with mlflow.start_run(run_name="quickstart-report"):
        mlflow.set_tags({"gem.stage": "report", **{f"gem.run.{k}": v["run_id"] for k, v in results.items()}})
        mlflow.log_text(table, "quickstart_table.md")
    print("\nHeld-out (test split, latest time window):\n" + table)
    return {"synth": synth_stats, "results": results, "table": table}
