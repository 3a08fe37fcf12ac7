"""The embedding store: export equals the model, incremental equals full, atomic publish under SIGKILL."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import mlflow
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from foundation.data.io import list_shards, shard_path, write_table
from foundation.data.pipeline import DataConfig, build_batch, table_to_block
from foundation.data.schema import EventSchema
from foundation.model.baseline import DLRMConfig
from gem.config import ExperimentConfig, ModelConfig, TrainConfig
from gem.module import load_module, load_trained
from gem.train import train
from tests.events import make_events, write_dataset
from transfer.export import export_embeddings
from transfer.store import LATEST_FILE, StoreError, latest_version, list_versions, open_store

REPO = Path(__file__).resolve().parents[1]
SPLITS = ("train", "valid")
CHANGED_USERS = np.array([3, 7, 11, 19])


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """``(dataset_dir, checkpoint, tracking_uri)`` of a DLRM trained for 2 steps."""
    root = tmp_path_factory.mktemp("export")
    dataset = write_dataset(root / "data", rows={"train": 320, "valid": 80}, row_group_size=16)
    uri = f"sqlite:///{root}/mlflow.db"
    cfg = ExperimentConfig(
        name="teacher",
        data=DataConfig(path=str(dataset), max_len=8, batch_size=32),
        model=ModelConfig(dlrm=DLRMConfig(embedding_dim=8, bottom_mlp=(8,), top_mlp=(16, 8), repr_dim=6)),
        train=TrainConfig(max_steps=2, accelerator="cpu", out_dir=str(root / "runs"), tracking_uri=uri, progress_bar=False),
    )
    return dataset, Path(train(cfg)["checkpoint"]), uri


def extended_dataset(dataset: Path, out: Path) -> Path:
    """A copy of ``dataset`` where ``CHANGED_USERS`` each get one newer row (a longer, later history)."""
    shutil.copytree(dataset, out)
    extra = make_events(len(CHANGED_USERS), seed=99, start_id=1_000_000)
    for name, values in (("user_id", CHANGED_USERS), ("timestamp", np.full(len(CHANGED_USERS), 5_000))):
        i = extra.schema.get_field_index(name)
        extra = extra.set_column(i, extra.schema.field(i), pa.array(values, pa.int64()))
    write_table(extra, shard_path(out, "train", 7))
    return out


def direct_user_vectors(ckpt: Path, dataset: Path) -> tuple[np.ndarray, np.ndarray]:
    """An independent oracle: pandas picks each user's latest row, the model embeds them in one batch."""
    table = pa.concat_tables(pq.read_table(p) for s in SPLITS for p in list_shards(dataset, s))
    frame = table.select(["user_id", "timestamp", "example_id"]).to_pandas().reset_index()
    rows = frame.sort_values(["timestamp", "example_id"]).groupby("user_id").tail(1).sort_values("user_id")
    module = load_module(ckpt)
    block = table_to_block(table.take(pa.array(rows["index"].to_numpy())), EventSchema.load(dataset))
    batch = build_batch([(block, np.arange(block.num_rows))], module.schema, module.cfg.data.max_len, None)
    with torch.inference_mode():
        return rows["user_id"].to_numpy(), module.model(batch).user_repr.numpy()


def test_full_export_lookups_equal_direct_model_outputs(teacher, tmp_path):
    dataset, ckpt, uri = teacher
    report = export_embeddings(load_trained(ckpt), dataset, tmp_path / "store", splits=SPLITS, tracking_uri=uri, device="cpu")
    store = open_store(tmp_path / "store")
    assert store.version == report["version"] == 1 and report["users_copied"] == 0

    ids, want = direct_user_vectors(ckpt, dataset)
    got, found = store.lookup_users(np.append(ids, 10_000))
    assert found[:-1].all() and not found[-1] and not got[-1].any()
    np.testing.assert_allclose(got[:-1], want, rtol=1e-5, atol=1e-6)

    items, found = store.lookup_items(store.arrays["item_ids"])
    assert found.all() and items.shape == (report["items"], 6)
    assert isinstance(store.arrays["users"], np.memmap)
    manifest = store.manifest
    assert manifest["teacher"]["mlflow_run_id"] == (ckpt.parents[1] / "mlflow_run_id").read_text().strip()
    assert manifest["dims"] == {"user": 6, "item": 6} and "items.faiss" in manifest["files"]
    ids_found, _ = store.index().search(items[:3], 1)
    np.testing.assert_array_equal(ids_found[:, 0], store.arrays["item_ids"][:3])

    mlflow.set_tracking_uri(uri)
    run = mlflow.get_run(report["run_id"])
    assert run.data.tags["gem.export_version"] == "1" and run.data.metrics["users"] == report["users"]


def test_incremental_refresh_equals_full_and_recomputes_only_changed_users(teacher, tmp_path):
    dataset, ckpt, _ = teacher
    grown = extended_dataset(dataset, tmp_path / "grown")
    store = tmp_path / "store"
    export_embeddings(load_trained(ckpt), dataset, store, splits=SPLITS, device="cpu")
    inc = export_embeddings(load_trained(ckpt), grown, store, splits=SPLITS, since=1, device="cpu")
    full = export_embeddings(load_trained(ckpt), grown, store, splits=SPLITS, device="cpu")
    assert inc["mode"] == "incremental" and inc["parent"] == 1
    assert inc["users_recomputed"] == len(CHANGED_USERS) and inc["users_copied"] == inc["users"] - len(CHANGED_USERS)

    a, b = open_store(store, inc["version"]), open_store(store, full["version"])
    features = [n for n in a.arrays if n.startswith(("user_feat_", "item_feat_", "user_history_", "user_dense"))]
    assert len(features) == 2 * 2 + 2 + 1 and a.manifest["features"] == b.manifest["features"]
    for name in ("user_ids", "item_ids", "user_timestamps", "user_fingerprints", *features):
        np.testing.assert_array_equal(a.arrays[name], b.arrays[name])
    np.testing.assert_allclose(a.arrays["users"], b.arrays["users"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(a.arrays["items"], b.arrays["items"], rtol=1e-5, atol=1e-6)
    fresh = np.isin(a.arrays["user_ids"], CHANGED_USERS)
    assert (a.arrays["user_updated_version"][fresh] == 2).all() and (a.arrays["user_updated_version"][~fresh] == 1).all()
    assert (a.arrays["user_timestamps"][fresh] == 5_000).all()

    unchanged = export_embeddings(load_trained(ckpt), grown, store, splits=SPLITS, since=full["version"], device="cpu")
    assert unchanged["users_recomputed"] == 0 and unchanged["items_recomputed"] == 0


def test_reader_keeps_its_version_while_newer_ones_publish_and_retention(teacher, tmp_path):
    dataset, ckpt, _ = teacher
    store = tmp_path / "store"
    export_embeddings(load_trained(ckpt), dataset, store, splits=SPLITS, device="cpu", build_retrieval_index=False)
    reader = open_store(store)
    before = reader.lookup_users(reader.arrays["user_ids"])[0].copy()

    grown = extended_dataset(dataset, tmp_path / "grown")
    for _ in range(3):
        export_embeddings(load_trained(ckpt), grown, store, splits=SPLITS, retention=2, device="cpu", build_retrieval_index=False)
    assert list_versions(store) == [3, 4] and latest_version(store) == 4
    # Version 1 is gone from the directory, yet its reader still sees all of it, unchanged.
    np.testing.assert_array_equal(reader.lookup_users(reader.arrays["user_ids"])[0], before)
    assert not np.allclose(open_store(store).lookup_users(CHANGED_USERS)[0], reader.lookup_users(CHANGED_USERS)[0])
    with pytest.raises(StoreError, match="version 1 not found"):
        open_store(store, 1)


def test_corrupted_or_truncated_file_is_refused_by_name(teacher, tmp_path):
    dataset, ckpt, _ = teacher
    store = tmp_path / "store"
    export_embeddings(load_trained(ckpt), dataset, store, splits=SPLITS, device="cpu")
    users = store / "v000001" / "users.npy"
    data = bytearray(users.read_bytes())
    data[-3] ^= 0xFF
    users.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=r"users\.npy: checksum mismatch"):
        open_store(store)
    faiss_file = store / "v000001" / "items.faiss"
    faiss_file.write_bytes(faiss_file.read_bytes()[:100])
    with pytest.raises(StoreError, match=r"items\.faiss: .* bytes, manifest says"):
        open_store(store, verify=False)


KILL_SCRIPT = textwrap.dedent(
    """
    import sys
    from gem.module import load_trained
    from transfer.export import export_embeddings
    ckpt, dataset, store = sys.argv[1:4]
    teacher = load_trained(ckpt)
    while True:
        export_embeddings(teacher, dataset, store, splits=("train", "valid"), retention=2, device="cpu")
        print("published", flush=True)
    """
)


def wait_for_temp_dir(store: Path, timeout: float) -> bool:
    """Poll until an exporter's hidden temp dir appears (True) or ``timeout`` passes (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.name.startswith(".tmp-") for p in store.iterdir()):
            return True
    return False


def test_sigkill_mid_export_never_leaves_a_visible_partial_version(teacher, tmp_path):
    dataset, ckpt, _ = teacher
    store = tmp_path / "store"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    mid_write = 0
    for attempt, delay in enumerate((0.0, 0.003, 0.02)):
        proc = subprocess.Popen(
            [sys.executable, "-c", KILL_SCRIPT, str(ckpt), str(dataset), str(store)], env=env, stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout.readline().strip() == "published", "the exporter died before its first publish"
        # Kill while a version is being written: once its hidden temp dir exists, after ``delay``.
        mid_write += wait_for_temp_dir(store, timeout=10.0)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL, attempt
        for v in list_versions(store):
            open_store(store, v)  # every visible version is whole and verifies
        assert open_store(store).version == latest_version(store)
        assert (store / LATEST_FILE).read_text().strip() == f"v{latest_version(store):06d}"
    assert mid_write >= 2, "the kills did not land while a version was being written"
    # The next export cleans up whatever hidden temp dir the last kill left.
    export_embeddings(load_trained(ckpt), dataset, store, splits=SPLITS, device="cpu", build_retrieval_index=False)
    assert not [p for p in store.iterdir() if p.name.startswith((".tmp-", ".trash-", ".LATEST."))]
    assert json.loads((store / f"v{latest_version(store):06d}" / "manifest.json").read_text())["mode"] == "full"
