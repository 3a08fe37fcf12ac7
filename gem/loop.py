"""The one training step, its throughput accounting, and the plain epoch loop built on them.

:func:`train_step` is a step of every trainer in the project: the Lightning harness
(:class:`gem.module.RecModule`, with Lightning's backward and gradient clipping) and :func:`train_epoch`
(plain PyTorch, for GPU sweeps and benchmarks on machines without MLflow). :class:`Throughput` gives both
their tokens/s, TFLOP/s and MFU. Neither imports MLflow or Lightning.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable

import torch
from torch import nn

from foundation.data.batch import JaggedBatch
from foundation.model.flops import peak_flops, throughput_metrics
from foundation.model.precision import CastOnce


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """``torch.autocast`` to ``dtype`` on ``device``'s type, or nothing when ``dtype`` is None."""
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def train_step(
    model: nn.Module,
    batch: JaggedBatch,
    optimizer: torch.optim.Optimizer,
    *,
    grad_clip: float = 0.0,
    autocast_dtype: torch.dtype | None = None,
    loss_weight: float = 1.0,
    forward: Callable[[JaggedBatch], object] | None = None,
    backward: Callable[[torch.Tensor], None] = torch.Tensor.backward,
    clip: Callable[[float], object] | None = None,
    cast_once: CastOnce | None = None,
) -> dict[str, torch.Tensor]:
    """One optimiser step on a device batch; returns ``model.loss``'s terms (``"loss"`` is the total).

    ``model.loss(batch, forward(batch))`` under autocast to ``autocast_dtype``, then ``backward`` of
    ``loss * loss_weight`` (a rank's share of a global mean), gradients clipped to norm ``grad_clip`` when it
    is positive (``clip(grad_clip)``, default: over ``model.parameters()``), then ``optimizer.step()``.
    ``forward`` defaults to ``model``; a trainer passes its own to feed extra inputs (teacher outputs).
    ``cast_once`` (a :class:`~foundation.model.precision.CastOnce` of ``model``, kept across steps, with the
    default ``forward``) casts the parameters autocast would cast at every use once per step instead.
    """
    if cast_once is not None and forward is not None:
        raise ValueError("train_step: cast_once runs the model's own forward; pass one or the other")
    forward = forward or model
    with autocast(batch.candidate.device, autocast_dtype):
        if cast_once is None:
            losses = model.loss(batch, forward(batch))
        else:
            losses = cast_once.run(lambda model_forward: model.loss(batch, model_forward(batch)))
    optimizer.zero_grad(set_to_none=True)
    backward(losses["loss"] * loss_weight if loss_weight != 1.0 else losses["loss"])
    if cast_once is not None:
        cast_once.collect_grads()
    if grad_clip > 0:
        if clip is None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        else:
            clip(grad_clip)
    optimizer.step()
    return losses


class Throughput:
    """Tokens and FLOPs counted over a span of steps, as tokens/s, TFLOP/s and MFU.

    FLOPs come from the model's ``flops(batch, training=True)`` counter (valid tokens only) when it has one;
    count each batch on its host copy, where reading offsets needs no device sync. MFU needs a GPU whose
    peak at ``precision`` (a Lightning precision string) is known.
    """

    def __init__(self, model: nn.Module, device: torch.device, precision: str) -> None:
        self.model = model
        self.device = device
        self.counts_flops = hasattr(model, "flops")
        self.peak = peak_flops(torch.cuda.get_device_name(device), precision) if device.type == "cuda" else None
        self.reset()

    def reset(self) -> None:
        """Forget the counts and start the clock."""
        self.tokens, self.flops = 0, 0.0
        self.start_clock()

    def start_clock(self) -> None:
        self.started = time.perf_counter()

    def count(self, batch: JaggedBatch) -> None:
        self.tokens += batch.num_tokens
        if self.counts_flops:
            self.flops += self.model.flops(batch, training=True)

    def metrics(self) -> dict[str, float]:
        """``tokens_per_s`` (and ``tflops_per_s``, ``mfu`` where known) since the clock started; syncs the GPU."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        perf = throughput_metrics(self.flops, self.tokens, time.perf_counter() - self.started, self.peak)
        return perf if self.counts_flops else {"tokens_per_s": perf["tokens_per_s"]}


def train_epoch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterable[JaggedBatch],
    *,
    grad_clip: float = 0.0,
    autocast_dtype: torch.dtype | None = None,
    max_steps: int = -1,
    deadline: float | None = None,
    cast_once: bool = False,
) -> dict:
    """One pass of :func:`train_step` over ``batches`` (at most ``max_steps`` when >= 0, and none begun after
    the ``time.perf_counter()`` value ``deadline``).

    Returns the mean loss, the step and row counts, the model FLOPs trained (``flops``, the sum of
    ``model.flops(batch)`` over the steps; 0 for a model without a counter) and :class:`Throughput`'s figures
    over the pass (MFU at bf16 peak with ``autocast_dtype=torch.bfloat16``, else fp32). ``cast_once`` runs
    :func:`train_step` with a :class:`~foundation.model.precision.CastOnce` of the model (autocast only).
    """
    device = next(model.parameters()).device
    once = CastOnce(model, autocast_dtype) if cast_once and autocast_dtype is not None else None
    meter = Throughput(model, device, "bf16-mixed" if autocast_dtype == torch.bfloat16 else "32-true")
    total_loss, steps, rows = torch.zeros((), device=device), 0, 0
    for batch in batches:
        if steps == max_steps or (deadline is not None and time.perf_counter() > deadline):
            break
        meter.count(batch)
        losses = train_step(
            model, batch.to(device, non_blocking=True), optimizer, grad_clip=grad_clip, autocast_dtype=autocast_dtype,
            cast_once=once,
        )
        total_loss += losses["loss"].detach()  # summed on the device: no per-step sync
        steps += 1
        rows += batch.batch_size
    return {
        "loss": float(total_loss) / max(steps, 1), "steps": steps, "rows": rows, "flops": meter.flops, **meter.metrics()
    }
