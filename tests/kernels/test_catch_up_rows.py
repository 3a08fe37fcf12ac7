"""The catch-up of a lazily stepped table's missed AdamW steps (:func:`kernels.catch_up_rows`): the Triton kernel
(in Triton's interpreter) and its reference against dense AdamW stepped with zero gradients, under a changing
learning rate and weight decay, with repeated rows, rows already current, a schedule that starts after step 0, rows
whose second moment makes eps count, and the missed steps past the window reduced to their decay."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import catch_up_rows, multi_adamw

BETAS, EPS = (0.9, 0.99), 1e-8


def _schedule(lrs: dict[int, float], weight_decay: float, base: int, betas=BETAS):
    """The device schedule of steps ``base + 1 ..`` (entry ``u - base``) for the rates ``lrs[u]``."""
    size = max(lrs) - base + 1
    schedule = torch.zeros(size, 3, dtype=torch.float32)
    log_decay = torch.zeros(size, dtype=torch.float64)
    total = 0.0
    for u in range(base + 1, max(lrs) + 1):
        lr = lrs[u]
        schedule[u - base] = torch.tensor([lr / (1 - betas[0] ** u), math.sqrt(1 - betas[1] ** u), 1 - lr * weight_decay])
        total += math.log1p(-lr * weight_decay)
        log_decay[u - base] = total
    return schedule, log_decay


def _dense(tables, last, now, lrs, weight_decay, betas=BETAS):
    """Each row stepped by dense AdamW (:func:`multi_adamw`'s reference) with zero gradients from its last step on."""
    p, m, v = (t.clone() for t in tables)
    for r in range(p.shape[0]):
        for u in range(int(last[r]) + 1, now + 1):
            multi_adamw([p[r]], [torch.zeros_like(p[r])], [m[r]], [v[r]], lr=lrs[u], betas=betas, eps=EPS,
                        weight_decay=weight_decay, step=u, backend="pytorch")
    return p, m, v


def _tables(rows: int, dim: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(rows, dim, generator=g), torch.randn(rows, dim, generator=g) * 0.1,
            torch.rand(rows, dim, generator=g) * 0.01]


@pytest.mark.parametrize("backend", ["triton", "pytorch"])
@pytest.mark.parametrize("dim", [8, 24, 640], ids=["narrow", "not_a_power_of_two", "two_blocks"])
def test_caught_up_rows_are_dense_adamw_with_zero_gradients(backend, dim):
    base, now = 4, 13
    lrs = {u: 1e-2 * (1 + 0.3 * math.sin(u)) for u in range(1, now + 1)}  # a rate that changes every step
    last = torch.tensor([4, 13, 7, 12, 5, 9, 4, 10], dtype=torch.int32)
    rows = torch.tensor([0, 2, 2, 4, 1, 6, 2, 7, 0])  # rows 3 and 5 not named; 1 already current
    tables = _tables(8, dim)
    before = [t.clone() for t in tables]
    want = _dense(tables, last, now, lrs, weight_decay=0.1)
    schedule, log_decay = _schedule(lrs, 0.1, base)
    clock = torch.tensor([now, base], dtype=torch.int32)
    catch_up_rows(*tables, last, rows, clock, schedule, log_decay, betas=BETAS, eps=EPS, window=16, backend=backend)
    named = torch.zeros(8, dtype=torch.bool)
    named[rows] = True
    assert last.tolist() == [13, 13, 13, 12, 13, 9, 13, 13]
    for name, got, ref, old in zip(("param", "exp_avg", "exp_avg_sq"), tables, want, before, strict=True):
        torch.testing.assert_close(got[named], ref[named], rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
        assert torch.equal(got[~named], old[~named]), f"{name}: a row not named moved"
        assert torch.equal(got[1], old[1]), f"{name}: a current row moved"
        assert not torch.equal(got[0], old[0]), f"{name}: a stale row did not move"


@pytest.mark.parametrize("backend", ["triton", "pytorch"])
def test_rows_whose_second_moment_is_near_eps_squared(backend):
    """Where ``sqrt(v)`` is of the order of ``eps`` (a row whose gradients were tiny) or zero, ``eps`` weighs in every
    missed update's denominator, and its share changes from step to step as ``v`` decays: still dense AdamW."""
    now = 40
    lrs = {u: 1e-2 * (1 + 0.3 * math.cos(u)) for u in range(1, now + 1)}
    last = torch.tensor([0, 3, 17, 39], dtype=torch.int32)
    g = torch.Generator().manual_seed(5)
    p = torch.randn(4, 24, generator=g)
    root = EPS * torch.rand(4, 24, generator=g) * 4  # sqrt(v) from 0 to 4 eps
    root[:, :4] = 0.0
    m = root * torch.randn(4, 24, generator=g)
    tables = [p, m, root.square()]
    before = p.clone()
    want = _dense(tables, last, now, lrs, weight_decay=0.1)
    schedule, log_decay = _schedule(lrs, 0.1, 0)
    catch_up_rows(*tables, last, torch.arange(4), torch.tensor([now, 0], dtype=torch.int32), schedule, log_decay,
                  betas=BETAS, eps=EPS, window=64, backend=backend)
    assert (p - before * math.exp(float(log_decay[now]))).abs().max() > 1e-3  # more than the decay moved the rows
    for name, got, ref in zip(("param", "exp_avg", "exp_avg_sq"), tables, want, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7 * float(ref.abs().max()), msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("backend", ["triton", "pytorch"])
def test_steps_past_the_window_only_decay(backend):
    """Gaps of up to 60 steps with a window of 12: the steps past the window change the row by less than their
    bound ``(beta1 / sqrt(beta2))^12`` of a step (here ~5e-7 of it), and decay the moments and the row exactly."""
    betas = (0.3, 0.99)
    now = 61
    lrs = {u: 2e-2 for u in range(1, now + 1)}
    last = torch.tensor([1, 30, 48, 55, 0], dtype=torch.int32)
    tables = _tables(5, 16)
    want = _dense(tables, last, now, lrs, weight_decay=0.05, betas=betas)
    schedule, log_decay = _schedule(lrs, 0.05, 0, betas)
    clock = torch.tensor([now, 0], dtype=torch.int32)
    catch_up_rows(*tables, last, torch.arange(5), clock, schedule, log_decay, betas=betas, eps=EPS, window=12,
                  backend=backend)
    for name, got, ref in zip(("param", "exp_avg", "exp_avg_sq"), tables, want, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


def test_the_triton_kernel_matches_its_reference_on_long_gaps():
    now = 300
    lrs = {u: 1e-3 for u in range(1, now + 1)}
    last = torch.tensor([0, 100, 250, 299, 17, 0], dtype=torch.int32)
    runs = []
    for backend in ("triton", "pytorch"):
        tables = _tables(6, 40)
        schedule, log_decay = _schedule(lrs, 0.01, 0)
        catch_up_rows(*tables, last.clone(), torch.tensor([5, 0, 1, 2, 3, 4, 5]), torch.tensor([now, 0], dtype=torch.int32),
                      schedule, log_decay, betas=BETAS, eps=EPS, window=64, backend=backend)
        runs.append(tables)
    for got, ref in zip(*runs, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"param": torch.zeros(4, 3, dtype=torch.float64)}, "param must be a contiguous float32"),
        ({"last_step": torch.zeros(4, dtype=torch.int64)}, "last_step must be contiguous torch.int32"),
        ({"clock": torch.zeros(3, dtype=torch.int32)}, r"clock must be contiguous torch.int32 \(2,\)"),
        ({"log_decay": torch.zeros(5, dtype=torch.float32)}, "log_decay must be contiguous torch.float64"),
        ({"rows": torch.zeros(2, dtype=torch.int32)}, "rows must be 1-D int64"),
        ({"window": 0}, "window must be at least 1"),
    ],
)
def test_bad_arguments_say_which(change, message):
    args = {"param": torch.zeros(4, 3), "exp_avg": torch.zeros(4, 3), "exp_avg_sq": torch.zeros(4, 3),
            "last_step": torch.zeros(4, dtype=torch.int32), "rows": torch.zeros(2, dtype=torch.int64),
            "clock": torch.zeros(2, dtype=torch.int32), "schedule": torch.zeros(5, 3),
            "log_decay": torch.zeros(5, dtype=torch.float64), "window": 8}
    args.update(change)
    window = args.pop("window")
    with pytest.raises(ValueError, match=message):
        catch_up_rows(**args, betas=BETAS, eps=EPS, window=window)


def test_bench_catch_up_checks_the_kernel_and_times_every_case(tmp_path):
    """``experiments.bench_catch_up`` on CPU (the kernel in Triton's interpreter): the kernel agrees with its
    reference, every case is timed, the JSON is written; bad sizes are refused in one line."""
    import json

    from experiments import bench_catch_up

    out = tmp_path / "catch_up.json"
    assert bench_catch_up.main(["--device", "cpu", "--rows", "64", "--dim", "8", "--entries", "24", "--steps", "6",
                                "--repeats", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert all(c["max_abs_diff"] <= 1e-6 * max(1.0, c["max_abs_ref"]) for c in result["checks"].values())
    assert set(result["ms_median"]) == {"behind_by_the_window", "gaps_1_to_steps", "one_step_behind", "current",
                                        "flush_behind_by_the_window"}
    with pytest.raises(SystemExit):
        bench_catch_up.main(["--rows", "0"])
