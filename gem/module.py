"""``RecModule``: the LightningModule that trains, validates and reloads any registered model.

Its training step is :func:`gem.loop.train_step` (the step the plain GPU loop runs too), with Lightning's
backward (precision plugin) and its gradient clipping (:meth:`RecModule.clip_norm`); Lightning
keeps the loop, checkpoints, logging and resume. The teacher's faster forms of the step are config
switches (:mod:`gem.step_options`): parameters cast once per step under bf16, and padded batches through
:class:`gem.loop.StaticStep`, its dense part replayed from CUDA graphs.

Students learn from a teacher through ``cfg.transfer``: the module reads each split's teacher outputs
once, verified, and passes a model whose ``forward`` takes ``teacher=`` the batch's rows
(:meth:`RecModule.forward_batch`); with ``transfer.share_from`` it starts the student from the teacher's
parameters (:mod:`transfer.sharing`).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch

from foundation.checkpoint import TrainedModel, TrainingCheckpoint, read_training_checkpoint
from foundation.data.batch import JaggedBatch
from foundation.data.pipeline import valid_item_mask
from foundation.data.schema import EventSchema
from foundation.metrics import PredictionLog, RankingMetrics
from foundation.model.outputs import ModelOutput
from foundation.model.padding import PaddedBatch, StaticShapes
from foundation.model.precision import CastOnce, MasterAdamW, clip_grad_norm
from gem.config import experiment_from_dict
from gem.errors import ModelRoleError, ResumeError
from gem.loop import StaticStep, Throughput, train_step
from gem.registry import ITEM_TABLES, TEACHER_ARCHS, build_model
from gem.schedule import ScheduledLR, build_lr_schedule
from gem.step_options import step_options
from transfer.sharing import (
    SharingResult,
    build_param_groups,
    restore_shared_layout,
    share_from_checkpoint,
    sharing_config,
)
from transfer.teacher_outputs import TeacherOutputs, read_teacher_outputs

_log = logging.getLogger(__name__)


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
        # The step is gem.loop.train_step, run here with Lightning's backward and clipping.
        self.automatic_optimization = False
        self.cfg = experiment_from_dict(config)
        self.schema = EventSchema(**schema)
        self.model = build_model(self.cfg.model, self.schema)
        self.sharing = self.build_sharing(from_checkpoint)
        self.val_log = PredictionLog()
        self.val_ranking = RankingMetrics()
        self.valid_items: torch.Tensor | None = None
        self.throughput: Throughput | None = None
        self.takes_teacher = "teacher" in inspect.signature(self.model.forward).parameters
        if self.cfg.transfer.teacher_outputs and not self.takes_teacher:
            raise ValueError(
                f"transfer.teacher_outputs is set, but model.arch={self.cfg.model.arch!r} takes no teacher outputs"
            )
        self._teacher_outputs: dict[str, TeacherOutputs] = {}
        self.step_options, self.step_notes = step_options(self.cfg, has_lookups=hasattr(self.model, "look_up"))
        self.lr_schedule = build_lr_schedule(self.cfg.train, parallel=self.cfg.parallel.enabled)
        self.scheduled_lr: ScheduledLR | None = None
        # Made at the first training step that uses them (they need the optimizer, or watch a step).
        self.cast_once: CastOnce | None = None
        self.static_step: StaticStep | None = None
        self.prepared_buckets: list[int] | None = None
        # The last step's losses (detached, read only when logged) and the last validation's metrics, which
        # gem.callbacks.RecordAndCheckpoint logs to MLflow.
        self.step_losses: dict[str, torch.Tensor] = {}
        self.val_metrics: dict[str, float] = {}
        self._val_losses: list[torch.Tensor] = []
        self._val_rows = 0

    def build_sharing(self, from_checkpoint: bool) -> SharingResult | None:
        """Teacher parameters in the model when ``transfer.share_from`` is set (:mod:`transfer.sharing`).

        A new module copies them from the teacher checkpoint and records their dims in the saved config
        (``transfer.shared_dims``); a module loaded ``from_checkpoint`` rebuilds that layout without the teacher.
        """
        transfer = self.cfg.transfer
        if not transfer.share_from:
            return None
        cfg = sharing_config(dataclasses.asdict(transfer))
        if from_checkpoint:
            return restore_shared_layout(self.model, transfer.shared_dims, cfg)
        result = share_from_checkpoint(
            self.model,
            transfer.share_from,
            cfg,
            student_arch=self.cfg.model.arch,
            item_tables=ITEM_TABLES,
            expected_sha256=transfer.checkpoint_sha256,
        )
        transfer.shared_dims = result.table_dims
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
        if stage == "fit":
            for note in self.step_notes:
                _log.warning(note)

    @property
    def train_shapes(self) -> StaticShapes | None:
        """The static shapes the data module pads training batches to (``train.bucket_rows``), or None."""
        return self.step_options.shapes

    def count_batch(self, batch: JaggedBatch) -> None:
        """Count a training batch's tokens and FLOPs on its host copy (the data module calls this before the
        batch moves to the device, where reading offsets would sync)."""
        if self.throughput is None:
            self.throughput = Throughput(self.model, self.device, self.cfg.train.precision)
        self.throughput.reset()
        self.throughput.count(batch)

    def on_train_batch_start(self, batch: JaggedBatch, batch_idx: int) -> None:
        self.throughput.start_clock()

    def training_step(self, batch: JaggedBatch, batch_idx: int) -> torch.Tensor:
        """One optimiser step: a padded batch (``train.bucket_rows``) through :class:`gem.loop.StaticStep` (with
        ``train.cuda_graphs``, every bucket prepared after the first: :meth:`~gem.loop.StaticStep.prepare`), any
        other through :func:`gem.loop.train_step`, whose loss is weighted by the strategy's share of a global
        batch (``loss_weight``, 1 on one device; the static step runs on one device only). Returns the
        weighted loss, detached."""
        optimizer = self.optimizers()
        weight = getattr(self.trainer.strategy, "loss_weight", 1.0)
        if isinstance(batch, PaddedBatch) and self.step_options.shapes is not None:
            static_step = self.build_static_step(optimizer)
            losses = static_step(batch)
            if self.step_options.graphs.cuda_graphs and self.prepared_buckets is None:
                # Every bucket's warm-up and capture now, not at its first batch in the middle of training.
                self.prepared_buckets = static_step.prepare(batch, self.step_options.shapes)
        else:
            losses = train_step(
                self.model,
                batch,
                optimizer,
                grad_clip=self.cfg.train.grad_clip,
                loss_weight=weight,
                backward=self.manual_backward,
                clip=self.clip_norm,
                **self.model_forward(),
            )
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is not None and batch.position is not None:
            datamodule.record(batch.position)
        # Read only when logged (step_metrics) or shown (gem.callbacks.GemProgressBar): a read of a device
        # tensor waits for the device, so no step reads its own loss.
        self.step_losses = {name: value.detach() for name, value in losses.items()}
        return losses["loss"].detach() * weight

    def model_forward(self) -> dict[str, Any]:
        """How :func:`gem.loop.train_step` runs the model: with ``train.cast_once`` (under bf16 autocast) and the
        model's own forward, through a :class:`CastOnce` kept across steps; else :meth:`forward_batch`."""
        split = self.cfg.data.train_split
        if not self.step_options.cast_once or self.teacher_outputs(split) is not None:
            return {"forward": lambda b: self.forward_batch(b, split)}
        return {"cast_once": self.shared_cast_once()}

    def build_static_step(self, optimizer) -> StaticStep:
        """The :class:`StaticStep` of this run (made at its first padded batch), clipping with :meth:`clip_norm`."""
        if self.static_step is None:
            self.static_step = StaticStep(
                self.model,
                optimizer,
                autocast_dtype=self.step_options.autocast_dtype,
                config=self.step_options.graphs,
                log=_log.warning,
                grad_clip=self.cfg.train.grad_clip,
                clip=self.clip_norm,
                cast_once=self.shared_cast_once() if self.step_options.cast_once else None,
            )
        return self.static_step

    def shared_cast_once(self) -> CastOnce:
        """The run's :class:`CastOnce`, made on first use: the static and the plain step share its copies."""
        if self.cast_once is None:
            self.cast_once = CastOnce(self.model, self.step_options.autocast_dtype)
            optimizer = self.optimizers()
            optimizer = getattr(optimizer, "optimizer", optimizer)  # under Lightning's wrapper
            if isinstance(optimizer, MasterAdamW):
                optimizer.keep_copies(self.cast_once)
        return self.cast_once

    def clip_norm(self, max_norm: float) -> None:
        """Clip the gradients of the optimizer's parameters to total norm ``max_norm``, by the precision plugin's
        ``clip_grad_by_norm`` (which a parallel strategy replaces for gradients on several meshes).

        Lightning's ``clip_gradients``, which calls it, runs only with a gradient scaler (``16-mixed``): under
        any mixed precision it refuses a fused optimizer, whose own unscaling only a scaler's gradients need.
        """
        optimizer, plugin = self.optimizers(), self.trainer.precision_plugin
        if getattr(plugin, "scaler", None) is not None:
            self.clip_gradients(optimizer, gradient_clip_val=max_norm, gradient_clip_algorithm="norm")
        elif self.step_options.sparse_tables:
            # Lightning's clip takes no sparse gradients; the tables' (one device only) are summed per row first.
            clip_grad_norm([p for group in optimizer.param_groups for p in group["params"]], max_norm)
        else:
            plugin.clip_grad_by_norm(optimizer, max_norm)

    def step_metrics(self) -> dict[str, float]:
        """The last step's losses (``train/<name>``), its learning rate under a schedule (``train/lr``) and throughput
        since the clock started (``perf/<name>``)."""
        metrics = {f"train/{name}": float(value) for name, value in self.step_losses.items()}
        if self.scheduled_lr is not None:
            metrics["train/lr"] = self.scheduled_lr.last_lr
        if self.throughput is not None:
            metrics.update({f"perf/{k}": v for k, v in self.throughput.metrics().items()})
        return metrics

    def validation_step(self, batch: JaggedBatch, batch_idx: int) -> None:
        out = self.forward_batch(batch, self.cfg.data.eval_split)
        losses = self.model.loss(batch, out)
        self._val_losses.append(losses["loss"].detach().double() * batch.batch_size)
        self._val_rows += batch.batch_size
        if self.schema.task == "next_item":
            rank_batch(self.model, batch, self.val_ranking, self.valid_items)
        else:
            self.val_log.add(batch, out.logits)

    def on_validation_epoch_end(self) -> None:
        """Fill :attr:`val_metrics` (NE/AUC/calibration per task and domain, or ranking metrics, and ``val/loss``)."""
        metrics = self.val_log.metrics(self.schema.num_domains, prefix="val/")
        if self.schema.task == "next_item":
            metrics = {f"val/{k}": v for k, v in self.val_ranking.compute().items()}
        if self._val_rows:
            metrics["val/loss"] = float(torch.stack(self._val_losses).sum()) / self._val_rows
        self.val_log, self.val_ranking = PredictionLog(), RankingMetrics()
        self._val_losses, self._val_rows = [], 0
        self.val_metrics = {k: float(v) for k, v in metrics.items() if np.isfinite(v)}
        if "val/loss" in self.val_metrics and not self.trainer.sanity_checking:
            self.log("val/loss", self.val_metrics["val/loss"], prog_bar=True, logger=False, batch_size=1,
                     sync_dist=self.trainer.world_size > 1)

    def on_train_end(self) -> None:
        optimizer = getattr(self.optimizers(), "optimizer", self.optimizers())
        if isinstance(optimizer, MasterAdamW):  # what reads the tables after training reads them up to date
            optimizer.flush_rows()

    def on_train_start(self) -> None:
        if self.scheduled_lr is not None:  # a resumed run goes on where its schedule stopped
            self.scheduled_lr.steps = self.global_step

    def on_train_epoch_start(self) -> None:
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is not None:
            datamodule.start_epoch(self.current_epoch)

    def configure_optimizers(self):
        """AdamW, fused (one kernel per step instead of several per parameter) where :func:`fuses_adamw` allows;
        with ``train.cast_once`` there, :class:`MasterAdamW` (the same update, which also reads the bf16 copies'
        gradients and writes the copies in its pass), which also steps ``model.teacher.sparse_tables``' rows (the
        rows a step looked up, with AdamW's result: :meth:`MasterAdamW.defer_rows`).
        Under a learning-rate schedule (``train.warmup_steps``, ``train.final_lr_frac``) a
        :class:`~gem.schedule.ScheduledLR` hook sets its rates before every step."""
        params = self.parameters()
        if self.sharing is not None:
            # Shared teacher parameters train by the sharing policy: frozen, or in a lower-lr group.
            params = build_param_groups(self.model, self.sharing, self.cfg.train.lr)
        # Under parallel.enabled the distributed checkpoint pre-allocates AdamW's state as the unfused
        # optimizer keeps it (the step count on the host), so the default implementation stays.
        fused = not self.cfg.parallel.enabled and fuses_adamw(list(self.parameters()))
        if (fused and self.step_options.cast_once) or self.step_options.sparse_tables:  # torch's AdamW takes no sparse gradients
            optimizer = MasterAdamW(params, lr=self.cfg.train.lr, weight_decay=self.cfg.train.weight_decay)
            optimizer.defer_rows(self.model)
        else:
            optimizer = torch.optim.AdamW(params, lr=self.cfg.train.lr, weight_decay=self.cfg.train.weight_decay,
                                          fused=fused)
        if self.lr_schedule is not None:
            self.scheduled_lr = ScheduledLR(optimizer, self.lr_schedule)
        return optimizer

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["rng_state"] = torch.get_rng_state()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        check_resumable(self, checkpoint)
        if "rng_state" in checkpoint:
            torch.set_rng_state(checkpoint["rng_state"])
        adopt_automatic_step_count(checkpoint)


# Devices with torch's fused AdamW kernel (CPU since torch 2.4).
FUSED_ADAMW_DEVICES = ("cuda", "cpu")


def fuses_adamw(params: list[torch.Tensor]) -> bool:
    """Whether torch's fused AdamW can step ``params``: plain floating-point parameters (no tensor subclasses
    such as DTensor shards) on a device it has a kernel for."""
    return bool(params) and all(
        type(p) is torch.nn.Parameter and p.is_floating_point() and p.device.type in FUSED_ADAMW_DEVICES for p in params
    )


def check_resumable(module: RecModule, checkpoint: dict[str, Any]) -> None:
    """Raise :class:`ResumeError` naming the first parameter of ``checkpoint`` that does not fit ``module``
    (another flavor's or model size's checkpoint), before Lightning loads it."""
    saved = checkpoint.get("state_dict")
    if saved is None:
        return
    own = module.state_dict()
    config = checkpoint.get("hyper_parameters", {}).get("config", {})
    writer = f"flavor {config.get('name')!r} (model.arch={config.get('model', {}).get('arch')!r})"
    this = f"flavor {module.cfg.name!r} (model.arch={module.cfg.model.arch!r})"
    problems = [f"{name} is missing" for name in own if name not in saved]
    problems += [f"{name} is not in this model" for name in saved if name not in own]
    problems += [
        f"{name} has shape {list(saved[name].shape)}, this model {list(tensor.shape)}"
        for name, tensor in own.items()
        if name in saved and tuple(saved[name].shape) != tuple(tensor.shape)
    ]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ResumeError(f"it was written by {writer}, this run is {this}: {problems[0]}{more}")


def adopt_automatic_step_count(checkpoint: dict[str, Any]) -> None:
    """Carry the optimiser steps of a checkpoint written under Lightning's automatic optimisation (before
    the harness ran :func:`gem.loop.train_step` itself) into the manual loop's count, in place; else a resumed
    run would restart its global step at 0 and train past ``train.max_steps``."""
    loops = checkpoint.get("loops", {}).get("fit_loop", {})
    automatic = loops.get("epoch_loop.automatic_optimization.optim_progress", {}).get("optimizer", {}).get("step")
    manual = loops.get("epoch_loop.manual_optimization.optim_step_progress")
    if automatic and manual is not None and manual["total"]["completed"] == 0:
        loops["epoch_loop.manual_optimization.optim_step_progress"] = copy.deepcopy(automatic)


def module_from_checkpoint(ckpt: TrainingCheckpoint) -> RecModule:
    """The :class:`RecModule` of a read ``gem train`` checkpoint, in eval mode."""
    module = RecModule(ckpt.config, dataclasses.asdict(ckpt.schema), from_checkpoint=True)
    module.model.load_state_dict(ckpt.state)
    return module.eval()


def load_module(ckpt_path: str | Path) -> RecModule:
    """The :class:`RecModule` of a ``gem train`` checkpoint, in eval mode."""
    return module_from_checkpoint(read_training_checkpoint(ckpt_path))


def _trained(module: RecModule, ckpt_path: str | Path) -> TrainedModel:
    return TrainedModel(model=module.model, schema=module.schema, path=Path(ckpt_path), config=module.cfg.to_dict())


def load_trained(ckpt_path: str | Path) -> TrainedModel:
    """A checkpoint's model with its run facts, as the transfer stages take it (teacher outputs, export)."""
    return _trained(load_module(ckpt_path), ckpt_path)


def load_teacher(ckpt_path: str | Path, *, purpose: str) -> TrainedModel:
    """:func:`load_trained` for a stage that needs a teacher (``purpose`` names it in the error): a value
    model's checkpoint raises :class:`ModelRoleError` before any model is built or anything written."""
    ckpt = read_training_checkpoint(ckpt_path)
    if ckpt.arch not in TEACHER_ARCHS:
        raise ModelRoleError(
            f"{ckpt_path}: model.arch={ckpt.arch!r} is a value model, not a teacher; {purpose} needs a teacher "
            f"checkpoint (model.arch one of {list(TEACHER_ARCHS)})"
        )
    return _trained(module_from_checkpoint(ckpt), ckpt_path)


def rank_batch(model: torch.nn.Module, batch: JaggedBatch, ranking: RankingMetrics, valid_items: torch.Tensor | None) -> None:
    """Full ranking of each row's candidate among all items, the row's history excluded."""
    mask = valid_items.to(batch.candidate.device) if valid_items is not None else None
    ranking.update(model.score_items(batch), batch.candidate, batch.history["item_ids"], batch.offsets, valid_items=mask)
