"""Reference for :mod:`kernels.triton.adamw`: torch's AdamW update, one tensor at a time, and the row sums of
sparse table gradients."""

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


def sum_rows(rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``[N, D]`` float32: the entries ``values[N, D]`` summed per distinct row of ``rows[N]``, row ``j`` of the
    result holding the ``j``-th smallest row's sum (entries added in their order), zeros after the last distinct
    row. No device sync: the runs of the sorted rows are numbered by a scan."""
    ordered, order = torch.sort(rows, stable=True)
    starts = torch.ones_like(ordered)
    starts[1:] = ordered[1:] != ordered[:-1]
    run = torch.empty_like(ordered).scatter_(0, order, starts.cumsum(0) - 1)  # [N]: each entry's run
    return torch.zeros(values.shape, dtype=torch.float32, device=values.device).index_add_(0, run, values.float())


def row_adamw(
    param: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    rows: torch.Tensor,
    grad_rows: torch.Tensor,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    step: int,
) -> None:
    """One lazy AdamW step of a table ``param[R, D]`` (float32) on the rows ``rows[N]`` name: each distinct row
    ``r`` gets the sum of the ``grad_rows[N, D]`` entries naming it (summed in their order) as its gradient and
    :func:`multi_adamw`'s update, moments ``exp_avg``/``exp_avg_sq`` ``[R, D]`` included; every other row and its
    moments stay as they are (``torch.optim.SparseAdam``'s rule). ``step`` counts this step (from 1)."""
    unique, inverse = torch.unique(rows, return_inverse=True)
    grad = torch.zeros(unique.numel(), param.shape[1], dtype=torch.float32, device=param.device)
    grad.index_add_(0, inverse, grad_rows.to(torch.float32))
    touched = [param[unique], exp_avg[unique], exp_avg_sq[unique]]
    multi_adamw([touched[0]], [grad], [touched[1]], [touched[2]], [None], lr=lr, betas=betas, eps=eps,
                weight_decay=weight_decay, step=step)
    for table, values in zip((param, exp_avg, exp_avg_sq), touched, strict=True):
        table[unique] = values


def catch_up_rows(
    param: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    last_step: torch.Tensor,
    rows: torch.Tensor,
    clock: torch.Tensor,
    schedule: torch.Tensor,
    log_decay: torch.Tensor,
    *,
    betas: tuple[float, float],
    eps: float,
    window: int,
) -> None:
    """Bring the rows ``rows[N]`` (repeats allowed) of a lazily stepped table ``param[R, D]`` to where AdamW would
    have them after ``clock[0]`` steps: each row ``r`` with ``last_step[r] < clock[0]`` gets the zero-gradient
    AdamW steps it missed, ``last_step[r] + 1 .. clock[0]``, moments included, and ``last_step[r] = clock[0]``.

    The steps' scalars come from the device: ``schedule[u - clock[1], :]`` holds step ``u``'s ``lr / (1 -
    beta1^u)``, ``sqrt(1 - beta2^u)`` and ``1 - lr * weight_decay`` (float32), ``log_decay[u - clock[1]]`` the sum
    of ``log(1 - lr * weight_decay)`` over the steps ``clock[1] + 1 .. u`` (float64). The first ``window`` missed
    steps are applied one by one (:func:`multi_adamw`'s update with a zero gradient); after them a zero-gradient
    step's update is below ``(beta1 / sqrt(beta2))^window`` of the first one's, so the later ones only decay the
    moments and the row (closed form). Every ``last_step`` must be at least ``clock[1]``."""
    beta1, beta2 = betas
    now, base = (int(x) for x in clock.tolist())
    unique = torch.unique(rows)
    old = last_step[unique].to(torch.int64)
    unique, old = unique[old < now], old[old < now]
    if unique.numel() == 0:
        return
    p, m, v = param[unique], exp_avg[unique], exp_avg_sq[unique]
    stop = old.clamp(max=now - window) + window  # min(old + window, now)
    zero = torch.zeros_like(m)
    for u in range(int(old.min()) + 1, int(stop.max()) + 1):
        live = ((old < u) & (u <= stop))[:, None]
        step_size, bias_sqrt, decay = schedule[u - base].tolist()
        q, n, w = p.clone(), m.clone(), v.clone()
        q.mul_(decay)
        n.lerp_(zero, 1.0 - beta1)
        w.mul_(beta2)
        q.addcdiv_(n, (w.sqrt() / bias_sqrt).add_(eps), value=-step_size)
        p, m, v = torch.where(live, q, p), torch.where(live, n, m), torch.where(live, w, v)
    skipped = (now - stop).to(torch.float64)[:, None]
    m = m * (beta1**skipped).to(torch.float32)
    v = v * (beta2**skipped).to(torch.float32)
    p = p * torch.exp(log_decay[now - base] - log_decay[stop - base])[:, None].to(torch.float32)
    for table, values in zip((param, exp_avg, exp_avg_sq), (p, m, v), strict=True):
        table[unique] = values
    last_step[unique] = now
