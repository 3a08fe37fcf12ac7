"""Embedding tables stepped only on the rows a step looks up, with dense AdamW's result.

AdamW moves every row of a table at every step: a row that no batch names has a zero gradient but not zero moments,
so it keeps moving on its momentum. Stepping the whole table reads and writes all ``R x D`` values and both moments
at every step however few rows the batch named; lazy Adam (``torch.optim.SparseAdam``) steps only the named rows and
so trains another model, which on the teacher's data trained worse (docs/benchmarks.md, session 47).

:class:`DeferredRows` keeps AdamW's result at lazy Adam's cost. Each row records the step it is current at; the
zero-gradient steps it missed are applied (:func:`kernels.catch_up_rows`) by a forward pre-hook on its embedding
module, before a lookup reads it, and then the optimizer steps the looked-up rows with their gradients
(:func:`kernels.row_adamw`). The missed steps' scalars live on the device (a schedule of per-step rates and bias
corrections, and a clock), so the hook can run inside a captured CUDA graph. Anything that reads a table other than
through its module (a checkpoint, an export) must first call :meth:`DeferredRows.flush`;
:class:`foundation.model.precision.MasterAdamW` does so in ``state_dict``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kernels import catch_up_rows

# Missed steps applied one by one. The zero-gradient step ``j`` steps after a row's last gradient moves it by at most
# ~7.3 * lr * (beta1 / sqrt(beta2))^j at AdamW's default betas (|m| <= 7.3 sqrt(v)); the steps past 192 together by
# less than 2e-7 * lr.
WINDOW = 192
# Schedule entries; when they run out every row is brought to date and the schedule starts again.
CAPACITY = 4096


def schedule_entry(step: int, *, lr: float, betas: tuple[float, float], weight_decay: float) -> tuple[float, float, float]:
    """Step ``step``'s row of the schedule :func:`kernels.catch_up_rows` reads: ``lr / (1 - beta1^step)``,
    ``sqrt(1 - beta2^step)`` and ``1 - lr * weight_decay``."""
    return lr / (1.0 - betas[0] ** step), math.sqrt(1.0 - betas[1] ** step), 1.0 - lr * weight_decay


class DeferredRows:
    """The deferred AdamW state of one table: each row's last step and the steps' scalars since ``base``.

    Args:
        param: ``[R, D]`` float32 table (an embedding's weight whose gradients are sparse).
        exp_avg, exp_avg_sq: its AdamW moments ``[R, D]`` float32.
        step: the steps the table has taken so far; every row is current there.
        betas, eps: AdamW's.
        capacity, window: the schedule's entries (default :data:`CAPACITY`) and :func:`kernels.catch_up_rows`'
            window.
    """

    def __init__(self, param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *, step: int,
                 betas: tuple[float, float], eps: float, capacity: int | None = None, window: int = WINDOW) -> None:
        self.param, self.betas, self.eps, self.window = param, betas, eps, window
        device = param.device
        capacity = capacity or CAPACITY
        self.last = torch.empty(param.shape[0], dtype=torch.int32, device=device)
        self.clock = torch.empty(2, dtype=torch.int32, device=device)
        self.schedule = torch.zeros(capacity, 3, dtype=torch.float32, device=device)
        self.log_decay = torch.zeros(capacity, dtype=torch.float64, device=device)
        self.rebind(exp_avg, exp_avg_sq, step)

    def rebind(self, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int) -> None:
        """Start again at ``step`` with every row current there and these moments (after a state load)."""
        self.exp_avg, self.exp_avg_sq = exp_avg, exp_avg_sq
        self.now = self.base = step
        self.summed_log_decay = 0.0
        self.last.fill_(step)
        self.clock.fill_(step)

    def catch_up(self, rows: torch.Tensor) -> None:
        """Bring the rows ``rows[N]`` (int64, repeats allowed) to the current step."""
        catch_up_rows(self.param.detach(), self.exp_avg, self.exp_avg_sq, self.last, rows.to(torch.int64),
                      self.clock, self.schedule, self.log_decay, betas=self.betas, eps=self.eps, window=self.window)

    def flush(self) -> None:
        """Bring every row to the current step (before the table is read other than through its module)."""
        self.catch_up(torch.arange(self.param.shape[0], device=self.param.device))

    def stepped(self, rows: torch.Tensor, *, step: int, lr: float, weight_decay: float) -> None:
        """Record step ``step`` (from 1), which stepped the rows ``rows[N]`` after :meth:`catch_up`: they are current
        at ``step``, every other row misses it."""
        if step != self.now + 1:
            raise RuntimeError(f"DeferredRows: step {step} follows step {self.now}")
        if step - self.base >= self.schedule.shape[0]:
            self.flush()
            self.rebind(self.exp_avg, self.exp_avg_sq, self.now)
        entry = step - self.base
        for column, value in enumerate(schedule_entry(step, lr=lr, betas=self.betas, weight_decay=weight_decay)):
            self.schedule[entry, column].fill_(value)
        self.summed_log_decay += math.log1p(-lr * weight_decay)
        self.log_decay[entry].fill_(self.summed_log_decay)
        self.last.index_fill_(0, rows.to(torch.int64), step)
        self.clock[0].fill_(step)
        self.now = step


def embedding_ids(args: tuple, kwargs: dict) -> torch.Tensor:
    """The ids an ``nn.Embedding`` / ``nn.EmbeddingBag`` forward looks up (``input``, by keyword as torchrec passes
    it, or first)."""
    return kwargs["input"] if "input" in kwargs else args[0]


def sparse_tables(model: nn.Module) -> dict[nn.Parameter, nn.Module]:
    """Every embedding of ``model`` whose table gives sparse gradients, by its weight."""
    return {module.weight: module for module in model.modules()
            if isinstance(module, nn.Embedding | nn.EmbeddingBag) and module.sparse}


def hook_lookups(module: nn.Module, rows: DeferredRows) -> None:
    """Catch up the rows of ``module``'s table that each forward looks up, before it reads them (in place of the
    hook an earlier :func:`hook_lookups` gave it)."""
    earlier = getattr(module, "deferred_rows_hook", None)
    if earlier is not None:
        earlier.remove()

    def before_lookup(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        with torch.no_grad():
            rows.catch_up(embedding_ids(args, kwargs).flatten())

    module.deferred_rows_hook = module.register_forward_pre_hook(before_lookup, with_kwargs=True)
