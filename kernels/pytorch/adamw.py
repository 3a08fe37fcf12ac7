"""Reference for :mod:`kernels.triton.adamw`: torch's AdamW update, one tensor at a time."""

from __future__ import annotations

import math

import torch


def multi_adamw(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    copies: list[torch.Tensor | None],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    step: int,
) -> None:
    """One AdamW step (decoupled weight decay, bias-corrected moments, as ``torch.optim.AdamW``) of every
    ``params[i]`` (float32) with ``grads[i]`` (its shape, any float dtype and layout, read as float32), its
    moments ``exp_avgs[i]``/``exp_avg_sqs[i]`` (float32) updated in place; ``step`` counts this step (from 1).
    Where ``copies[i]`` is a tensor, the updated parameter is also written into it (rounded to its dtype)."""
    beta1, beta2 = betas
    step_size = lr / (1.0 - beta1**step)
    bias_sqrt = math.sqrt(1.0 - beta2**step)
    for p, g, m, v, copy in zip(params, grads, exp_avgs, exp_avg_sqs, copies, strict=True):
        g = g.to(torch.float32)
        p.mul_(1.0 - lr * weight_decay)
        m.lerp_(g, 1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        p.addcdiv_(m, (v.sqrt() / bias_sqrt).add_(eps), value=-step_size)
        if copy is not None:
            copy.copy_(p)
