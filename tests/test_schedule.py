"""The learning-rate schedule (:mod:`gem.schedule`): warm-up and cosine by steps and by time, the optimizer hook that
applies it, the ``train.*`` settings that make it (refused in one line when they cannot), and the harness following
it step by step."""

from __future__ import annotations

import itertools
import math
import re

import lightning as L
import pytest
import torch

from foundation.config import ConfigError
from gem.cli import main
from gem.config import TrainConfig
from gem.schedule import ScheduledLR, WarmupCosine, build_lr_schedule
from tests.events import write_dataset
from tests.test_harness_fast_step import fit

pytestmark = pytest.mark.usefixtures("one_thread")


def test_warmup_is_linear_then_the_cosine_ends_at_the_floor():
    s = WarmupCosine(lr=1e-3, steps=100, warmup_steps=10, final_frac=0.1)
    assert [s.lr_at(i) for i in range(3)] == pytest.approx([1e-4, 2e-4, 3e-4])
    assert s.lr_at(9) == pytest.approx(1e-3)  # the last warm-up step reaches the peak
    assert s.lr_at(10) == pytest.approx(1e-3)  # the decay starts from it
    assert s.lr_at(55) == pytest.approx(1e-4 + 0.9e-3 * 0.5)  # half-way through the decay
    decay = [s.lr_at(i) for i in range(10, 100)]
    assert all(a > b for a, b in itertools.pairwise(decay))
    assert s.lr_at(100) == pytest.approx(1e-4) and s.lr_at(500) == pytest.approx(1e-4)


def test_constant_rate_without_warmup_or_decay():
    s = WarmupCosine(lr=2e-3, steps=50)
    assert {s.lr_at(i, t) for i in range(60) for t in (0.0, 0.5, 2.0)} == {2e-3}


def test_time_moves_progress_ahead_of_the_steps():
    s = WarmupCosine(lr=1.0, steps=1000, warmup_steps=0, final_frac=0.0)
    assert s.progress(10, 0.5) == 0.5  # time is ahead of the steps: it decides
    assert s.progress(900, 0.5) == 0.9  # the steps are ahead
    assert s.lr_at(10, 0.5) == pytest.approx(0.5)  # cos(pi/2): half of the peak, not ~1 as by steps
    assert s.progress(10, 1.5) == 1.0 and s.lr_at(10, 1.5) == pytest.approx(0.0)


@pytest.mark.parametrize(
    "kwargs",
    [dict(lr=0.0, steps=10), dict(lr=1e-3, steps=0), dict(lr=1e-3, steps=10, warmup_steps=10),
     dict(lr=1e-3, steps=10, final_frac=1.5)],
)
def test_bad_schedules_are_refused(kwargs):
    with pytest.raises(ValueError, match="schedule"):
        WarmupCosine(**kwargs)


def _sgd_steps(scheduled: ScheduledLR, optimizer, param, count: int, now: list[float], tick: float = 0.0):
    """``count`` SGD steps (gradient 1) ``tick`` seconds apart: the rate each step's update used."""
    moves = []
    for _ in range(count):
        param.grad = torch.ones(3)
        before = param.detach().clone()
        optimizer.step()
        assert [g["lr"] for g in optimizer.param_groups] == pytest.approx(
            [g["initial_lr"] * scheduled.last_lr / scheduled.schedule.lr for g in optimizer.param_groups]
        )
        moves.append(float((before - param.detach())[0]))  # SGD moves by lr * grad
        now[0] += tick
    return moves


def test_hook_sets_the_rate_of_every_step_and_keeps_the_groups_ratio():
    now = [0.0]
    param = torch.nn.Parameter(torch.zeros(3))
    # A second group at a tenth of the peak (as the transfer's shared parameters at share_lr_scale).
    optimizer = torch.optim.SGD([{"params": [param]}, {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.1}],
                                lr=1.0)
    schedule = WarmupCosine(lr=1.0, steps=4, warmup_steps=2, final_frac=0.0)
    scheduled = ScheduledLR(optimizer, schedule, deadline=None, clock=lambda: now[0])
    # warm-up 1/2, 2/2; then the cosine from the peak at progress 2/4 to 0 at 4/4: 1 at 2/4, 1/2 at 3/4
    assert _sgd_steps(scheduled, optimizer, param, 4, now) == pytest.approx([0.5, 1.0, 1.0, 0.5])
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.5, 0.05])
    assert scheduled.finished()  # four steps of four
    scheduled.handle.remove()
    optimizer.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.5)  # no longer driven


def test_time_counts_from_the_first_step_to_the_deadline():
    now = [30.0]  # the first forward and backward took 30 s (kernels compiling)
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([param], lr=1.0)
    schedule = WarmupCosine(lr=1.0, steps=1000, final_frac=0.0)
    scheduled = ScheduledLR(optimizer, schedule, deadline=130.0, clock=lambda: now[0])
    assert scheduled.time_fraction() == 0.0 and not scheduled.finished()
    # Steps 25 s apart: the time fraction is 0, 1/4, 2/4, 3/4 of the 100 s from the first step to the deadline.
    moves = _sgd_steps(scheduled, optimizer, param, 4, now, tick=25.0)
    expected = [0.5 * (1 + math.cos(math.pi * f)) for f in (0.0, 0.25, 0.5, 0.75)]
    assert moves == pytest.approx(expected)
    assert now[0] == 130.0 and scheduled.finished()  # the deadline, four steps of a thousand


def test_the_train_settings_make_the_schedule():
    assert build_lr_schedule(TrainConfig()) is None  # the constant rate
    warm = build_lr_schedule(TrainConfig(lr=2e-3, warmup_steps=4))
    assert [warm.lr_at(i) for i in range(7)] == pytest.approx([5e-4, 1e-3, 1.5e-3, 2e-3, 2e-3, 2e-3, 2e-3])
    assert warm.lr_at(10**6, time_fraction=1.0) == pytest.approx(2e-3)  # no decay: the peak holds
    cosine = build_lr_schedule(TrainConfig(lr=1.0, warmup_steps=2, final_lr_frac=0.1, max_steps=12))
    assert cosine == WarmupCosine(lr=1.0, steps=12, warmup_steps=2, final_frac=0.1)
    assert cosine.lr_at(7) == pytest.approx(0.1 + 0.9 * 0.5)


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        (dict(warmup_steps=-1), "train.warmup_steps=-1 must be 0 or more"),
        (dict(final_lr_frac=1.5), "train.final_lr_frac=1.5 must lie in [0, 1]"),
        (dict(final_lr_frac=0.1), "decays until train.max_steps, which must exceed train.warmup_steps=0; got -1"),
        (dict(final_lr_frac=0.1, warmup_steps=8, max_steps=8), "must exceed train.warmup_steps=8; got 8"),
    ],
)
def test_settings_it_cannot_follow_are_refused(settings, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        build_lr_schedule(TrainConfig(**settings))


def test_no_schedule_under_parallel():
    with pytest.raises(ConfigError, match="no schedule under parallel"):
        build_lr_schedule(TrainConfig(warmup_steps=10), parallel=True)
    assert build_lr_schedule(TrainConfig(), parallel=True) is None


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("events"), rows={"train": 480, "valid": 96, "test": 96}, row_group_size=96)


class RateTrace(L.Callback):
    """The rate each training step's update used and the ``train/lr`` the module reports after it."""

    def __init__(self) -> None:
        self.used: list[float] = []
        self.reported: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.used.append(trainer.optimizers[0].param_groups[0]["lr"])
        self.reported.append(pl_module.step_metrics()["train/lr"])


# The debug teacher's plain step, and its static step on padded batches (gem.loop.StaticStep, MasterAdamW keeping
# the cast-once copies).
@pytest.mark.parametrize("step", [[], ["train.bucket_rows=(24,36)"]], ids=["plain_step", "static_step"])
def test_the_harness_follows_the_schedule_step_by_step(dataset, tmp_path, step):
    rates = RateTrace()
    steps, _ = fit(dataset, tmp_path, ["train.lr=0.01", "train.max_steps=8", "train.warmup_steps=3",
                                       "train.final_lr_frac=0.0", *step], callbacks=(rates,))
    expected = [0.01 * (i + 1) / 3 for i in range(3)] + [0.01 * 0.5 * (1 + math.cos(math.pi * (i - 3) / 5))
                                                           for i in range(3, 8)]
    assert rates.used == pytest.approx(expected) and rates.reported == pytest.approx(expected)
    assert all(a > b for a, b in itertools.pairwise(expected[3:]))  # the decay, from the peak
    assert steps.padded == [bool(step)] * 8


def test_gem_train_refuses_a_decay_without_an_end_in_one_line(dataset, tmp_path, capsys):
    args = ["train", "--flavor", "debug", f"data.path={dataset}", f"train.out_dir={tmp_path}", "train.final_lr_frac=0.1"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "train.final_lr_frac=0.1 decays until train.max_steps" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "debug").exists()
