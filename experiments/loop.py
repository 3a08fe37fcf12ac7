"""The plain-PyTorch training epoch the GPU experiment scripts share (the GPU machine has no MLflow).

``gem train`` runs the same model, loss and optimiser step through the Lightning harness; these
scripts exist for long GPU sweeps and benchmarks where that harness's tracking is not available.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable

import torch

from foundation.data.batch import JaggedBatch
from foundation.model.flops import peak_flops, throughput_metrics


def train_epoch(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterable[JaggedBatch],
    *,
    grad_clip: float = 0.0,
    autocast_dtype: torch.dtype | None = None,
    max_steps: int = -1,
    deadline: float | None = None,
) -> dict:
    """One pass over ``batches`` (at most ``max_steps`` when >= 0, and none begun after the
    ``time.perf_counter()`` value ``deadline``): ``model.loss(batch, model(batch))["loss"]`` then an
    optimiser step, gradients clipped to norm ``grad_clip`` when it is positive.

    Returns the mean loss, the step count, and tokens/s (plus TFLOP/s and, on a GPU whose bf16/fp32
    peak is known, MFU for models with a ``flops`` counter).
    """
    device = next(model.parameters()).device
    precision = "bf16-mixed" if autocast_dtype == torch.bfloat16 else "32-true"
    peak = peak_flops(torch.cuda.get_device_name(device), precision) if device.type == "cuda" else None
    counts_flops = hasattr(model, "flops")
    total_loss, steps, tokens, flops = torch.zeros((), device=device), 0, 0, 0.0
    start = time.perf_counter()
    for batch in batches:
        if steps == max_steps or (deadline is not None and time.perf_counter() > deadline):
            break
        if counts_flops:
            flops += model.flops(batch)  # on the host copy: no device sync
        tokens += batch.num_tokens
        batch = batch.to(device, non_blocking=True)
        autocast = (
            torch.autocast(device.type, dtype=autocast_dtype)
            if autocast_dtype is not None
            else contextlib.nullcontext()
        )
        with autocast:
            loss = model.loss(batch, model(batch))["loss"]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        total_loss += loss.detach()  # summed on the device: no per-step sync
        steps += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    perf = throughput_metrics(flops, tokens, time.perf_counter() - start, peak)
    if not counts_flops:
        perf = {"tokens_per_s": perf["tokens_per_s"]}
    return {"loss": float(total_loss) / max(steps, 1), "steps": steps, **perf}
