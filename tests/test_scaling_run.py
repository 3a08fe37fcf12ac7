"""One run of the compute-scaling sweep: the warm-up + cosine schedule (by steps and by time), the optimizer hook
that applies it, and the runner's ends (out of data, out of time) and passes over the split on a tiny world."""

from __future__ import annotations

import collections
import itertools
import json
import math

import pytest
import torch

from experiments import scaling_run
from experiments.scaling_run import ScheduledLR, WarmupCosine, main
from foundation.data.synthetic import generate_world
from gem.flavors import synth_preset
from tests.test_layers import HEAVY, loaded_packages


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
        assert {g["lr"] for g in optimizer.param_groups} == {scheduled.last_lr}
        moves.append(float((before - param.detach())[0]))  # SGD moves by lr * grad
        now[0] += tick
    return moves


def test_hook_sets_the_rate_of_every_step():
    now = [0.0]
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([{"params": [param]}, {"params": [torch.nn.Parameter(torch.zeros(1))]}], lr=9.0)
    schedule = WarmupCosine(lr=1.0, steps=4, warmup_steps=2, final_frac=0.0)
    scheduled = ScheduledLR(optimizer, schedule, deadline=None, clock=lambda: now[0])
    # warm-up 1/2, 2/2; then the cosine from the peak at progress 2/4 to 0 at 4/4: 1 at 2/4, 1/2 at 3/4
    assert _sgd_steps(scheduled, optimizer, param, 4, now) == pytest.approx([0.5, 1.0, 1.0, 0.5])
    assert scheduled.finished()  # four steps of four
    scheduled.handle.remove()
    optimizer.step()
    assert optimizer.param_groups[0]["lr"] == 0.5  # no longer driven


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


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = tmp_path_factory.mktemp("scaling-run") / "world"
    generate_world(synth_preset("debug", num_users=200, num_examples=2_000, max_history=32, users_per_block=100), out,
                   progress=False, workers=1)
    return out


def _run(world, tmp_path, *extra):
    out = tmp_path / "run.json"
    argv = ["--data", str(world), "--flavor", "debug", "--device", "cpu", "--json", str(out), *extra,
            "data.batch_size=64", "data.token_budget=0", "data.max_len=32"]
    return main(argv), out


def test_a_run_out_of_data_stops_there_annealed_by_time_or_not(world, tmp_path):
    rc, out = _run(world, tmp_path, "--steps", "40", "--lr", "3e-3", "--warmup-steps", "2", "--final-lr-frac", "0.1",
                   "--curve-points", "4")
    assert rc == 0
    result = json.loads(out.read_text())
    train_rows = json.loads((world / "synth.json").read_text())["stats"]["rows"]["train"]
    assert result["stopped_by"] == "data" and result["train_rows"] == train_rows
    steps = math.ceil(train_rows / 64)
    assert 20 < steps < 40 and result["history"][0]["steps"] == steps
    assert [c["end_step"] for c in result["curve"]] == [10, 20, steps]  # spans of 40 / 4 steps, the last cut short
    lrs = [c["lr"] for c in result["curve"]]
    assert lrs[0] > lrs[1] > lrs[2] > 3e-4  # decaying, and not at the floor: the split ran out first
    assert result["schedule"] == {"lr": 3e-3, "steps": 40, "warmup_steps": 2, "final_frac": 0.1, "time_budget": 0.0,
                                  "passes": 1, "passes_started": 1}
    assert result["train_flops"] > 0 and result["test"]["click/ne"] > 0


def _train_rows(world) -> int:
    return json.loads((world / "synth.json").read_text())["stats"]["rows"]["train"]


@pytest.fixture
def seen_rows(monkeypatch):
    """The example ids of every batch the runner trains on, in order (one tensor per batch)."""
    seen: list[torch.Tensor] = []
    real = scaling_run.train_epoch

    def spy(model, optimizer, batches, **kwargs):
        def recorded():
            for batch in batches:
                seen.append(batch.example_id.clone())
                yield batch

        return real(model, optimizer, recorded(), **kwargs)

    monkeypatch.setattr(scaling_run, "train_epoch", spy)
    return seen


def test_a_second_pass_reads_the_split_again_reshuffled_under_one_schedule(world, tmp_path, seen_rows):
    train_rows = _train_rows(world)
    one_pass = math.ceil(train_rows / 64)  # one loader process: every batch full but the last
    steps = one_pass + 14
    rc, out = _run(world, tmp_path, "--steps", str(steps), "--passes", "2", "--lr", "3e-3", "--warmup-steps", "2",
                   "--final-lr-frac", "0.1", "--curve-points", "4")
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["stopped_by"] == "steps" and result["history"][0]["steps"] == steps
    assert result["passes"] == 2 and result["passes_started"] == 2
    assert {k: result["schedule"][k] for k in ("steps", "passes", "passes_started")} == {
        "steps": steps, "passes": 2, "passes_started": 2}
    # More rows than the split has, every row read at most twice: the first pass once each, then part of a second.
    ids = torch.cat(seen_rows).tolist()
    assert result["train_rows"] == len(ids) > train_rows
    first = torch.cat(seen_rows[:one_pass]).tolist()
    assert len(first) == len(set(first)) == train_rows
    counts = collections.Counter(ids)
    assert max(counts.values()) == 2 and len(counts) == train_rows
    second = torch.cat(seen_rows[one_pass:]).tolist()
    assert second != first[: len(second)]  # the second pass reshuffled (set_epoch(1)), not the first pass again
    # The schedule ran over both passes, to its floor at the end: the curve's spans cross the pass boundary.
    span = math.ceil(steps / 4)
    ends = [c["end_step"] for c in result["curve"]]
    assert ends == [span, 2 * span, 3 * span, steps]
    assert any(begin < one_pass < end for begin, end in itertools.pairwise([0, *ends]))  # one span holds both passes
    assert [c["pass"] for c in result["curve"]] == [1 if end <= one_pass else 2 for end in ends]
    lrs = [c["lr"] for c in result["curve"]]
    assert all(a > b for a, b in itertools.pairwise(lrs)) and lrs[-1] == pytest.approx(3e-4, rel=0.05)


def test_one_pass_stops_by_data_and_all_passes_run_out(world, tmp_path, seen_rows):
    train_rows = _train_rows(world)
    rc, out = _run(world, tmp_path, "--steps", "200", "--passes", "1")
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["stopped_by"] == "data" and result["train_rows"] == train_rows
    assert result["passes"] == 1 and result["passes_started"] == 1 and {c["pass"] for c in result["curve"]} == {1}
    seen_rows.clear()
    rc, out = _run(world, tmp_path, "--steps", "200", "--passes", "2")
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["stopped_by"] == "data" and result["train_rows"] == 2 * train_rows
    assert result["passes_started"] == 2
    assert set(collections.Counter(torch.cat(seen_rows).tolist()).values()) == {2}  # every row, exactly twice
    # Steps that end with the first pass's last batch begin no second pass.
    one_pass = math.ceil(train_rows / 64)
    rc, out = _run(world, tmp_path, "--steps", str(one_pass), "--passes", "2")
    result = json.loads(out.read_text())
    assert rc == 0 and result["stopped_by"] == "steps" and result["passes_started"] == 1


def test_no_pass_is_a_one_line_error(world, tmp_path, capsys):
    rc, out = _run(world, tmp_path, "--steps", "5", "--passes", "0")
    assert rc == 2 and not out.exists()
    assert capsys.readouterr().out.strip().splitlines() == ["scaling_run: --passes 0 must be >= 1"]


def test_a_run_that_trains_no_step_is_a_one_line_error(world, tmp_path, capsys):
    rc, out = _run(world, tmp_path, "--steps", "5", "--time-budget", "1e-9")
    assert rc == 2 and not out.exists()
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("scaling_run: no step trained within")


def test_the_runner_imports_nothing_the_gpu_machine_lacks():
    """The GPU machine has no MLflow, Lightning or matplotlib: the runner the sweep starts there loads none."""
    assert not loaded_packages("experiments.scaling_run", "experiments.compute_scaling") & {*HEAVY, "matplotlib"}


@pytest.mark.parametrize("extra", [["--steps", "5", "--time-budget", "-1"], ["--steps", "5", "--curve-points", "0"],
                                   ["--steps", "0"], ["--steps", "5", "--warmup-steps", "5"],
                                   ["--steps", "5", "--passes", "0"], ["--steps", "5", "--passes", "-1"]])
def test_bad_arguments_are_one_line_errors(world, tmp_path, capsys, extra):
    rc, out = _run(world, tmp_path, *extra)
    assert rc == 2 and not out.exists()
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("scaling_run: ")
