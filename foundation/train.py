"""Training harness: LightningModule, DataModule, ``train()`` and ``evaluate()``, tracked in MLflow.

The path a newcomer should read: ``train(cfg)`` builds the :class:`EventDataModule` (Parquet ->
``JaggedBatch``), the :class:`RecModule` (any model from ``foundation.model.registry``), a
Lightning ``Trainer`` with ``ModelCheckpoint`` and an ``MLFlowLogger``, then fits, resuming from
``last.ckpt`` when the run directory has one. ``evaluate(ckpt, split)`` scores a split and returns
NE/AUC/calibration per task, overall and per domain, beside the oracle and base-rate predictors.

Students learn from a teacher through ``cfg.transfer.teacher_outputs`` (split -> teacher-output
directory): the module reads each split's outputs once, verified, and passes a model whose ``forward``
takes ``teacher=`` the batch's rows (:meth:`RecModule.forward_batch`); the MLflow run is tagged with
the teacher's run id, checkpoint sha256 and the manifests it read (:func:`transfer_lineage`).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import time
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning as L
import mlflow
import mlflow.system_metrics
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.plugins.io import TorchCheckpointIO

from foundation.config import ConfigError, ExperimentConfig, experiment_from_dict
from foundation.data.batch import BatchPosition, JaggedBatch
from foundation.data.io import CorruptFileError, atomic_path
from foundation.data.pipeline import DataConfig, EventStream, build_dataloader, valid_item_mask
from foundation.data.schema import TASKS, EventSchema
from foundation.metrics import PredictionLog, RankingMetrics
from foundation.model.flops import peak_flops, throughput_metrics
from foundation.model.outputs import ModelOutput
from foundation.model.registry import build_model

if TYPE_CHECKING:
    from transfer.sharing import SharingResult
    from transfer.teacher_outputs import TeacherOutputs

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"


def tracking_uri(cfg: ExperimentConfig | None = None) -> str:
    """The config's tracking URI, else ``$MLFLOW_TRACKING_URI``, else the local ``mlflow.db``."""
    configured = cfg.train.tracking_uri if cfg is not None else ""
    return configured or os.environ.get("MLFLOW_TRACKING_URI", DEFAULT_TRACKING_URI)


class EventDataModule(L.LightningDataModule):
    """Train/val/test streams over one dataset directory; its state is the data position.

    The training module reports every consumed batch (:meth:`record`); the position is saved in the
    checkpoint, and on resume the streams skip what was consumed, so the run continues exactly.
    """

    def __init__(self, cfg: DataConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.schema = EventSchema.load(cfg.path)
        self.epoch = 0
        self.consumed: dict[int, int] = {}
        self.next_worker_stream = 0
        self.train_stream: EventStream | None = None

    def _rank_world(self) -> tuple[int, int]:
        trainer = self.trainer
        if trainer is None:
            return 0, 1
        # GemParallelStrategy says how data-parallel ranks read (tp/cp peers read the same rows).
        return getattr(trainer.strategy, "data_rank_world", (trainer.global_rank, trainer.world_size))

    def _stream(self, split: str, training: bool) -> EventStream:
        rank, world = self._rank_world()
        return EventStream(self.cfg.path, split, self.cfg, training=training, rank=rank, world_size=world)

    def train_dataloader(self):
        self.train_stream = self._stream(self.cfg.train_split, training=True)
        self.start_epoch(self.epoch)
        return build_dataloader(self.train_stream, self.cfg)

    def val_dataloader(self):
        return build_dataloader(self._stream(self.cfg.eval_split, training=False), self.cfg)

    def test_dataloader(self):
        return build_dataloader(self._stream(self.cfg.test_split, training=False), self.cfg)

    def start_epoch(self, epoch: int) -> None:
        """Point the train stream at ``epoch``; a restarted epoch keeps its consumed counts as skips."""
        if epoch != self.epoch:
            self.epoch, self.consumed, self.next_worker_stream = epoch, {}, 0
        if self.train_stream is not None:
            self.train_stream.set_epoch(epoch)
            self.train_stream.set_skip(self.consumed, self.next_worker_stream)

    def record(self, position: BatchPosition) -> None:
        if position.epoch == self.epoch:
            self.consumed[position.stream] = position.index + 1
            self.next_worker_stream = (position.stream + 1) % max(self.cfg.num_workers, 1)

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "consumed": dict(self.consumed),
            "next_worker_stream": self.next_worker_stream,
            "num_workers": self.cfg.num_workers,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_workers"] != self.cfg.num_workers:
            raise ValueError(
                f"cannot resume exactly: the checkpoint was written with data.num_workers={state['num_workers']}, "
                f"this run has {self.cfg.num_workers}"
            )
        self.epoch, self.consumed = state["epoch"], dict(state["consumed"])
        self.next_worker_stream = state["next_worker_stream"]


class RecModule(L.LightningModule):
    """Trains any registered model on ``JaggedBatch`` es.

    Logs the loss, tokens/s (and TFLOP/s and MFU for models with a FLOP counter, on a GPU whose
    peak is known), and at validation NE/AUC/calibration per task and domain (``ctr``) or
    HR@K/NDCG@K with full ranking (``next_item``).
    """

    def __init__(self, config: dict[str, Any], schema: dict[str, Any], from_checkpoint: bool = False) -> None:
        super().__init__()
        # Kept in checkpoints for load_module; train() logs the config to MLflow itself, once per run
        # (Lightning would re-log it on every resume, and MLflow refuses a changed param value).
        self.save_hyperparameters(ignore=["from_checkpoint"], logger=False)
        self.cfg = experiment_from_dict(config)
        self.schema = EventSchema(**schema)
        self.model = build_model(self.cfg.model, self.schema)
        self.sharing = self.build_sharing(from_checkpoint)
        self.val_log = PredictionLog()
        self.val_ranking = RankingMetrics()
        self.valid_items: torch.Tensor | None = None
        self.step_flops = 0.0
        self.step_started = 0.0
        self.takes_teacher = "teacher" in inspect.signature(self.model.forward).parameters
        if self.cfg.transfer.teacher_outputs and not self.takes_teacher:
            raise ValueError(
                f"transfer.teacher_outputs is set, but model.arch={self.cfg.model.arch!r} takes no teacher outputs"
            )
        self._teacher_outputs: dict[str, TeacherOutputs] = {}

    def build_sharing(self, from_checkpoint: bool) -> SharingResult | None:
        """Teacher parameters in the model when ``transfer.share_from`` is set (:mod:`transfer.sharing`).

        A new module copies them from the teacher checkpoint and records their dims in the saved config
        (``transfer.shared_dims``); a module loaded ``from_checkpoint`` rebuilds that layout without the teacher.
        """
        if not self.cfg.transfer.share_from:
            return None
        # transfer.sharing imports this module, so it is imported on first use.
        from transfer.sharing import restore_shared_layout, share_from_config

        if from_checkpoint:
            return restore_shared_layout(self.model, self.cfg.transfer)
        result = share_from_config(self.model, self.cfg.transfer, self.cfg.model.arch)
        self.cfg.transfer.shared_dims = result.table_dims
        self.hparams["config"] = self.cfg.to_dict()
        return result

    def teacher_outputs(self, split: str) -> TeacherOutputs | None:
        """The verified teacher outputs configured for ``split`` (read once, then cached), or None.

        All splits must come from one teacher checkpoint (``transfer.checkpoint_sha256`` when set,
        else the one of the first split read); a mismatch raises the reader's error.
        """
        path = self.cfg.transfer.teacher_outputs.get(split)
        if path is None:
            return None
        if split not in self._teacher_outputs:
            # transfer.teacher_outputs imports this module, so it is imported on first use.
            from transfer.teacher_outputs import read_teacher_outputs

            first = next(iter(self._teacher_outputs.values()), None)
            expected = self.cfg.transfer.checkpoint_sha256 or (first.manifest["teacher"]["checkpoint_sha256"] if first else None)
            self._teacher_outputs[split] = read_teacher_outputs(path, checkpoint_sha256=expected)
        return self._teacher_outputs[split]

    def forward_batch(self, batch: JaggedBatch, split: str) -> ModelOutput:
        """The model's output on a batch of ``split``, given ``teacher=`` that split's rows when it takes them.

        The teacher rows (``{task}_logit [B]``, ``user_repr [B, d]``, ...) are on the batch's device; an
        example id without teacher outputs raises :class:`transfer.teacher_outputs.TeacherOutputsError`.
        """
        outputs = self.teacher_outputs(split)
        if outputs is None:
            return self.model(batch)
        device = batch.candidate.device
        teacher = {k: v.to(device, non_blocking=True) for k, v in outputs.take(batch.example_id).items()}
        return self.model(batch, teacher=teacher)

    def setup(self, stage: str) -> None:
        if self.schema.task == "next_item":
            self.valid_items = valid_item_mask(self.cfg.data.path, self.schema.num_items)

    def on_before_batch_transfer(self, batch: JaggedBatch, dataloader_idx: int) -> JaggedBatch:
        # Counted on the host batch: reading offsets after the copy would sync the device.
        if self.training and hasattr(self.model, "flops"):
            self.step_flops = self.model.flops(batch, training=True)
        return batch

    def transfer_batch_to_device(self, batch: JaggedBatch, device: torch.device, dataloader_idx: int) -> JaggedBatch:
        return batch.to(device, non_blocking=True)

    def on_train_batch_start(self, batch: JaggedBatch, batch_idx: int) -> None:
        self.step_started = time.perf_counter()

    def training_step(self, batch: JaggedBatch, batch_idx: int) -> torch.Tensor:
        out = self.forward_batch(batch, self.cfg.data.train_split)
        losses = self.model.loss(batch, out)
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is not None and batch.position is not None:
            datamodule.record(batch.position)
        for name, value in losses.items():
            self.log(f"train/{name}", value, prog_bar=name == "loss", batch_size=batch.batch_size)
        return losses["loss"]

    def on_train_batch_end(self, outputs: Any, batch: JaggedBatch, batch_idx: int) -> None:
        if (self.global_step % self.cfg.train.log_every_n_steps) != 0:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        peak = peak_flops(torch.cuda.get_device_name(self.device), self.cfg.train.precision) if self.device.type == "cuda" else None
        perf = throughput_metrics(self.step_flops, batch.num_tokens, time.perf_counter() - self.step_started, peak)
        if not self.step_flops:
            perf = {"tokens_per_s": perf["tokens_per_s"]}
        self.log_dict({f"perf/{k}": v for k, v in perf.items()}, batch_size=batch.batch_size)

    def validation_step(self, batch: JaggedBatch, batch_idx: int) -> None:
        out = self.forward_batch(batch, self.cfg.data.eval_split)
        losses = self.model.loss(batch, out)
        self.log("val/loss", losses["loss"], prog_bar=True, batch_size=batch.batch_size)
        if self.schema.task == "next_item":
            rank_batch(self.model, batch, self.val_ranking, self.valid_items)
        else:
            self.val_log.add(batch, out.logits)

    def on_validation_epoch_end(self) -> None:
        metrics = self.val_log.metrics(self.schema.num_domains, prefix="val/")
        if self.schema.task == "next_item":
            metrics = {f"val/{k}": v for k, v in self.val_ranking.compute().items()}
        self.val_log, self.val_ranking = PredictionLog(), RankingMetrics()
        if not self.trainer.sanity_checking:
            self.log_dict({k: v for k, v in metrics.items() if np.isfinite(v)}, batch_size=1)

    def on_train_epoch_start(self) -> None:
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is not None:
            datamodule.start_epoch(self.current_epoch)

    def configure_optimizers(self):
        params = self.parameters()
        if self.sharing is not None:
            # Shared teacher parameters train by the sharing policy: frozen, or in a lower-lr group.
            from transfer.sharing import build_param_groups

            params = build_param_groups(self.model, self.sharing, self.cfg.train.lr)
        return torch.optim.AdamW(params, lr=self.cfg.train.lr, weight_decay=self.cfg.train.weight_decay)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["rng_state"] = torch.get_rng_state()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "rng_state" in checkpoint:
            torch.set_rng_state(checkpoint["rng_state"])


class AtomicCheckpointIO(TorchCheckpointIO):
    """Write checkpoints to a temp file, fsync, then rename: a kill never leaves a partial checkpoint."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        with atomic_path(path) as tmp:
            torch.save(checkpoint, tmp)

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict[str, Any]:
        return load_checkpoint_file(path, map_location or "cpu")


def load_checkpoint_file(path: str | Path, map_location: Any = "cpu") -> dict[str, Any]:
    """Load a checkpoint with ``weights_only=True`` (no pickle code execution), with a clear error."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: checkpoint not found")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:
        raise CorruptFileError(f"{path}: unreadable checkpoint (truncated or corrupt?): {exc}") from exc


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def run_dir(cfg: ExperimentConfig) -> Path:
    return Path(cfg.train.out_dir) / cfg.name


def build_trainer(cfg: ExperimentConfig, logger: MLFlowLogger | None) -> L.Trainer:
    checkpoint = ModelCheckpoint(
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
        gradient_clip_val=cfg.train.grad_clip or None,
        log_every_n_steps=cfg.train.log_every_n_steps,
        val_check_interval=cfg.train.val_check_interval,
        num_sanity_val_steps=0,
        logger=logger if logger is not None else False,
        callbacks=callbacks,
        enable_progress_bar=cfg.train.progress_bar,
        enable_model_summary=False,
        deterministic=True,
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
    from transfer.teacher_outputs import MANIFEST_FILE

    tags: dict[str, str] = {}
    for split, path in module.cfg.transfer.teacher_outputs.items():
        teacher = module.teacher_outputs(split).manifest["teacher"]
        tags["gem.teacher_run_id"] = teacher["mlflow_run_id"] or ""
        tags["gem.checkpoint_sha256"] = teacher["checkpoint_sha256"]
        tags[f"gem.teacher_outputs.{split}"] = str((Path(path) / MANIFEST_FILE).resolve())
    if module.cfg.transfer.share_from:
        tags["gem.shared_from"] = str(Path(module.cfg.transfer.share_from).resolve())
    return tags


def record_resumed_config(run_id: str, cfg: ExperimentConfig) -> None:
    """On resume, record config values that differ from the run's logged params (MLflow params are write-once).

    The changed keys go to the tag ``gem.resume.changed`` and the whole config to the artifact
    ``config_resume_<n>.json``, ``n`` counting the resumes that changed something.
    """
    run = mlflow.get_run(run_id)
    changed = sorted(k for k, v in cfg.flat().items() if k in run.data.params and run.data.params[k] != str(v))
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
    module = RecModule(cfg.to_dict(), json.loads(datamodule.schema.to_json()))
    out = run_dir(cfg)
    out.mkdir(parents=True, exist_ok=True)
    last = out / "checkpoints" / "last.ckpt"
    run_id_file = out / "mlflow_run_id"
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
            mlflow.log_params(cfg.flat())
            mlflow.log_dict(cfg.to_dict(), "config.json")
            mlflow.set_tags(
                {"gem.stage": "train", "gem.flavor": cfg.name, "gem.dataset": str(cfg.data.path), **lineage}
            )
            (out / "mlflow_run_id").write_text(run.info.run_id)
        elif rank0:
            record_resumed_config(run.info.run_id, cfg)
        # Other ranks get no logger: even constructing one opens the tracking store.
        logger = (
            MLFlowLogger(experiment_name=cfg.train.experiment, tracking_uri=tracking_uri(cfg), run_id=run.info.run_id)
            if rank0
            else None
        )
        trainer = build_trainer(cfg, logger)
        trainer.fit(module, datamodule=datamodule, ckpt_path=str(last) if resuming else None, weights_only=True)
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


def load_module(ckpt_path: str | Path) -> RecModule:
    ckpt = load_checkpoint_file(ckpt_path)
    hp = ckpt.get("hyper_parameters")
    if not hp or "config" not in hp or "schema" not in hp:
        raise ValueError(f"{ckpt_path}: not a gem training checkpoint (no config/schema hyper-parameters)")
    module = RecModule(hp["config"], hp["schema"], from_checkpoint=True)
    module.load_state_dict(ckpt["state_dict"])
    return module.eval()


def rank_batch(model: torch.nn.Module, batch: JaggedBatch, ranking: RankingMetrics, valid_items: torch.Tensor | None) -> None:
    """Full ranking of each row's candidate among all items, the row's history excluded."""
    mask = valid_items.to(batch.candidate.device) if valid_items is not None else None
    ranking.update(model.score_items(batch), batch.candidate, batch.history["item_ids"], batch.offsets, valid_items=mask)


@torch.inference_mode()
def predict_split(module: RecModule, data_cfg: DataConfig, split: str) -> PredictionLog | RankingMetrics:
    """Predictions over a split: a :class:`PredictionLog` (``ctr``) or :class:`RankingMetrics` (``next_item``)."""
    from tqdm import tqdm

    next_item = module.schema.task == "next_item"
    result = RankingMetrics() if next_item else PredictionLog()
    valid_items = valid_item_mask(data_cfg.path, module.schema.num_items) if next_item else None
    stream = EventStream(data_cfg.path, split, data_cfg, training=False)
    device = next(module.parameters()).device
    for batch in tqdm(build_dataloader(stream, data_cfg), desc=f"eval {split}", unit="batch", leave=False):
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
