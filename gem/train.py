"""Training runs: ``train(cfg)`` fits a flavor under Lightning and tracks it in MLflow.

The path a newcomer should read: ``train(cfg)`` builds the :class:`~gem.datamodule.EventDataModule`
(Parquet -> ``JaggedBatch``), the :class:`~gem.module.RecModule` (any model from :mod:`gem.registry`), a
Lightning ``Trainer`` whose :class:`~gem.callbacks.RecordAndCheckpoint` logs metrics to MLflow and writes
``last.ckpt``, then fits, resuming from ``last.ckpt`` when the run directory (:mod:`gem.run_dir`) has one.
The run is tagged with the teacher it learns from (:func:`transfer_lineage`), logs its config and the kernel
switches in effect as params, and at the end its checkpoint and a plot of its loss and metrics.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import mlflow
import mlflow.system_metrics
import torch
from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_only

from foundation.checkpoint import load_checkpoint_file
from foundation.config import ConfigError
from foundation.data.io import CorruptFileError, atomic_path, sha256_file
from foundation.data.pipeline import count_rows
from foundation.data.schema import TASKS, SchemaError
from foundation.data.validate import DataValidationError
from foundation.model.precision import MasterAdamW
from gem.callbacks import GemProgressBar, RecordAndCheckpoint, ValidateLastEpoch
from gem.config import ExperimentConfig
from gem.datamodule import EventDataModule
from gem.errors import ResumeError, TrainingError
from gem.logs import route_library_loggers
from gem.module import RecModule
from gem.precompile import StepPrecompile, module_identity, start_precompile_step, step_key, warm_cache
from gem.run_dir import RUN_CONFIG_FILE, check_same_run, record_config, remove_stale_temps, train_lock
from gem.tracking import (
    MetricRecorder,
    TrainingRun,
    ensure_experiment,
    log_training_plots,
    open_training_run,
    reject_run,
)
from kernels.precompile import (
    KernelCompilePool,
    cache_entries,
    compiled_line,
    compiled_since,
    skip_reason,
    stop_workers,
)
from kernels.settings import effective_kernel_settings, kernel_environment
from transfer.sharing import SharingError
from transfer.teacher_outputs import MANIFEST_FILE, TeacherOutputsError

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
# Errors that mean the input (config, dataset, teacher outputs) is bad, not the code: the run is refused.
REJECTIONS = (
    ConfigError, DataValidationError, CorruptFileError, SchemaError, FileNotFoundError, SharingError,
    TeacherOutputsError, TrainingError, ResumeError,
)
PARAMS_LOGGED_TAG = "gem.params_logged"
_log = logging.getLogger(__name__)
PLOTTED_METRICS = ("train/loss", "val/loss", *(f"val/{task}/ne" for task in TASKS), "val/hr10", "val/ndcg10")


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


class PrecompileKernels(L.Callback):
    """``train.precompile_kernels``: the first training batch's Triton kernels compiled in parallel, overlapping it.

    The compile workers start when fitting starts (their start-up overlaps the data loader's); at the first
    batch the module's step is recorded (:func:`gem.precompile.start_precompile_step`: forward through the module's
    ``forward_batch``, under its autocast dtype), each kernel sent to the workers as the recording meets it, and the
    step runs while they compile, each launch waiting for its own kernel only; after it the workers end and one line
    names the kernels it still compiled itself. Where the step's manifest says Triton's cache already holds its
    kernels (the step's key: :func:`step_identity`), no worker starts and nothing is recorded. Off CUDA, in Triton's
    interpreter or where the module's resolved switch is off (:mod:`gem.step_options`), one logged line.
    """

    def __init__(self, early_workers: list | None = None) -> None:
        # Compile workers started before the harness was imported (gem.compile_workers): adopted or told to exit.
        self.early_workers = list(early_workers or [])
        self.pool: KernelCompilePool | None = None
        self.key: str | None = None
        self.done = False
        self.started: StepPrecompile | None = None
        self.gate = contextlib.ExitStack()  # the first step's launches wait for their kernels inside it
        self.report: dict | None = None
        self.cached: frozenset[str] | None = None  # Triton's cache entries before the first step

    def _enabled(self, pl_module) -> bool:
        options = getattr(pl_module, "step_options", None)
        return bool(options is not None and options.precompile_kernels)

    def on_fit_start(self, trainer, pl_module) -> None:
        early, self.early_workers = self.early_workers, []
        if not self._enabled(pl_module) or skip_reason(["step"]):
            stop_workers(early, wait=False)
            return
        self.key = step_key(
            step_identity(pl_module), autocast_dtype=pl_module.step_options.autocast_dtype, device=pl_module.device
        )
        # Here, before the sanity check's launches: on a warm cache this is what settles the kernels' keys to
        # those the earlier pool compiled under (a pool started below settles them itself).
        if warm_cache(self.key):
            stop_workers(early, wait=False)
            return
        try:
            self.pool = KernelCompilePool(device=pl_module.device.index or 0, processes=early)
        except Exception as err:  # the JIT compiles at the first launches, as without this callback
            _log.warning("kernel precompile: no compile pool (%s: %s)", type(err).__name__, err)
            stop_workers(early, wait=False)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.done:
            return
        self.done = True
        if not self._enabled(pl_module):
            return
        split = pl_module.cfg.data.train_split
        options = pl_module.step_options
        optimizers = getattr(trainer, "optimizers", None) or [None]
        optimizer = optimizers[0]
        self.started = start_precompile_step(
            pl_module.model, batch, autocast_dtype=options.autocast_dtype,
            forward=lambda b: pl_module.forward_batch(b, split),
            cast_dtype=options.autocast_dtype if options.cast_once else None,
            master_adamw=isinstance(getattr(optimizer, "optimizer", optimizer), MasterAdamW), pool=self.pool,
            key=self.key, log=_log.info,
        )
        self.report = self.started.result
        if self.started.job is None:
            self.close(wait=False)
        else:
            self.gate.enter_context(self.started.gate())
        # After a skip on the manifest too: the line after the step shows whether the cache held what it said.
        if not self.report["skipped"] or self.report["cached"]:
            self.cached = cache_entries()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        """After the first step: the compiles' report, and one line naming the kernels the step still compiled
        itself (what the precompile missed)."""
        self.finish()
        if self.cached is not None:
            compiled = compiled_since(self.cached | frozenset(self.report.pop("entries", ())))
            self.cached = None
            self.report["first_step_compiled"] = compiled
            _log.info(compiled_line("first step", compiled))

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.finish()

    def on_fit_end(self, trainer, pl_module) -> None:
        stop_workers(self.early_workers, wait=False)
        self.early_workers = []
        self.finish()
        self.close()

    def finish(self) -> None:
        """Leave the first step's gate, wait for the compiles left and end the workers (without waiting for them)."""
        self.gate.close()
        if self.started is not None and self.started.job is not None:
            self.report = self.started.finish()
            self.close(wait=False)

    def close(self, *, wait: bool = True) -> None:
        """Ends the workers; ``wait=False`` before the first step, which need not wait for them to exit."""
        if self.pool is not None:
            self.pool.close(wait=wait)
            self.pool = None


def step_identity(pl_module: RecModule) -> list[str]:
    """What decides the kernels of ``pl_module``'s first training step, for its manifest key
    (:func:`gem.precompile.step_key`): the model (:func:`gem.precompile.module_identity`), the module's class (its
    ``forward_batch``), the step's switches (cast once, static shapes) and the data config (the first batch)."""
    options = pl_module.step_options
    return [
        module_identity(pl_module.model), f"{type(pl_module).__module__}.{type(pl_module).__qualname__}",
        f"cast_once {options.cast_once}", f"shapes {options.shapes!r}", repr(pl_module.cfg.data),
    ]


def build_trainer(
    cfg: ExperimentConfig,
    logger: MLFlowLogger | None,
    recorder: MetricRecorder | None,
    compile_workers: list | None = None,
) -> L.Trainer:
    """The Lightning trainer of ``cfg``; ``compile_workers``: processes of :func:`gem.compile_workers.start_compile_workers`
    for :class:`PrecompileKernels` to adopt (told to exit where the run does not precompile)."""
    if cfg.train.check_val_every_n_epoch < 1:
        raise ConfigError(f"train.check_val_every_n_epoch={cfg.train.check_val_every_n_epoch} must be at least 1")
    callbacks: list[L.Callback] = [
        RecordAndCheckpoint(
            run_dir(cfg) / "checkpoints" / "last.ckpt",
            every_n_steps=cfg.train.checkpoint_every_n_steps,
            log_every_n_steps=cfg.train.log_every_n_steps,
            recorder=recorder,
        ),
        ValidateLastEpoch(cfg.train.check_val_every_n_epoch),
    ]
    if cfg.train.progress_bar:
        callbacks.append(GemProgressBar(refresh_rate=10))
    if cfg.train.precompile_kernels:
        callbacks.append(PrecompileKernels(compile_workers))
    elif compile_workers:
        stop_workers(compile_workers, wait=False)
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
        check_val_every_n_epoch=cfg.train.check_val_every_n_epoch,
        num_sanity_val_steps=0,
        logger=logger if logger is not None else False,
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=cfg.train.progress_bar,
        enable_model_summary=False,
        deterministic=cfg.train.deterministic,
    )


class RecorderLogger(MLFlowLogger):
    """Lightning's MLflow logger for what the strategy logs itself (``train/global_loss``, ...), written through
    the run's :class:`~gem.tracking.MetricRecorder` so a resumed run logs no step twice."""

    def __init__(self, recorder: MetricRecorder, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.recorder = recorder

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        self.recorder.log({k: v for k, v in metrics.items() if k != "epoch"}, step or 0)


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


def log_run_record(run: TrainingRun, cfg: ExperimentConfig, tags: dict[str, str]) -> None:
    """Params, tags and ``config.json`` of a new run (or of one whose first attempt a kill cut short before
    they were all logged: the rest are logged now); a continued one records what changed
    (:func:`record_resumed_config`)."""
    recorded = mlflow.get_run(run.run_id).data
    if recorded.tags.get(PARAMS_LOGGED_TAG) != "true":
        mlflow.log_params({k: v for k, v in run_params(cfg).items() if k not in recorded.params})
        mlflow.log_dict(cfg.to_dict(), "config.json")
        mlflow.set_tags({**tags, PARAMS_LOGGED_TAG: "true"})
    elif not run.created:
        mlflow.set_tags(tags)
        record_resumed_config(run.run_id, cfg)


def fit(cfg: ExperimentConfig, module: RecModule, datamodule: EventDataModule, last: Path, resuming: bool,
        recorder: MetricRecorder | None, run_id: str | None, compile_workers: list | None = None) -> L.Trainer:
    """Fit (resuming from ``last`` when ``resuming``) and write the final ``last.ckpt``; every rank calls this."""
    logger = None
    if recorder is not None:
        logger = RecorderLogger(recorder, experiment_name=cfg.train.experiment, tracking_uri=tracking_uri(cfg), run_id=run_id)
    trainer = build_trainer(cfg, logger, recorder, compile_workers)
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=str(last) if resuming else None, weights_only=True)
    except ResumeError as exc:
        raise ResumeError(
            f"{last}: cannot resume this run: {exc}; train under another train.out_dir or name, or pass "
            "--no-resume to start over (it replaces that checkpoint)"
        ) from None
    check_trained(trainer, cfg)
    record = next(c for c in trainer.callbacks if isinstance(c, RecordAndCheckpoint))
    if record.saved_step != trainer.global_step:
        trainer.save_checkpoint(last, weights_only=False)
    if cfg.parallel.enabled:
        trainer.strategy.export_single_file_checkpoint(last)
    return trainer


def log_outcome(cfg: ExperimentConfig, last: Path, run_id: str) -> str:
    """The finished run's checkpoint record (and the file itself with ``train.log_checkpoint``), quarantine
    count and plots; returns the checkpoint's sha256."""
    sha = sha256_file(last)
    mlflow.log_metric("data/quarantined_rows", quarantine_count(cfg.data.path))
    mlflow.log_dict({"path": str(last.resolve()), "sha256": sha}, "checkpoint.json")
    if cfg.train.log_checkpoint:
        mlflow.log_artifact(str(last), "checkpoints")
    log_training_plots(run_id, PLOTTED_METRICS)
    return sha


def default_run_name(cfg: ExperimentConfig) -> str:
    """``train <name> (<arch>)``: what the run trains, since flavors are reused across run directories."""
    return f"train {cfg.name} ({cfg.model.arch})"


def train(
    cfg: ExperimentConfig,
    *,
    resume: bool = True,
    parent_run_id: str | None = None,
    run_name: str | None = None,
    compile_workers: list | None = None,
) -> dict[str, Any]:
    """Fit ``cfg`` in its run directory (:mod:`gem.run_dir`) and return ``{"run_id", "checkpoint",
    "checkpoint_sha256", "metrics"}``.

    The directory holds one run. With ``resume`` an existing run of the same config continues from its
    ``last.ckpt`` (model, optimizer, RNG and data position) in the same MLflow run, which is also the case
    for a run killed before its first checkpoint; a run of another config there, or any run without
    ``resume``, is refused (:class:`~gem.run_dir.RunConflict`) before anything is written. A run refused by
    a bad config or dataset leaves no MLflow run behind (:func:`gem.tracking.reject_run`). ``parent_run_id``
    files the run under a pipeline's run; ``run_name`` replaces :func:`default_run_name`; ``compile_workers``:
    kernel compile workers started before the harness was imported (:mod:`gem.compile_workers`), for the
    first step's precompile to adopt.

    With ``parallel.enabled`` (one process, or every process of a ``torchrun`` job) the
    :class:`~foundation.parallel.strategy.GemParallelStrategy` trains: checkpoints are DCP step
    directories under ``last.dcp/`` (resumed at any world size), ``last.ckpt`` is a single-file export
    written at the end, and only rank 0 opens the MLflow run (the other ranks return ``run_id`` None).
    """
    route_library_loggers()
    L.seed_everything(cfg.train.seed, workers=True, verbose=False)
    out = run_dir(cfg)
    check_same_run(out, cfg.to_dict(), resume=resume)
    datamodule = EventDataModule(cfg.data)
    datamodule.verify_shards()
    module = RecModule(cfg.to_dict(), json.loads(datamodule.schema.to_json()))
    last = out / "checkpoints" / "last.ckpt"
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
    if not rank0:
        # Other ranks open no MLflow run and get no logger: even constructing one opens the tracking store.
        fit(cfg, module, datamodule, last, resuming, None, None, compile_workers)
        return {"run_id": None, "checkpoint": str(last), "checkpoint_sha256": "", "metrics": {}}
    with train_lock(out):
        remove_stale_temps(out)
        wrote_config = record_config(out, cfg.to_dict())
        mlflow.set_tracking_uri(tracking_uri(cfg))
        experiment_id = ensure_experiment(cfg.train.experiment)
        # CPU, memory and (on GPU machines) device utilisation every few seconds, even for short runs.
        mlflow.system_metrics.set_system_metrics_sampling_interval(2)
        mlflow.system_metrics.set_system_metrics_samples_before_logging(1)
        tags = {"gem.stage": "train", "gem.flavor": cfg.name, "gem.dataset": str(cfg.data.path), **lineage}
        run = open_training_run(
            experiment_id, out, run_name=run_name or default_run_name(cfg), tags=tags, parent_run_id=parent_run_id
        )
        try:
            log_run_record(run, cfg, tags)
            recorder = MetricRecorder(run.run_id, resumed=not run.created)
            fit(cfg, module, datamodule, last, resuming, recorder, run.run_id, compile_workers)
            sha = log_outcome(cfg, last, run.run_id)
        except REJECTIONS as exc:
            # A checkpoint with no config on record (a run directory from before config.json and mlflow_run_id
            # were kept, or a copied-in file) is not this run's training: the refused run is deleted, the
            # checkpoint kept, and the config this attempt recorded for it removed.
            reject_run(run, out, trained=last.is_file() and not (run.created and resuming), reason=str(exc))
            if wrote_config and resuming:
                (out / RUN_CONFIG_FILE).unlink(missing_ok=True)
            raise
        except KeyboardInterrupt:
            mlflow.end_run("KILLED")
            raise
        except BaseException:
            mlflow.end_run("FAILED")
            raise
        mlflow.end_run()
    return {"run_id": run.run_id, "checkpoint": str(last), "checkpoint_sha256": sha, "metrics": dict(recorder.latest)}
