"""Bad checkpoints and a full disk (issue 19): a student where a teacher is needed, `gem export` into a
full filesystem, resuming another flavor's checkpoint, empty and malicious checkpoint files. Each case
checks the exit code, one line naming the file (<= 500 characters) and that nothing valid was lost."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning.pytorch  # noqa: F401  (imported here, its log handler binds to the real stderr, not a test's capture)
import mlflow
import pytest
import torch

from foundation.data.io import sha256_file
from gem.cli import main
from gem.config import ExperimentConfig, ModelConfig
from gem.module import RecModule
from tests.events import SCHEMA, write_dataset
from tests.test_hardening_data import error_line, gem_process, train_args
from transfer.store import LATEST_FILE, list_versions, open_store

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``(dataset, runs dir, last.ckpt)`` of the debug flavor (a DLRM teacher) trained for 2 steps."""
    root = tmp_path_factory.mktemp("models")
    dataset = write_dataset(root / "data", rows={"train": 256, "valid": 64, "test": 64}, row_group_size=64)
    assert main(train_args(dataset, root / "runs")) == 0
    return dataset, root / "runs", root / "runs" / "debug" / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="module")
def student_ckpt(tmp_path_factory) -> Path:
    """A student value model's checkpoint in the ``gem train`` format (untrained weights suffice)."""
    cfg = ExperimentConfig(name="student-debug", model=ModelConfig(arch="student"))
    module = RecModule(cfg.to_dict(), json.loads(SCHEMA.to_json()))
    path = tmp_path_factory.mktemp("student") / "student.ckpt"
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, path)
    return path


@pytest.mark.parametrize("command", ["export", "teacher-outputs"])
def test_a_student_checkpoint_is_refused_where_a_teacher_is_needed(command, trained, student_ckpt, tmp_path, capsys):
    dataset, _, _ = trained
    target = ["--store", str(tmp_path / "store")] if command == "export" else ["--out", str(tmp_path / "out")]
    assert main([command, "--ckpt", str(student_ckpt), "--data", str(dataset), *target]) == 2
    line = error_line(capsys.readouterr().err)
    assert f"{student_ckpt}: model.arch='student' is a value model, not a teacher" in line
    assert not (tmp_path / "store").exists() and not (tmp_path / "out").exists()


def export_args(trained, store: Path) -> list[str]:
    dataset, _, ckpt = trained
    return ["export", "--ckpt", str(ckpt), "--data", str(dataset), "--store", str(store), "--no-index"]


def store_files(store: Path) -> dict[str, bytes]:
    return {str(p.relative_to(store)): p.read_bytes() for p in sorted(store.rglob("*")) if p.is_file() and p.name != ".lock"}


def test_export_into_a_full_disk_injected_is_one_line_and_keeps_the_old_version(trained, tmp_path, capsys, monkeypatch):
    store = tmp_path / "store"
    assert main(export_args(trained, store)) == 0
    before = store_files(store)
    import transfer.export

    calls = {"n": 0}
    save = transfer.export._save_array

    def fill_up(directory, name, array):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        save(directory, name, array)

    monkeypatch.setattr(transfer.export, "_save_array", fill_up)
    assert main(export_args(trained, store)) == 2
    line = error_line(capsys.readouterr().err)
    assert f"{store}: could not write version v000002: No space left on device; LATEST still names v000001" in line
    assert store_files(store) == before and list_versions(store) == [1]
    assert open_store(store).version == 1


FULL_DISK_SCRIPT = textwrap.dedent(
    """
    set -u
    mount -t tmpfs -o size=4m tmpfs "$MNT"
    cp -a "$STORE" "$MNT/store"
    dd if=/dev/zero of="$MNT/filler" bs=4k 2>/dev/null
    "$PY" -m gem.cli "$@" --store "$MNT/store" 2>"$OUT/stderr"; echo $? > "$OUT/rc"
    "$PY" -c "import sys, json; from transfer.store import open_store, list_versions
    s = open_store(sys.argv[1]); print(json.dumps({'open': s.version, 'versions': list_versions(sys.argv[1])}))" \\
        "$MNT/store" > "$OUT/after.json"
    ls -A "$MNT/store" > "$OUT/listing"
    rm "$MNT/filler"
    "$PY" -m gem.cli "$@" --store "$MNT/store" > /dev/null 2>&1; echo $? > "$OUT/rc_with_space"
    cat "$MNT/store/LATEST" > "$OUT/latest_with_space"
    """
)


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare to mount a private tmpfs")
def test_export_into_a_real_full_tmpfs_is_one_line_and_keeps_the_old_version(trained, tmp_path):
    """`gem export` onto a 4 MiB tmpfs (mounted in a private user+mount namespace) filled to the last byte."""
    store = tmp_path / "store"
    assert main(export_args(trained, store)) == 0
    mnt, out = tmp_path / "mnt", tmp_path / "out"
    mnt.mkdir()
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MNT": str(mnt), "STORE": str(store),
           "OUT": str(out), "PY": sys.executable, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    dataset, _, ckpt = trained
    args = ["export", "--ckpt", str(ckpt), "--data", str(dataset), "--no-index"]
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"unshare -rm is not permitted here: {probe.stderr.decode().strip()}")
    subprocess.run(["unshare", "-rm", "sh", "-c", FULL_DISK_SCRIPT, "sh", *args], env=env, check=True, timeout=600)
    assert (out / "rc").read_text().strip() == "2"
    line = error_line((out / "stderr").read_text())
    assert f"{mnt}/store: could not write version v000002" in line and "No space left on device" in line
    assert "LATEST still names v000001" in line
    assert json.loads((out / "after.json").read_text()) == {"open": 1, "versions": [1]}
    assert sorted((out / "listing").read_text().split()) == sorted([".lock", LATEST_FILE, "v000001"])
    assert (out / "rc_with_space").read_text().strip() == "0"
    assert (out / "latest_with_space").read_text().strip() == "v000002"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["model.dlrm.embedding_dim=24"], "written by flavor 'debug' (model.arch='dlrm'), this run is flavor 'debug' (model.arch='dlrm'): model."),
        (["model.arch=student"], "this run is flavor 'debug' (model.arch='student'): model."),
    ],
    ids=["another model size", "another architecture"],
)
def test_resuming_another_models_checkpoint_is_one_line_and_keeps_it(overrides, expected, trained, tmp_path, capsys):
    dataset, runs, ckpt = trained
    sha = sha256_file(ckpt)
    # The run directory has the run's config on record: refused before anything is opened.
    assert main(train_args(dataset, runs, *overrides)) == 2
    line = error_line(capsys.readouterr().err)
    assert f"{runs / 'debug'} holds a run of another config (model." in line and "name=debug-2" in line
    assert sha256_file(ckpt) == sha
    # The same checkpoint with no config on record (a run directory from before gem kept one): the
    # checkpoint itself is checked against the model when the run resumes.
    bare = tmp_path / "runs"
    shutil.copytree(ckpt.parent, bare / "debug" / "checkpoints")
    copied = bare / "debug" / "checkpoints" / "last.ckpt"
    assert main(train_args(dataset, bare, *overrides)) == 2
    line = error_line(capsys.readouterr().err)
    assert f"{copied}: cannot resume this run: it was written by" in line and expected in line and "--no-resume" in line
    assert sha256_file(copied) == sha
    assert sorted(p.name for p in (bare / "debug").iterdir()) == [".lock", "checkpoints"], "nothing recorded for the refused run"
    client = mlflow.MlflowClient(f"sqlite:///{bare}/mlflow.db")
    assert client.search_runs([e.experiment_id for e in client.search_experiments()]) == [], "no run left behind"


def evil_pickle(path: Path, marker: Path) -> None:
    class RunsCode:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"state_dict": {}, "hyper_parameters": RunsCode()}, path)


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda p, m: p.write_bytes(b""), "empty file (0 bytes), not a checkpoint"),
        (evil_pickle, "refused: not a weights-only checkpoint (posix.system)"),
        (lambda p, m: p.write_bytes(b"PK\x03\x04" + os.urandom(2000)), "unreadable checkpoint (truncated or corrupt?)"),
    ],
    ids=["zero bytes", "code-running pickle", "garbage"],
)
def test_bad_checkpoint_files_are_one_line_and_never_run_code(make, expected, tmp_path):
    ckpt, marker = tmp_path / "bad.ckpt", tmp_path / "pwned"
    make(ckpt, marker)
    run = gem_process("eval", "--ckpt", str(ckpt), cwd=tmp_path)
    assert run.returncode == 2
    line = error_line(run.stderr)
    assert f"{ckpt}: {expected}" in line and "weights_only=False" not in line
    assert not marker.exists()
