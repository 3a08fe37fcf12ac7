"""The ML-1M reproduction script end to end on a tiny sequence file: convert, train, rank, write results."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from experiments.ml1m_hstu import main


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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
    assert final["count"] == 40 and 0.0 <= final["ndcg@10"] <= final["hr@10"] <= 1.0
    assert results["history"][0]["tokens_per_s"] > 0 and "mfu" not in results["history"][0]
    assert results["targets"] == {"hr@10": 0.3097, "ndcg@10": 0.1720}
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
    assert final["count"] == 16 and 0.0 <= final["ndcg@10"] <= final["hr@10"] <= final["hr@200"] <= 1.0
