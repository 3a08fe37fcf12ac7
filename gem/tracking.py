"""MLflow for training runs and pipelines: one run per run directory, metrics that survive kills, nesting.

- :func:`open_training_run` continues the run recorded in a run directory, adopts one a kill left before
  its id was recorded (tagged ``gem.run_dir``), or creates it; a restart never opens a second run.
- :class:`MetricRecorder` logs each ``(metric, step)`` once: a resumed run retrains the steps after its
  last checkpoint and their metrics, already logged, are skipped. The training callback logs a step's
  metrics before the checkpoint that covers it is written (:mod:`gem.callbacks`), so no step goes missing.
- :func:`reject_run` leaves no trace of a run that was refused before it trained (a bad config or dataset):
  it deletes a run this process created; a resumed one gets its previous status back.
- :func:`start_parent_run` / :func:`nest_under`: a pipeline or the quickstart is one parent run whose
  stages are its children (the ``mlflow.parentRunId`` tag the UI nests by).
"""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import mlflow
from mlflow.entities import Metric, RunStatus
from mlflow.tracking import MlflowClient

from foundation.checkpoint import RUN_ID_FILE
from foundation.data.io import atomic_write_text
from gem.run_dir import RUN_CONFIG_FILE

RUN_DIR_TAG = "gem.run_dir"
PARENT_TAG = "mlflow.parentRunId"
# Experiment tag MLflow 3's UI reads to open on the training-runs view instead of the GenAI one.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
TRAINING_EXPERIMENT_KIND = "custom_model_development"
LOG_BATCH_LIMIT = 1000


def ensure_experiment(name: str) -> str:
    """Set (creating it if needed) the experiment ``name``, marked as a model-training experiment."""
    experiment = mlflow.set_experiment(name)
    if experiment.tags.get(EXPERIMENT_KIND_TAG) != TRAINING_EXPERIMENT_KIND:
        MlflowClient().set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, TRAINING_EXPERIMENT_KIND)
    return experiment.experiment_id


class MetricRecorder:
    """A run's metrics, each ``(key, step)`` logged once; ``latest`` holds the newest value of every key.

    ``resumed``: the run has history already (read once here, so repeats of it are skipped).
    Non-finite values are not logged (no measurement, e.g. AUC of a domain without positives).
    """

    def __init__(self, run_id: str, *, resumed: bool, client: MlflowClient | None = None) -> None:
        self.client = client or MlflowClient()
        self.run_id = run_id
        self.logged: set[tuple[str, int]] = set()
        self.latest: dict[str, float] = {}
        if resumed:
            self._read_history()

    def _read_history(self) -> None:
        run = self.client.get_run(self.run_id)
        for key in run.data.metrics:
            if key.startswith("system/"):
                continue  # MLflow's monitor resumes its own steps
            history = self.client.get_metric_history(self.run_id, key)
            self.logged.update((key, m.step) for m in history)
            if history:
                self.latest[key] = max(history, key=lambda m: (m.step, m.timestamp)).value

    def log(self, metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        fresh = [
            Metric(key, float(value), now, step)
            for key, value in metrics.items()
            if (key, step) not in self.logged and math.isfinite(float(value))
        ]
        for start in range(0, len(fresh), LOG_BATCH_LIMIT):
            self.client.log_batch(self.run_id, metrics=fresh[start : start + LOG_BATCH_LIMIT])
        for metric in fresh:
            self.logged.add((metric.key, step))
            self.latest[metric.key] = metric.value


@dataclass
class TrainingRun:
    """The MLflow run a training process logs to. ``created``: this process created it (nothing trained
    before); ``previous_status``: its status before this process reopened it."""

    run_id: str
    created: bool
    previous_status: str | None = None


def _orphaned_run(experiment_id: str, run_dir: Path) -> str | None:
    """The newest RUNNING run of ``run_dir`` whose id a kill kept from being recorded, if any."""
    runs = MlflowClient().search_runs(
        [experiment_id],
        filter_string=f"tags.`{RUN_DIR_TAG}` = '{run_dir.resolve()}' and attributes.status = 'RUNNING'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    return runs[0].info.run_id if runs else None


def open_training_run(
    experiment_id: str, run_dir: Path, *, run_name: str, tags: dict[str, str], parent_run_id: str | None
) -> TrainingRun:
    """Start (fluent, with system metrics) the MLflow run of ``run_dir`` in ``experiment_id`` (the one set):
    the recorded one, an orphan of a kill, or a new one whose id is recorded at once."""
    id_file = run_dir / RUN_ID_FILE
    run_id = id_file.read_text().strip() if id_file.is_file() else _orphaned_run(experiment_id, run_dir)
    if run_id is not None:
        previous = MlflowClient().get_run(run_id).info.status
        mlflow.start_run(run_id=run_id, log_system_metrics=True)
        if parent_run_id and MlflowClient().get_run(run_id).data.tags.get(PARENT_TAG) != parent_run_id:
            mlflow.set_tag(PARENT_TAG, parent_run_id)
        created = False
    else:
        all_tags = {RUN_DIR_TAG: str(run_dir.resolve()), **tags}
        run = mlflow.start_run(run_name=run_name, tags=all_tags, parent_run_id=parent_run_id, log_system_metrics=True)
        run_id, previous, created = run.info.run_id, None, True
    if not id_file.is_file():
        atomic_write_text(id_file, run_id)
    return TrainingRun(run_id=run_id, created=created, previous_status=previous)


def reject_run(run: TrainingRun, run_dir: Path, *, trained: bool, reason: str) -> None:
    """End a run refused by a bad config or dataset without leaving a FAILED run behind.

    A run this process created and nothing was trained in is deleted, with its records in ``run_dir``;
    any other gets back the status it had (a killed one that was RUNNING becomes KILLED), tagged with
    ``gem.rejected``.
    """
    client = MlflowClient()
    if run.created and not trained:
        mlflow.end_run(RunStatus.to_string(RunStatus.KILLED))
        client.delete_run(run.run_id)
        for name in (RUN_ID_FILE, RUN_CONFIG_FILE):
            (run_dir / name).unlink(missing_ok=True)
        return
    mlflow.set_tag("gem.rejected", reason[:500])
    status = run.previous_status if run.previous_status in ("FINISHED", "KILLED") else "KILLED"
    mlflow.end_run(status)


def start_parent_run(experiment_id: str, run_name: str, tags: dict[str, str], run_id: str | None = None) -> str:
    """A pipeline's parent run (created, or ``run_id`` reopened) left RUNNING and not active in this process,
    so each stage can start its own run; :func:`nest_under` files the stages under it."""
    client = MlflowClient()
    if run_id is not None:
        status = client.get_run(run_id).info.status
        if status != "RUNNING":
            client.update_run(run_id, status="RUNNING")
        return run_id
    return client.create_run(experiment_id, run_name=run_name, tags=tags).info.run_id


def finish_parent_run(run_id: str, status: str = "FINISHED") -> None:
    MlflowClient().set_terminated(run_id, status)


def nest_under(parent_run_id: str, run_ids: list[str | None]) -> None:
    """Make runs that a stage created on its own children of ``parent_run_id``."""
    client = MlflowClient()
    for run_id in run_ids:
        if run_id and run_id != parent_run_id:
            client.set_tag(run_id, PARENT_TAG, parent_run_id)


def log_training_plots(run_id: str, metric_keys: tuple[str, ...]) -> None:
    """``plots/training.png``: each of ``metric_keys`` (those the run has) against the step, from the run's
    whole history (a resumed run's included)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    client = MlflowClient()
    histories = {k: sorted(client.get_metric_history(run_id, k), key=lambda m: m.step) for k in metric_keys}
    histories = {k: h for k, h in histories.items() if h}
    if not histories:
        return
    fig, axes = plt.subplots(1, len(histories), figsize=(4 * len(histories), 3), squeeze=False)
    for ax, (key, history) in zip(axes[0], histories.items(), strict=True):
        ax.plot([m.step for m in history], [m.value for m in history], marker="." if len(history) < 30 else None)
        ax.set_title(key)
        ax.set_xlabel("step")
    fig.tight_layout()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "training.png"
        fig.savefig(path, dpi=100)
        client.log_artifact(run_id, str(path), "plots")
    plt.close(fig)
