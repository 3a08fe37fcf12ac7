"""Lightning callbacks of ``gem train``: metrics and checkpoints in a kill-safe order, a progress bar with totals.

:class:`RecordAndCheckpoint` replaces Lightning's ``ModelCheckpoint`` for ``last.ckpt``. It logs a step's
metrics before it writes the checkpoint covering that step, and at the end of an epoch that validates it
writes the checkpoint after validation (not before), so a run killed at any moment and resumed from its
checkpoint has logged every step up to it, and retrains (and re-logs, which :class:`gem.tracking.MetricRecorder`
skips) only the steps after it. Metric steps are Lightning's: the index of the optimiser step, from 0.
:class:`ValidateLastEpoch` validates after the last epoch whatever the validation cadence.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback, TQDMProgressBar
from lightning.pytorch.trainer.states import TrainerFn

from gem.tracking import MetricRecorder


def validation_follows(trainer: L.Trainer) -> bool:
    """Whether the loop validates right after this training batch (Lightning's own decision)."""
    loop = trainer.fit_loop
    return loop.epoch_loop._should_check_val_fx(loop._data_fetcher)


def epoch_ends(trainer: L.Trainer) -> bool:
    """Whether this training batch is its epoch's last (the loop fetches one batch ahead, so it knows)."""
    return trainer.fit_loop.epoch_loop.batch_progress.is_last_batch


class RecordAndCheckpoint(Callback):
    """Every ``log_every_n_steps`` optimiser steps log the module's ``step_metrics()``; every ``every_n_steps``
    (and at ``max_steps``) write ``path``; after each validation log ``val_metrics`` and write ``path``.
    ``recorder`` is None on ranks that do not log.

    A step due at the last batch of an epoch is written once the epoch has ended (after its validation, if
    any): from a checkpoint of the last batch itself, Lightning resumes by counting the epoch as done before
    the data module can start the next one, and the resumed run would train an epoch of no batches.
    """

    def __init__(self, path: Path, *, every_n_steps: int, log_every_n_steps: int, recorder: MetricRecorder | None) -> None:
        self.path = Path(path)
        self.every_n_steps = max(every_n_steps, 1)
        self.log_every_n_steps = max(log_every_n_steps, 1)
        self.recorder = recorder
        self.saved_step: int | None = None
        self.due_at_epoch_end = False

    def save(self, trainer: L.Trainer) -> None:
        # No checkpoint of a model that took no step: a later run would resume it as trained.
        if trainer.global_step not in (0, self.saved_step):
            trainer.save_checkpoint(self.path, weights_only=False)
            self.saved_step = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if self.recorder is not None and step % self.log_every_n_steps == 0:
            self.recorder.log(pl_module.step_metrics(), step - 1)
        # The step that reaches max_steps is saved here, mid-epoch: once the fit ends Lightning counts the
        # epoch as done, and a run continued with more steps would skip the rest of it.
        if step % self.every_n_steps == 0 or 0 < trainer.max_steps <= step:
            if epoch_ends(trainer) or validation_follows(trainer):
                self.due_at_epoch_end = True
            else:
                self.save(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        if self.recorder is not None:
            self.recorder.log(pl_module.val_metrics, max(trainer.global_step - 1, 0))
        self.save(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.due_at_epoch_end:
            self.save(trainer)
            self.due_at_epoch_end = False


class ValidateLastEpoch(Callback):
    """Validation every ``every_n_epochs`` epochs (Lightning's ``check_val_every_n_epoch``) and after the last
    one, so a run whose ``max_epochs`` is not a multiple of the cadence still ends with its metrics."""

    def __init__(self, every_n_epochs: int) -> None:
        self.every_n_epochs = every_n_epochs

    def apply(self, trainer: L.Trainer) -> None:
        last = (trainer.max_epochs or 0) > 0 and trainer.current_epoch + 1 >= trainer.max_epochs
        # Lightning reads the cadence when the epoch's last batch ends.
        trainer.check_val_every_n_epoch = 1 if last else self.every_n_epochs

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A run resumed mid-epoch continues that epoch without its on_train_epoch_start.
        self.apply(trainer)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.apply(trainer)


class GemProgressBar(TQDMProgressBar):
    """Lightning's bar with a total (and so an ETA) for streamed epochs, one refresh per update, no ``v_num``.

    The total of a training epoch is the data module's estimate (``estimated_batches``): token-budget
    packing makes the exact count known only once the epoch has been read.
    """

    def _estimate(self, split_kind: str) -> float:
        datamodule = getattr(self.trainer, "datamodule", None)
        estimate = getattr(datamodule, "estimated_batches", None)
        return estimate(split_kind) if estimate is not None else math.inf

    @property
    def total_train_batches(self) -> int | float:
        total = super().total_train_batches
        return self._estimate("train") if math.isinf(total) else total

    @property
    def total_val_batches_current_dataloader(self) -> int | float:
        total = super().total_val_batches_current_dataloader
        return self._estimate("eval") if math.isinf(total) else total

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        """Lightning's bar metrics and the module's last training loss, read now (at a refresh, not every step)."""
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        loss = getattr(pl_module, "step_losses", {}).get("loss")
        if loss is not None:
            metrics["train/loss"] = float(loss)
        return metrics

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        bar, n = self.train_progress_bar, batch_idx + 1
        if bar is not None and not bar.disable and self._should_update(n, bar.total):
            bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)
            bar.n = n
            bar.refresh()
