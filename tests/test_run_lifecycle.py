"""A training run's MLflow record under SIGKILL and refusal (issue 19, items 9-11), by doing it.

Real ``gem train`` processes are killed at the named moments (between the run's creation and its first
checkpoint, during checkpoint saves, at a random time) and restarted with the same command; the result is
compared with an uninterrupted run of the same config: one MLflow run, FINISHED, each metric's history with
every step once, no temp file left, the same parameters. Refused runs leave no FAILED run behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pyarrow as pa
import pytest
import torch

from foundation.checkpoint import RUN_ID_FILE, load_checkpoint_file
from foundation.data.io import shard_path, write_table
from tests.events import make_events, write_dataset

REPO = Path(__file__).resolve().parents[1]
RUN = "lifecycle"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("events"), rows={"train": 2400, "valid": 300, "test": 300}, row_group_size=200)


def gem(*args: str, cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "gem.cli", *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )


def train_args(dataset: Path, out: Path, *extra: str) -> list[str]:
    """Two epochs of 75 steps, a checkpoint every 7 steps; wide layers make each save take a while."""
    return [
        "train", "--flavor", "debug", f"name={RUN}", f"data.path={dataset}", "data.batch_size=32",
        f"train.out_dir={out}", f"train.tracking_uri=sqlite:///{out}/mlflow.db", "train.checkpoint_every_n_steps=7",
        "train.log_every_n_steps=1", "train.progress_bar=false", "train.log_checkpoint=false",
        "model.dlrm.bottom_mlp=(1024,1024)", "model.dlrm.top_mlp=(1024,512)", *extra,
    ]


def finish(proc: subprocess.Popen, timeout: float = 900) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"


def wait_for(condition, proc: subprocess.Popen, timeout: float = 600, poll: float = 0.001) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before the moment to kill it"
        assert time.time() < deadline, "timed out waiting for the moment to kill the run"
        time.sleep(poll)


def temp_checkpoints(out: Path) -> list[Path]:
    return list((out / RUN / "checkpoints").glob(".last.ckpt.*.tmp"))


def kill_during_save(dataset: Path, out: Path, nth: int) -> bool:
    """Start the run and SIGKILL it while its ``nth`` checkpoint of this attempt is being written; returns
    whether the kill left the write's temp file behind."""
    seen: set[Path] = set()
    proc = gem(*train_args(dataset, out), cwd=out)

    def nth_save_started() -> bool:
        seen.update(temp_checkpoints(out))
        return len(seen) >= nth

    wait_for(nth_save_started, proc)
    kill(proc)
    return bool(temp_checkpoints(out))


def runs_of(out: Path) -> list:
    client = mlflow.MlflowClient(f"sqlite:///{out}/mlflow.db")
    return client.search_runs([e.experiment_id for e in client.search_experiments()], run_view_type=1)


def histories(out: Path) -> dict[str, list[tuple[int, float]]]:
    """Metric -> ``(step, value)`` of every logged point of the run, in step order (MLflow's monitor excluded)."""
    (run,) = runs_of(out)
    client = mlflow.MlflowClient(f"sqlite:///{out}/mlflow.db")
    return {
        key: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        for key in run.data.metrics
        if not key.startswith("system/")
    }


def assert_same_record(ref: Path, cut: Path) -> None:
    """One FINISHED run; every metric logged at the reference's steps, once each, with its values (timing
    figures differ between attempts); the same final parameters."""
    (run,) = runs_of(cut)
    assert run.info.status == "FINISHED"
    want, got = histories(ref), histories(cut)
    assert set(got) == set(want)
    for key, points in got.items():
        steps = [s for s, _ in points]
        assert len(steps) == len(set(steps)), f"{key}: duplicate steps {sorted(s for s in steps if steps.count(s) > 1)}"
        assert steps == [s for s, _ in want[key]], f"{key}: missing steps {sorted({s for s, _ in want[key]} - set(steps))}"
        if not key.startswith("perf/"):
            assert [v for _, v in points] == [v for _, v in want[key]], key
    a = load_checkpoint_file(ref / RUN / "checkpoints" / "last.ckpt")
    b = load_checkpoint_file(cut / RUN / "checkpoints" / "last.ckpt")
    assert a["global_step"] == b["global_step"] == 150
    for name, tensor in a["state_dict"].items():
        assert torch.equal(tensor, b["state_dict"][name]), name
    assert not temp_checkpoints(cut)


@pytest.fixture(scope="module")
def reference(dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    finish(gem(*train_args(dataset, out), cwd=out))
    return out


def test_kills_during_checkpoint_saves_leave_one_complete_history_and_no_temp_file(dataset, reference, tmp_path):
    """Item 10 and 11: saves killed mid-write (the 2nd, then the 9th of the next attempt: around the epoch
    end, whose checkpoint follows validation), then a kill at a random moment, then a run to the end."""
    out = tmp_path
    left_temp = [kill_during_save(dataset, out, 2), kill_during_save(dataset, out, 9)]
    assert any(left_temp), "no kill landed inside a checkpoint write"
    proc = gem(*train_args(dataset, out), cwd=out)
    time.sleep(2.0 + 3.0 * torch.rand(()).item())
    kill(proc)
    finish(gem(*train_args(dataset, out), cwd=out))
    assert_same_record(reference, out)


def test_kill_before_the_first_checkpoint_continues_the_same_mlflow_run(dataset, reference, tmp_path):
    """Item 9: the run exists in MLflow (its id recorded) but no checkpoint does when the process dies; the
    restart continues that run. Then the id file is removed as if the kill had come before it was written:
    the restart adopts the orphaned RUNNING run by its run-directory tag instead of opening a second one."""
    out = tmp_path
    proc = gem(*train_args(dataset, out), cwd=out)
    wait_for(lambda: (out / RUN / RUN_ID_FILE).is_file(), proc)
    kill(proc)
    assert not (out / RUN / "checkpoints" / "last.ckpt").exists()
    (run,) = runs_of(out)
    assert run.info.status == "RUNNING"

    proc = gem(*train_args(dataset, out), cwd=out)
    wait_for(lambda: (out / RUN / "checkpoints" / "last.ckpt").is_file(), proc)
    kill(proc)
    (out / RUN / RUN_ID_FILE).unlink()
    finish(gem(*train_args(dataset, out), cwd=out))
    assert (out / RUN / RUN_ID_FILE).read_text().strip() == run.info.run_id
    assert_same_record(reference, out)


def bad_labels(dataset: Path) -> None:
    """Row 3 of the first training shard gets click label 2."""
    table = make_events(10, seed=5, start_id=10**6)
    clicks = table.column("click").to_pylist()
    clicks[3] = 2
    table = table.set_column(table.schema.get_field_index("click"), "click", pa.array(clicks, pa.int8()))
    write_table(table, shard_path(dataset, "train", 0), row_group_size=8)


def test_refused_runs_leave_no_failed_run(tmp_path):
    """Item 11: a new run refused by bad data is deleted with its records; a finished run refused when
    continued keeps its status; a refused continuation with another config opens nothing."""
    data = write_dataset(tmp_path / "data", rows={"train": 200, "valid": 40, "test": 40}, row_group_size=50)
    out = tmp_path / "runs"
    args = train_args(data, out, "train.max_steps=5")
    finish(gem(*args, cwd=tmp_path))
    (finished,) = runs_of(out)

    proc = gem(*args[:-1], "train.max_steps=10", "data.num_workers=2", cwd=tmp_path)
    text, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "holds a run of another config (data.num_workers: 0 -> 2" in text, text

    bad_labels(data)
    proc = gem(*args[:-1], "train.max_steps=10", cwd=tmp_path)
    text, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2, text
    (run,) = runs_of(out)
    assert run.info.run_id == finished.info.run_id and run.info.status == "FINISHED"
    assert "click" in run.data.tags["gem.rejected"]

    fresh = tmp_path / "fresh"
    proc = gem(*train_args(data, fresh), cwd=tmp_path)
    text, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2, text
    error = [line for line in text.splitlines() if line.startswith("gem: error:")]
    assert len(error) == 1 and len(error[0]) <= 500 and "click" in error[0], text
    assert runs_of(fresh) == [], "a refused new run must not stay in MLflow"
    assert not (fresh / RUN / RUN_ID_FILE).exists() and not (fresh / RUN / "config.json").exists()
