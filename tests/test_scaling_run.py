"""One run of the compute-scaling sweep: the runner's schedule, its ends (out of data, out of time) and passes over
the split on a tiny world (the schedule itself: tests/test_schedule.py)."""

from __future__ import annotations

import collections
import itertools
import json
import math

import pytest
import torch

from experiments import scaling_run
from experiments.scaling_run import main
from foundation.data.synthetic import generate_world
from gem.flavors import synth_preset
from tests.test_layers import HEAVY, loaded_packages


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
