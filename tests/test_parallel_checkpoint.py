"""Checkpoint directory bookkeeping: only complete, renamed-into-place checkpoints are ever resumed.

Saving and resharding on real processes is tested in ``test_parallel_training`` (resume cases).
"""

from __future__ import annotations

import pytest
import torch

from foundation.parallel.checkpoint import latest_checkpoint, load_checkpoint, step_dir


def complete(path):
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"x")
    return path


def test_latest_complete_checkpoint_wins_and_partial_writes_are_ignored(tmp_path):
    complete(step_dir(tmp_path, 3))
    complete(step_dir(tmp_path, 12))
    # A save killed before the rename leaves a hidden temporary directory ...
    complete(tmp_path / ".step_00000020.tmp")
    # ... and a directory without DCP's metadata (written last) is not a checkpoint either.
    step_dir(tmp_path, 30).mkdir()
    assert latest_checkpoint(tmp_path) == step_dir(tmp_path, 12)


def test_no_checkpoint_yet(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    assert latest_checkpoint(tmp_path / "missing") is None


def test_loading_an_incomplete_checkpoint_is_a_clear_error(tmp_path):
    step_dir(tmp_path, 5).mkdir()
    model = torch.nn.Linear(2, 2)
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        load_checkpoint(step_dir(tmp_path, 5), model, torch.optim.AdamW(model.parameters()))
