"""The learning-rate schedule: a linear warm-up, then a cosine down to a floor.

:class:`ScheduledLR` applies it as an optimizer step pre-hook, so every loop that steps the optimizer follows it
alike: the Lightning harness (:class:`gem.module.RecModule`, from ``train.warmup_steps`` and
``train.final_lr_frac`` over ``train.max_steps``), the plain and static steps of :mod:`gem.loop`, and the
experiment runners (:mod:`experiments.teacher_vs_baseline`, :mod:`experiments.scaling_run`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from foundation.config import ConfigError
from gem.config import TrainConfig


@dataclass(frozen=True)
class WarmupCosine:
    """Learning rate ``lr`` reached linearly over ``warmup_steps``, then a cosine to ``final_frac * lr`` at the end.

    The end is ``steps`` optimizer steps or the end of the run's time, whichever comes first: after the warm-up,
    progress is the larger of ``step / steps`` and the fraction of the run's time spent (given by the caller).
    ``final_frac=1`` holds the peak after the warm-up.
    """

    lr: float
    steps: int
    warmup_steps: int = 0
    final_frac: float = 1.0

    def __post_init__(self) -> None:
        if not self.lr > 0 or self.steps < 1:
            raise ValueError(f"schedule: needs lr > 0 and steps >= 1, got lr={self.lr}, steps={self.steps}")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"schedule: warmup_steps={self.warmup_steps} must lie in [0, steps={self.steps})")
        if not 0 <= self.final_frac <= 1:
            raise ValueError(f"schedule: final_frac={self.final_frac} must lie in [0, 1]")

    def progress(self, step: int, time_fraction: float = 0.0) -> float:
        """Fraction of the run done before optimizer step ``step`` (0-based) with ``time_fraction`` of its time
        spent: in [0, 1]."""
        return min(max(step / self.steps, time_fraction), 1.0)

    def lr_at(self, step: int, time_fraction: float = 0.0) -> float:
        """The learning rate of optimizer step ``step`` taken with ``time_fraction`` of the run's time spent."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        start = self.warmup_steps / self.steps
        decayed = max(self.progress(step, time_fraction) - start, 0.0) / (1.0 - start)
        return self.lr * (self.final_frac + (1.0 - self.final_frac) * 0.5 * (1.0 + math.cos(math.pi * decayed)))


def build_lr_schedule(train: TrainConfig, *, parallel: bool = False) -> WarmupCosine | None:
    """``train``'s schedule: warm-up over ``warmup_steps``, then a cosine to ``final_lr_frac`` of ``lr`` at
    ``max_steps`` (needed only when it decays); None when neither is set (the constant rate). Settings it cannot
    follow raise :class:`~foundation.config.ConfigError` naming the field; so does any schedule under ``parallel``
    (the sharded tables' fused optimizer steps inside the backward at its own constant rate)."""
    if train.warmup_steps < 0:
        raise ConfigError(f"train.warmup_steps={train.warmup_steps} must be 0 or more")
    if not 0 <= train.final_lr_frac <= 1:
        raise ConfigError(f"train.final_lr_frac={train.final_lr_frac} must lie in [0, 1]")
    if train.warmup_steps == 0 and train.final_lr_frac == 1:
        return None
    if parallel:
        raise ConfigError("train.warmup_steps / train.final_lr_frac: no schedule under parallel.enabled (the sharded "
                          "tables' fused optimizer keeps train.lr)")
    steps = train.warmup_steps + 1
    if train.final_lr_frac < 1:
        if train.max_steps <= train.warmup_steps:
            raise ConfigError(f"train.final_lr_frac={train.final_lr_frac} decays until train.max_steps, which must "
                              f"exceed train.warmup_steps={train.warmup_steps}; got {train.max_steps}")
        steps = train.max_steps
    return WarmupCosine(train.lr, steps, train.warmup_steps, train.final_lr_frac)


class ScheduledLR:
    """Sets every param group's ``lr`` before each ``optimizer.step()`` (a step pre-hook): the group's own base
    rate (``initial_lr``, its ``lr`` when the hook was made) times the schedule's ``lr_at / lr``, so groups at a
    fraction of the peak (the transfer's shared parameters) keep their ratio. ``steps`` counts the steps taken
    (set it when resuming).

    With a ``deadline`` (a ``clock()`` value; None: steps only), the time fraction runs from the first optimizer
    step to it: the first forward and backward, which compile and tune the kernels, do not count as training
    time, and the run still ends by the deadline.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: WarmupCosine, deadline: float | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.schedule, self.deadline, self.clock = schedule, deadline, clock
        self.origin: float | None = None
        self.steps = 0
        self.last_lr = schedule.lr_at(0)
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
        self.handle = optimizer.register_step_pre_hook(self.before_step)

    def time_fraction(self) -> float:
        if self.deadline is None or self.origin is None:
            return 0.0
        return (self.clock() - self.origin) / max(self.deadline - self.origin, 1e-9)

    def before_step(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        if self.origin is None:
            self.origin = self.clock()
        self.last_lr = self.schedule.lr_at(self.steps, self.time_fraction())
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] * self.last_lr / self.schedule.lr
        self.steps += 1

    def finished(self) -> bool:
        """True once the steps are done or the deadline has passed."""
        if self.deadline is not None and self.clock() >= self.deadline:
            return True
        return self.schedule.progress(self.steps, self.time_fraction()) >= 1.0
