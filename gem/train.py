"""Training runs: ``train(cfg)`` fits a flavor under Lightning and tracks it in MLflow.

The path a newcomer should read: ``train(cfg)`` builds the :class:`~gem.datamodule.EventDataModule`
(Parquet -> ``JaggedBatch``), the :class:`~gem.module.RecModule` (any model from :mod:`gem.registry`), a
Lightning ``Trainer`` with ``ModelCheckpoint`` and an ``MLFlowLogger``, then fits, resuming from
``last.ckpt`` when the run directory has one. The run is tagged with the teacher it learns from
(:func:`transfer_lineage`) and logs its config and the kernel switches in effect as params.
"""

from __future__ import annotations

import dataclasses
import json
import os
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import lightning as L
import mlflow
import mlflow.system_metrics
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.plugins.io import TorchCheckpointIO

from foundation.checkpoint import RUN_ID_FILE, load_checkpoint_file
from foundation.config import ConfigError
from foundation.data.io import atomic_path, sha256_file
from foundation.data.pipeline import count_rows
from gem.config import ExperimentConfig
from gem.datamodule import EventDataModule
from gem.errors import ResumeError, TrainingError
from gem.module import RecModule
from kernels.settings import effective_kernel_settings, kernel_environment
from transfer.teacher_outputs import MANIFEST_FILE

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"


def tracking_uri(cfg: ExperimentConfig | None = None) -> str:
    """The config's tracking URI, else ``$MLFLOW_TRACKING_URI``, else the local ``mlflow.db``."""
    configured = cfg.train.tracking_uri if cfg is not None else ""
    return configured or os.environ.get("MLFLOW_TRACKING_URI", DEFAULT_TRACKING_URI)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Write checkpoints to a temp file, fsync, then rename: a kill never leaves a partial checkpoint."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        with atomic_path(path) as tmp:
            torch.save(checkpoint, tmp)

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict[str, Any]:
        return load_checkpoint_file(path, map_location or "cpu")


def kernel_params() -> dict[str, Any]:
    """The kernel switches in effect (``kernels.effective.<field>``) and the environment variables that
    override the config (``kernels.env.<name>``), as MLflow params."""
    params = {f"kernels.effective.{k}": v for k, v in dataclasses.asdict(effective_kernel_settings()).items()}
    params.update({f"kernels.env.{name}": value for name, value in kernel_environment().items()})
    return params


def run_dir(cfg: ExperimentConfig) -> Path:
    return Path(cfg.train.out_dir) / cfg.name


class TrainedCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` that writes no ``last.ckpt`` at the end of a fit that took no step: that file
    would hold an untrained model that a later run resumes from or a later stage reads as trained."""

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step > 0:
            super().on_train_end(trainer, pl_module)


def build_trainer(cfg: ExperimentConfig, logger: MLFlowLogger | None) -> L.Trainer:
    checkpoint = TrainedCheckpoint(
        dirpath=run_dir(cfg) / "checkpoints",
        save_last=True,
        save_top_k=0,
        every_n_train_steps=cfg.train.checkpoint_every_n_steps,
    )
    callbacks = [checkpoint]
    if cfg.train.progress_bar:
        callbacks.append(TQDMProgressBar(refresh_rate=10))
    placement: dict[str, Any] = {"devices": cfg.train.devices, "plugins": [AtomicCheckpointIO()]}
    if cfg.parallel.enabled:
        from foundation.parallel.strategy import GemParallelStrategy, launch_world

        devices, nodes = launch_world()
        placement = {"devices": devices, "num_nodes": nodes, "strategy": GemParallelStrategy(cfg.parallel)}
    return L.Trainer(
        accelerator=cfg.train.accelerator,
        **placement,
        precision=cfg.train.precision,
        max_epochs=cfg.train.max_epochs,
        max_steps=cfg.train.max_steps,
        log_every_n_steps=cfg.train.log_every_n_steps,
        val_check_interval=cfg.train.val_check_interval,
        num_sanity_val_steps=0,
        logger=logger if logger is not None else False,
        callbacks=callbacks,
        enable_progress_bar=cfg.train.progress_bar,
        enable_model_summary=False,
        deterministic=True,
    )


def check_trained(trainer: L.Trainer, cfg: ExperimentConfig) -> None:
    """Refuse a fit that took no optimiser step: its checkpoint would be an untrained model."""
    if trainer.global_step > 0:
        return
    rows = count_rows(cfg.data.path, cfg.data.train_split)
    raise TrainingError(
        f"{Path(cfg.data.path) / cfg.data.train_split}: training ran 0 steps: the split has {rows} rows, "
        f"{quarantine_count(cfg.data.path)} quarantined in total (data.policy={cfg.data.policy}, see "
        f"{Path(cfg.data.path) / 'quarantine'}); no checkpoint was written"
    )


def quarantine_count(dataset_dir: str | Path) -> int:
    import pyarrow.parquet as pq

    qdir = Path(dataset_dir) / "quarantine"
    return sum(pq.ParquetFile(p).metadata.num_rows for p in qdir.glob("*.parquet")) if qdir.is_dir() else 0


def transfer_lineage(module: RecModule) -> dict[str, str]:
    """MLflow tags tying a run to the teacher outputs it reads: ``gem.teacher_run_id``,
    ``gem.checkpoint_sha256`` and ``gem.teacher_outputs.<split>`` (the manifest's path); empty without any.

    Reads (and so verifies) every configured split's outputs before training starts.
    """
    tags: dict[str, str] = {}
    for split, path in module.cfg.transfer.teacher_outputs.items():
        teacher = module.teacher_outputs(split).manifest["teacher"]
        tags["gem.teacher_run_id"] = teacher["mlflow_run_id"] or ""
        tags["gem.checkpoint_sha256"] = teacher["checkpoint_sha256"]
        tags[f"gem.teacher_outputs.{split}"] = str((Path(path) / MANIFEST_FILE).resolve())
    if module.cfg.transfer.share_from:
        tags["gem.shared_from"] = str(Path(module.cfg.transfer.share_from).resolve())
    return tags


def run_params(cfg: ExperimentConfig) -> dict[str, Any]:
    """What a training run logs as params: the resolved config and the kernel switches in effect."""
    return {**cfg.flat(), **kernel_params()}


def changed_params(logged: dict[str, str], current: dict[str, Any]) -> list[str]:
    """Keys of ``current`` whose logged value differs, and kernel override variables set or unset since."""
    changed = {k for k, v in current.items() if k in logged and logged[k] != str(v)}
    overrides = {k for k in (*logged, *current) if k.startswith("kernels.env.")}
    changed |= {k for k in overrides if logged.get(k) != (str(current[k]) if k in current else None)}
    return sorted(changed)


def record_resumed_config(run_id: str, cfg: ExperimentConfig) -> None:
    """On resume, record params that differ from the run's logged ones (MLflow params are write-once).

    The changed keys go to the tag ``gem.resume.changed`` and the whole config to the artifact
    ``config_resume_<n>.json``, ``n`` counting the resumes that changed something.
    """
    run = mlflow.get_run(run_id)
    changed = changed_params(run.data.params, run_params(cfg))
    if not changed:
        return
    resumes = int(run.data.tags.get("gem.resume.count", "0")) + 1
    mlflow.set_tags({"gem.resume.changed": ",".join(changed), "gem.resume.count": str(resumes)})
    mlflow.log_dict(cfg.to_dict(), f"config_resume_{resumes}.json")


def train(cfg: ExperimentConfig, *, resume: bool = True) -> dict[str, Any]:
    """Fit ``cfg`` and return ``{"run_id", "checkpoint", "checkpoint_sha256", "metrics"}``.

    With ``resume`` and an existing ``last.ckpt`` under the run directory, training continues from it
    (model, optimizer, RNG and data position), in the same MLflow run.

    With ``parallel.enabled`` (one process, or every process of a ``torchrun`` job) the
    :class:`~foundation.parallel.strategy.GemParallelStrategy` trains: checkpoints are DCP step
    directories under ``last.dcp/`` (resumed at any world size), ``last.ckpt`` is a single-file export
    written at the end, and only rank 0 opens the MLflow run (the other ranks return ``run_id`` None).
    """
    L.seed_everything(cfg.train.seed, workers=True)
    datamodule = EventDataModule(cfg.data)
    datamodule.verify_shards()
    module = RecModule(cfg.to_dict(), json.loads(datamodule.schema.to_json()))
    out = run_dir(cfg)
    out.mkdir(parents=True, exist_ok=True)
    last = out / "checkpoints" / "last.ckpt"
    run_id_file = out / RUN_ID_FILE
    resuming = resume and last.is_file()
    rank0 = True
    if cfg.parallel.enabled:
        from foundation.parallel.strategy import has_distributed_checkpoint, node_id

        cfg.parallel.validate(int(os.environ.get("WORLD_SIZE", "1")))
        resuming = resume and has_distributed_checkpoint(last)
        rank0 = int(os.environ.get("RANK", "0")) == 0
        mlflow.system_metrics.set_system_metrics_node_id(node_id())
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(
            f"launched as {os.environ['WORLD_SIZE']} processes (torchrun?): set parallel.enabled=true, "
            "else every process would train the whole model alone"
        )
    lineage = transfer_lineage(module)
    mlflow.set_tracking_uri(tracking_uri(cfg))
    if rank0:
        mlflow.set_experiment(cfg.train.experiment)
    # CPU, memory and (on GPU machines) device utilisation every few seconds, even for short runs.
    mlflow.system_metrics.set_system_metrics_sampling_interval(2)
    mlflow.system_metrics.set_system_metrics_samples_before_logging(1)
    run_id = run_id_file.read_text().strip() if resuming and run_id_file.is_file() else None
    run_context = mlflow.start_run(run_id=run_id, run_name=cfg.name, log_system_metrics=True) if rank0 else nullcontext()
    with run_context as run:
        if rank0 and run_id is None:
            mlflow.log_params(run_params(cfg))
            mlflow.log_dict(cfg.to_dict(), "config.json")
            mlflow.set_tags(
                {"gem.stage": "train", "gem.flavor": cfg.name, "gem.dataset": str(cfg.data.path), **lineage}
            )
            run_id_file.write_text(run.info.run_id)
        elif rank0:
            record_resumed_config(run.info.run_id, cfg)
        # Other ranks get no logger: even constructing one opens the tracking store.
        logger = (
            MLFlowLogger(experiment_name=cfg.train.experiment, tracking_uri=tracking_uri(cfg), run_id=run.info.run_id)
            if rank0
            else None
        )
        trainer = build_trainer(cfg, logger)
        try:
            trainer.fit(module, datamodule=datamodule, ckpt_path=str(last) if resuming else None, weights_only=True)
        except ResumeError as exc:
            raise ResumeError(
                f"{last}: cannot resume this run: {exc}; train under another train.out_dir or name, or pass "
                "--no-resume to start over (it replaces that checkpoint)"
            ) from None
        check_trained(trainer, cfg)
        trainer.save_checkpoint(last)
        if cfg.parallel.enabled:
            trainer.strategy.export_single_file_checkpoint(last)
        if not rank0:
            return {"run_id": None, "checkpoint": str(last), "checkpoint_sha256": "", "metrics": {}}
        sha = sha256_file(last)
        mlflow.log_metric("data/quarantined_rows", quarantine_count(cfg.data.path))
        mlflow.log_dict({"path": str(last.resolve()), "sha256": sha}, "checkpoint.json")
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        return {"run_id": run.info.run_id, "checkpoint": str(last), "checkpoint_sha256": sha, "metrics": metrics}


