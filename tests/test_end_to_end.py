"""The main job end to end on the `debug` flavor: synthetic world -> training -> held-out evaluation."""

from __future__ import annotations

import mlflow
import pytest

from gem.quickstart import run_quickstart


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    return tmp_path


def test_debug_quickstart_learns_and_is_tracked(workdir):
    report = run_quickstart(preset="debug", flavor="debug", overrides=["train.progress_bar=false"])
    model = report["results"]["model"]["metrics"]
    assert (workdir / "data/synth-debug/schema.json").is_file()

    # Beats the trivial predictor on held-out data, and stays below the oracle's ceiling.
    assert model["click/ne"] < model["click/base_rate_ne"] - 0.02
    assert model["click/auc"] > 0.6
    assert model["click/oracle_ne"] < model["click/ne"]

    client = mlflow.tracking.MlflowClient()
    run_id = report["results"]["model"]["run_id"]
    losses = [m.value for m in client.get_metric_history(run_id, "train/loss")]
    assert len(losses) >= 4
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2, "training loss must fall"

    run = client.get_run(run_id)
    assert run.data.params["model.arch"] == "dlrm"
    for key in ("val/click/ne", "val/click/auc", "val/click/calibration", "val/click/ne/d0", "test/click/ne"):
        assert key in run.data.metrics, key
    assert "data/quarantined_rows" in run.data.metrics
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"config.json", "checkpoint.json"} <= artifacts
    assert any(key.startswith("system/") for key in run.data.metrics)
    assert "| predictor |" in report["table"]
