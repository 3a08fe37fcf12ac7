"""The training harness: an exact resume after SIGKILL, checkpoints, MLflow records, eval output."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest
import torch

from foundation.checkpoint import load_checkpoint_file
from gem.cli import main
from tests.events import write_dataset

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("events"), rows={"train": 2400, "valid": 300, "test": 300}, row_group_size=200)


def _gem(*args: str, cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-m", "gem.cli", *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _train_args(dataset: Path, out: Path, workers: int) -> list[str]:
    return [
        "train",
        "--flavor",
        "debug",
        f"data.path={dataset}",
        f"data.num_workers={workers}",
        "data.batch_size=32",
        f"train.out_dir={out}",
        f"train.tracking_uri=sqlite:///{out}/mlflow.db",
        "train.checkpoint_every_n_steps=7",
        "train.progress_bar=false",
        "model.dlrm.bottom_mlp=(256,256)",
        "model.dlrm.top_mlp=(512,256)",
    ]


def _final_state(out: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint_file(out / "debug" / "checkpoints" / "last.ckpt")


@pytest.mark.parametrize("workers", [0, 2])
def test_sigkill_mid_run_then_resume_matches_uninterrupted(dataset, tmp_path, workers):
    ref_out, cut_out = tmp_path / "ref", tmp_path / "cut"
    ref = _gem(*_train_args(dataset, ref_out, workers), cwd=tmp_path)
    assert ref.wait(timeout=600) == 0, ref.stdout.read()

    victim = _gem(*_train_args(dataset, cut_out, workers), cwd=tmp_path)
    last = cut_out / "debug" / "checkpoints" / "last.ckpt"
    deadline = time.time() + 300
    while not last.exists() and victim.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert victim.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    killed_at = load_checkpoint_file(last)["global_step"]
    final_steps = _final_state(ref_out)["global_step"]
    assert 0 < killed_at < final_steps

    resumed = _gem(*_train_args(dataset, cut_out, workers), cwd=tmp_path)
    assert resumed.wait(timeout=600) == 0, resumed.stdout.read()

    a, b = _final_state(ref_out), _final_state(cut_out)
    assert a["global_step"] == b["global_step"] == final_steps
    for name, tensor in a["state_dict"].items():
        assert torch.equal(tensor, b["state_dict"][name]), name

    mlflow.set_tracking_uri(f"sqlite:///{cut_out}/mlflow.db")
    runs = mlflow.search_runs(experiment_names=["gem"])
    assert len(runs) == 1, "the resumed run must continue the same MLflow run"
    mlflow.set_tracking_uri(f"sqlite:///{ref_out}/mlflow.db")
    ref_run = mlflow.search_runs(experiment_names=["gem"]).iloc[0]
    resumed_run = runs.iloc[0]
    for metric in ("metrics.val/click/ne", "metrics.val/click/auc", "metrics.val/conversion/ne"):
        assert resumed_run[metric] == ref_run[metric]


def test_eval_writes_json_and_cli_errors_are_clear(dataset, tmp_path, capsys):
    out = tmp_path / "run"
    args = [*_train_args(dataset, out, 0), "train.max_epochs=1"]
    proc = _gem(*args, cwd=tmp_path)
    assert proc.wait(timeout=600) == 0, proc.stdout.read()
    ckpt = out / "debug" / "checkpoints" / "last.ckpt"
    report = tmp_path / "eval.json"
    proc = _gem("eval", "--ckpt", str(ckpt), "--split", "test", "--json", str(report), cwd=tmp_path)
    assert proc.wait(timeout=300) == 0, proc.stdout.read()
    metrics = json.loads(report.read_text())["metrics"]
    for key in ("click/ne", "click/auc", "click/calibration", "click/ne/d0", "click/oracle_ne", "click/base_rate_ne"):
        assert key in metrics

    for bad_args, expected in [
        (["train", "--flavor", "nope"], "unknown flavor 'nope'"),
        (["train", "--flavor", "debug", "train.nope=1"], "unknown field 'nope'"),
        (["train", "--flavor", "debug", "train.lr=fast"], "cannot parse"),
        (["train", "--flavor", "debug", "data.path=/nonexistent"], "dataset '/nonexistent' not found"),
        (["eval", "--ckpt", "/nonexistent.ckpt"], "checkpoint not found"),
        (["export", "--ckpt", "/nonexistent.ckpt", "--store", "store"], "checkpoint not found"),
        (["teacher-outputs", "--ckpt", "/nonexistent.ckpt", "--out", "outputs"], "checkpoint not found"),
    ]:
        assert main(bad_args) == 2
        assert expected in capsys.readouterr().err

    assert main(["teacher-outputs", "--ckpt", str(ckpt), "--split", "test", "--out", str(tmp_path / "to"), "--rows-per-shard", "128"]) == 0
    manifest = json.loads((tmp_path / "to" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["rows"] == 300
    capsys.readouterr()

    ckpt.write_bytes(ckpt.read_bytes()[:1000])
    assert main(["eval", "--ckpt", str(ckpt)]) == 2
    assert "unreadable checkpoint" in capsys.readouterr().err


def test_resume_with_a_changed_config_continues_the_run_and_records_the_change(dataset, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    monkeypatch.delenv("GEM_ATTENTION_BACKEND", raising=False)
    args = ["train", *_train_args(dataset, out, 0)[1:], "model.kernels.deterministic=true", "train.max_epochs=1",
            "train.max_steps=8"]
    assert main(args) == 0
    # The resumed process runs the reference attention through the environment's override.
    monkeypatch.setenv("GEM_ATTENTION_BACKEND", "pytorch")
    assert main([*args[:-1], "train.max_steps=16"]) == 0, capsys.readouterr().err
    mlflow.set_tracking_uri(f"sqlite:///{out}/mlflow.db")
    runs = mlflow.search_runs(experiment_names=["gem"])
    assert len(runs) == 1, "the resumed run must continue the same MLflow run"
    run = mlflow.get_run(runs.iloc[0]["run_id"])
    assert run.data.params["train.max_steps"] == "8", "params stay as first logged"
    params = run.data.params
    assert params["model.kernels.deterministic"] == params["kernels.effective.deterministic"] == "True"
    assert params["kernels.effective.backend"] == "auto" and "kernels.env.GEM_ATTENTION_BACKEND" not in params
    assert run.data.tags["gem.resume.changed"] == (
        "kernels.effective.backend,kernels.env.GEM_ATTENTION_BACKEND,train.max_steps"
    )
    resumed = json.loads(Path(mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="config_resume_1.json")).read_text())
    assert resumed["train"]["max_steps"] == 16


def test_a_checkpoint_from_automatic_optimisation_resumes_at_its_step(dataset, tmp_path):
    """Checkpoints written before the harness ran its own step count steps in Lightning's automatic loop."""
    out = tmp_path / "run"
    args = ["train", *_train_args(dataset, out, 0)[1:], "train.max_epochs=2"]
    assert main([*args, "train.max_steps=10"]) == 0
    last = out / "debug" / "checkpoints" / "last.ckpt"
    ckpt = torch.load(last, weights_only=True)
    loops = ckpt["loops"]["fit_loop"]
    manual = loops["epoch_loop.manual_optimization.optim_step_progress"]
    automatic = loops["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]["step"]
    assert manual["total"]["completed"] == 10 and automatic["total"]["completed"] == 0
    # As the harness wrote it before: the steps in the automatic loop's progress, none in the manual one's.
    loops["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]["step"] = manual
    loops["epoch_loop.manual_optimization.optim_step_progress"] = automatic
    torch.save(ckpt, last)
    assert main([*args, "train.max_steps=20"]) == 0
    resumed = torch.load(last, weights_only=True)
    assert resumed["global_step"] == 20
    # Written at the end of the step that reached max_steps, before Lightning counts that step in
    # _batches_that_stepped (a restore from such a checkpoint adds it back).
    assert resumed["loops"]["fit_loop"]["epoch_loop.state_dict"]["_batches_that_stepped"] == 19
