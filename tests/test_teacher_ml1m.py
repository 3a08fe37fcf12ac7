"""The ML-1M reproduction script end to end on a tiny sequence file: convert, train, rank, write results."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file

from experiments.ml1m_hstu import best_valid, main

pytestmark = pytest.mark.usefixtures("one_thread")


def test_ml1m_script_converts_trains_and_ranks(tmp_path):
    rng = np.random.default_rng(0)
    raw = tmp_path / "raw"
    raw.mkdir()
    # 40 users walking through 30 items in order: a learnable next-item world.
    lines = []
    for user in range(1, 41):
        start, length = rng.integers(1, 31), rng.integers(4, 25)
        lines.append(f"{user}\t" + " ".join(str((start + i) % 30 + 1) for i in range(length)))
    (raw / "sequences.tsv").write_text("\n".join(lines) + "\n")
    out = tmp_path / "run"
    args = ["--data", str(raw), "--out", str(out), "--epochs", "2", "--eval-every", "1"]
    assert main([*args, "--batch-size", "16", "--workers", "0", "--device", "cpu"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert [r["epoch"] for r in results["history"]] == [0, 1]
    final = results["final_test"]
    assert final["count"] == 40 and 0.0 <= final["ndcg10"] <= final["hr10"] <= 1.0
    assert results["history"][0]["tokens_per_s"] > 0 and "mfu" not in results["history"][0]
    assert results["targets"] == {"hr10": 0.3097, "ndcg10": 0.1720}
    weights = load_file(out / "model.safetensors")
    assert any(k.startswith("items.") for k in weights)
    # A second run reuses the converted dataset; a spent time budget stops it after one epoch,
    # which is still evaluated.
    assert main([*args, "--epochs", "5", "--time-budget", "1e-9", "--workers", "0", "--device", "cpu"]) == 0
    assert (out / "dataset" / "schema.json").is_file()
    results = json.loads((out / "results.json").read_text())
    assert results["epochs_run"] == 1 and results["final_test"]["count"] == 40
    assert results["wall_s"] > 0


def shared_ml1m() -> Path:
    root = os.environ.get("GEM_SHARED_DATA")
    base = Path(root) if root else Path(__file__).resolve().parents[2] / "shared" / "data"
    return base / "ml-1m" / "sequences.tsv"


@pytest.mark.skipif(not shared_ml1m().is_file(), reason="ML-1M sequences.tsv not present (../shared/data)")
def test_ml1m_script_on_real_users(tmp_path):
    """The first 16 real ML-1M users through the script: two steps, then full ranking of every item."""
    raw = tmp_path / "raw"
    raw.mkdir()
    with shared_ml1m().open() as f:
        head = [next(f) for _ in range(16)]
    (raw / "sequences.tsv").write_text("".join(head))
    out = tmp_path / "run"
    args = ["--data", str(raw), "--out", str(out), "--epochs", "1", "--max-steps", "2", "--batch-size", "4"]
    assert main([*args, "--workers", "0", "--device", "cpu"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["history"][0]["steps"] == 2
    final = results["final_test"]
    assert final["count"] == 16 and 0.0 <= final["ndcg10"] <= final["hr10"] <= final["hr200"] <= 1.0


def test_best_valid_picks_the_earliest_best_epoch():
    history = [
        {"epoch": 0, "loss": 1.0},
        {"epoch": 4, "valid": {"hr10": 0.2, "ndcg10": 0.10}, "test": {"hr10": 0.21}},
        {"epoch": 9, "valid": {"hr10": 0.3, "ndcg10": 0.12}, "test": {"hr10": 0.25}},
        {"epoch": 14, "valid": {"hr10": 0.3, "ndcg10": 0.11}, "test": {"hr10": 0.27}},
    ]
    best = best_valid(history)
    assert best["hr10"]["epoch"] == 9 and best["hr10"]["test"] == {"hr10": 0.25}
    assert best["ndcg10"]["epoch"] == 9
    assert best_valid([{"epoch": 0, "loss": 1.0}]) == {}


def test_ml1m_script_sasrec_with_used_negatives_and_event_time(tmp_path, monkeypatch):
    """The SASRec flavor and the A/B switches through the script; valid and test at every evaluation."""
    monkeypatch.setenv("GEM_KERNELS_FAST_SIGMOID", "0")
    raw = tmp_path / "raw"
    raw.mkdir()
    lines = [f"{user}\t" + " ".join(str(5 * i % 40 + 3) for i in range(user, user + 12)) for user in range(1, 25)]
    (raw / "sequences.tsv").write_text("\n".join(lines) + "\n")
    for flavor, overrides in (("sasrec", ["negative_pool=used"]), ("ml1m_hstu", ["query_time=event", "attention_norm=row"])):
        out = tmp_path / flavor
        args = ["--data", str(raw), "--out", str(out), "--flavor", flavor, "--epochs", "2", "--eval-every", "1"]
        assert main([*args, "--batch-size", "8", "--device", "cpu", *overrides]) == 0
        results = json.loads((out / "results.json").read_text())
        assert results["teacher"]["sequence_block"] == ("sasrec" if flavor == "sasrec" else "hstu")
        assert all({"valid", "test"} <= set(r) for r in results["history"])
        assert set(results["best_valid"]) == {"hr10", "ndcg10"}
        best = results["best_valid"]["ndcg10"]
        assert best["test"] == results["history"][best["epoch"]]["test"]
        assert results["final_test"]["count"] == 24
        assert results["environment"]["GEM_KERNELS_FAST_SIGMOID"] == "0"
    assert results["teacher"]["query_time"] == "event" and results["teacher"]["attention_norm"] == "row"
    assert json.loads((tmp_path / "sasrec" / "results.json").read_text())["targets"]["hr10"] == 0.2853
