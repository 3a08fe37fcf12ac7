"""The teacher-output service: write, read back, SIGKILL and resume, corruption and wrong-teacher errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import mlflow
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from foundation.data.io import sha256_file
from foundation.data.pipeline import DataConfig, EventStream, build_dataloader
from foundation.model.baseline import DLRMConfig
from gem.config import ExperimentConfig, ModelConfig, TrainConfig
from gem.module import load_module, load_trained
from gem.train import train
from tests.events import write_dataset
from transfer.teacher_outputs import (
    MANIFEST_FILE,
    OutputSchema,
    TeacherOutputsError,
    plan_shards,
    read_teacher_outputs,
    write_teacher_outputs,
)

REPO = Path(__file__).resolve().parents[1]
VALID_ROWS = 150


def tiny_teacher_config(dataset: Path, out: Path, *, name: str = "teacher", seed: int = 0) -> ExperimentConfig:
    return ExperimentConfig(
        name=name,
        data=DataConfig(path=str(dataset), max_len=8, batch_size=32),
        model=ModelConfig(dlrm=DLRMConfig(embedding_dim=8, bottom_mlp=(8,), top_mlp=(16, 8), repr_dim=6)),
        train=TrainConfig(
            max_steps=3,
            seed=seed,
            accelerator="cpu",
            out_dir=str(out),
            tracking_uri=f"sqlite:///{out}/mlflow.db",
            progress_bar=False,
        ),
    )


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """``(dataset_dir, checkpoint, train result)`` of a DLRM trained for 3 steps."""
    root = tmp_path_factory.mktemp("teacher")
    dataset = write_dataset(root / "data", rows={"train": 256, "valid": VALID_ROWS}, row_group_size=16)
    result = train(tiny_teacher_config(dataset, root / "runs"))
    return dataset, Path(result["checkpoint"]), result


def test_write_then_read_matches_the_model(teacher, tmp_path):
    dataset, ckpt, result = teacher
    uri = f"sqlite:///{ckpt.parents[2]}/mlflow.db"  # the teacher's store: already migrated, and lineage in one place
    report = write_teacher_outputs(
        load_trained(ckpt), dataset, "valid", tmp_path / "out", rows_per_shard=40, progress=False, tracking_uri=uri
    )
    assert report["rows"] == report["rows_computed"] == VALID_ROWS
    assert report["num_shards"] == report["shards_written"] == 4
    assert report["rows_per_s"] > 0

    manifest = json.loads((tmp_path / "out" / MANIFEST_FILE).read_text())
    assert manifest["teacher"]["mlflow_run_id"] == result["run_id"]
    assert manifest["teacher"]["checkpoint_sha256"] == result["checkpoint_sha256"]
    assert manifest["source"]["split"] == "valid" and manifest["source"]["rows"] == VALID_ROWS
    assert [s["rows"] for s in manifest["shards"]] == [40, 40, 40, 30]
    run = mlflow.MlflowClient(uri).get_run(report["run_id"])
    assert run.data.tags["gem.teacher_run_id"] == result["run_id"]
    assert run.data.tags["gem.checkpoint_sha256"] == result["checkpoint_sha256"]
    assert run.data.metrics["rows"] == VALID_ROWS and run.data.metrics["rows_per_s"] > 0

    # Shards hold the eval-order stream in order, each row once.
    stream = EventStream(dataset, "valid", DataConfig(path=str(dataset), max_len=8, batch_size=64), training=False)
    eval_order = torch.cat([b.example_id for b in build_dataloader(stream, stream.cfg)]).numpy()
    written = np.concatenate(
        [pq.read_table(tmp_path / "out" / s["file"]).column("example_id").to_numpy() for s in manifest["shards"]]
    )
    assert np.array_equal(written, eval_order)

    schema = OutputSchema(tasks=("click", "conversion"), user_repr_dim=6, item_repr_dim=6)
    outputs = read_teacher_outputs(tmp_path / "out", checkpoint=ckpt, expected_schema=schema)
    assert len(outputs) == VALID_ROWS

    # The stored soft labels are the model's own predictions on the eval-order stream.
    module = load_module(ckpt)
    with torch.inference_mode():
        for batch in build_dataloader(stream, stream.cfg):
            out = module.model(batch)
            got = outputs.take(batch.example_id[torch.randperm(batch.batch_size)].sort().values)
            order = batch.example_id.argsort()
            torch.testing.assert_close(got["click_logit"], out.logits["click"][order], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got["conversion_prob"], torch.sigmoid(out.logits["conversion"])[order])
            torch.testing.assert_close(got["user_repr"], out.user_repr[order], rtol=1e-5, atol=1e-5)
            assert torch.equal(got["item_id"], batch.candidate[order])
            assert torch.equal(got["domain"].long(), batch.domain[order])

    with pytest.raises(TeacherOutputsError, match=r"2 example ids have no teacher outputs \(e\.g\. \[10000, 10001\]\)"):
        outputs.take(np.array([256, 10_000, 10_001]))


def test_plan_covers_every_row_once(teacher):
    dataset, _, _ = teacher
    plans = plan_shards(dataset, "valid", 23)
    assert [p.start for p in plans] == list(range(0, VALID_ROWS, 23))
    assert sum(hi - lo for p in plans for *_, lo, hi in p.pieces) == VALID_ROWS
    with pytest.raises(ValueError, match="rows_per_shard"):
        plan_shards(dataset, "valid", 0)


_VICTIM = textwrap.dedent(
    """
    import sys, time
    import transfer.teacher_outputs as to
    from gem.module import load_trained
    write = to.write_table
    def slow_write(*args, **kwargs):
        time.sleep(0.3)  # slow enough that the test can kill it between shards or mid-write
        return write(*args, **kwargs)
    to.write_table = slow_write
    to.write_teacher_outputs(load_trained(sys.argv[1]), sys.argv[2], "valid", sys.argv[3], rows_per_shard=20, progress=False)
    """
)


def test_sigkill_mid_write_then_resume_matches_uninterrupted(teacher, tmp_path):
    dataset, ckpt, _ = teacher
    ref = write_teacher_outputs(load_trained(ckpt), dataset, "valid", tmp_path / "ref", rows_per_shard=20, progress=False)

    cut = tmp_path / "cut"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    victim = subprocess.Popen([sys.executable, "-c", _VICTIM, str(ckpt), str(dataset), str(cut)], env=env, cwd=REPO)
    deadline = time.time() + 120
    while time.time() < deadline and victim.poll() is None:
        manifest = cut / MANIFEST_FILE
        if manifest.is_file() and len(json.loads(manifest.read_text())["shards"]) >= 2:
            break
        time.sleep(0.01)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert victim.returncode == -signal.SIGKILL, "the writer finished before it could be killed"
    with pytest.raises(TeacherOutputsError, match="incomplete"):
        read_teacher_outputs(cut)

    resumed = write_teacher_outputs(load_trained(ckpt), dataset, "valid", cut, rows_per_shard=20, progress=False)
    assert resumed["shards_reused"] >= 2
    assert resumed["rows_computed"] == VALID_ROWS - 20 * resumed["shards_reused"]
    assert not list(cut.glob(".*.tmp"))

    a, b = read_teacher_outputs(tmp_path / "ref"), read_teacher_outputs(cut)
    assert a.table.equals(b.table)
    assert [s["sha256"] for s in a.manifest["shards"]] == [s["sha256"] for s in b.manifest["shards"]]
    assert len(np.unique(b.table.column("example_id").to_numpy())) == ref["rows"] == VALID_ROWS

    again = write_teacher_outputs(load_trained(ckpt), dataset, "valid", cut, rows_per_shard=20, progress=False)
    assert again["shards_reused"] == again["num_shards"] and again["rows_computed"] == 0


def test_corrupt_shard_is_detected_and_recomputed_on_resume(teacher, tmp_path):
    dataset, ckpt, _ = teacher
    out = tmp_path / "out"
    write_teacher_outputs(load_trained(ckpt), dataset, "valid", out, rows_per_shard=50, progress=False)
    shard = out / "part-00001.parquet"
    good = shard.read_bytes()
    shard.write_bytes(good[:-20] + bytes(20))
    with pytest.raises(TeacherOutputsError, match=r"part-00001\.parquet: checksum mismatch"):
        read_teacher_outputs(out)

    resumed = write_teacher_outputs(load_trained(ckpt), dataset, "valid", out, rows_per_shard=50, progress=False)
    assert resumed["shards_reused"] == 2 and resumed["rows_computed"] == 50
    assert shard.read_bytes() == good
    shard.unlink()
    with pytest.raises(TeacherOutputsError, match=r"part-00001\.parquet: shard listed in the manifest is missing"):
        read_teacher_outputs(out)


def test_wrong_teacher_or_schema_or_job_is_refused(teacher, tmp_path):
    dataset, ckpt, _ = teacher
    out = tmp_path / "out"
    write_teacher_outputs(load_trained(ckpt), dataset, "valid", out, rows_per_shard=100, progress=False)

    other = tmp_path / "other.ckpt"
    state = torch.load(ckpt, weights_only=True)
    next(iter(state["state_dict"].values())).add_(1.0)
    torch.save(state, other)
    with pytest.raises(TeacherOutputsError, match=r"written by teacher checkpoint sha256 .* not the requested"):
        read_teacher_outputs(out, checkpoint=other)
    read_teacher_outputs(out, checkpoint_sha256=sha256_file(ckpt))

    wrong = OutputSchema(tasks=("click",), user_repr_dim=6, item_repr_dim=32)
    with pytest.raises(TeacherOutputsError, match=r"tasks: outputs have \('click', 'conversion'\).*item_repr_dim: outputs have 6, expected 32"):
        read_teacher_outputs(out, expected_schema=wrong)

    # Resuming into the directory with another checkpoint or shard size must not mix two jobs' rows.
    with pytest.raises(TeacherOutputsError, match="checkpoint_sha256: existing"):
        write_teacher_outputs(load_trained(other), dataset, "valid", out, rows_per_shard=100, progress=False)
    with pytest.raises(TeacherOutputsError, match="rows_per_shard: existing 100, requested 30"):
        write_teacher_outputs(load_trained(ckpt), dataset, "valid", out, rows_per_shard=30, progress=False)
    assert pq.read_metadata(out / "part-00000.parquet").num_rows == 100


def test_a_teacher_trained_elsewhere_is_named_by_its_run_id(teacher, tmp_path):
    """A checkpoint copied from another machine has no ``mlflow_run_id`` beside it: the caller names the run."""
    dataset, ckpt, _ = teacher
    copied = tmp_path / "gpu" / "teacher.ckpt"
    copied.parent.mkdir()
    copied.write_bytes(ckpt.read_bytes())
    uri = f"sqlite:///{ckpt.parents[2]}/mlflow.db"
    kwargs = {"rows_per_shard": 64, "progress": False, "tracking_uri": uri}
    unnamed = write_teacher_outputs(load_trained(copied), dataset, "valid", tmp_path / "a", **kwargs)
    assert unnamed["manifest"]["teacher"]["mlflow_run_id"] is None
    named = write_teacher_outputs(load_trained(copied), dataset, "valid", tmp_path / "b", run_id="run-on-the-gpu", **kwargs)
    assert named["manifest"]["teacher"]["mlflow_run_id"] == "run-on-the-gpu"
    tags = mlflow.MlflowClient(uri).get_run(named["run_id"]).data.tags
    assert tags["gem.stage"] == "teacher_outputs" and tags["gem.teacher_run_id"] == "run-on-the-gpu"
