"""Next-item training through the harness: a converted sequence dataset, the teacher, full ranking."""

from __future__ import annotations

import numpy as np
import pytest

from foundation.config import apply_overrides
from foundation.data.converters import convert
from gem.evaluate import evaluate
from gem.flavors import get_flavor
from gem.train import train


@pytest.fixture(scope="module")
def sequences(tmp_path_factory):
    """Users walk a ring of 60 items in steps of 1-2, so the next item is predictable from the last."""
    root = tmp_path_factory.mktemp("seq")
    rng = np.random.default_rng(0)
    lines = []
    for user in range(300):
        item = int(rng.integers(1, 61))
        walk = []
        for _ in range(int(rng.integers(8, 20))):
            walk.append(item)
            item = (item + int(rng.integers(1, 3)) - 1) % 60 + 1
        lines.append(f"{user}\t{' '.join(map(str, walk))}")
    src = root / "seq.tsv"
    src.write_text("\n".join(lines) + "\n")
    convert("seq-tsv", src, root / "data")
    return root / "data"


def test_teacher_learns_next_item_and_reports_full_ranking(sequences, tmp_path):
    cfg = apply_overrides(
        get_flavor("ml1m_hstu"),
        [
            f"data.path={sequences}",
            "data.max_len=32",
            "model.teacher.max_len=32",
            "model.teacher.num_negatives=16",
            "train.max_epochs=6",
            "train.lr=3e-3",
            f"train.out_dir={tmp_path}",
            f"train.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
            "train.progress_bar=false",
            "train.log_every_n_steps=2",
        ],
    )
    result = train(cfg, resume=False)
    assert "val/hr10" in result["metrics"] and "perf/tokens_per_s" in result["metrics"]
    metrics = evaluate(result["checkpoint"], "test")["metrics"]
    # 60 items with the history removed: a random ranker hits the top 10 about 10/50 of the time.
    assert metrics["hr10"] > 0.5
    assert 0 < metrics["ndcg10"] <= metrics["hr10"]
