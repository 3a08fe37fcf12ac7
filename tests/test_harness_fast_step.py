"""The harness's teacher step switches on CPU (``train.cast_once``, ``train.bucket_rows``, ``train.cuda_graphs``,
:mod:`gem.step_options`): they train as the plain step does, a run with them resumes exactly, and each one
is honoured, turned off where it cannot work, or refused with a one-line error."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from experiments import bench_teacher, bench_teacher_harness
from foundation.checkpoint import load_checkpoint_file
from foundation.config import ConfigError, apply_overrides
from foundation.model.padding import PaddedBatch
from foundation.model.precision import MasterAdamW
from gem.cli import main
from gem.datamodule import EventDataModule
from gem.flavors import get_flavor
from gem.module import RecModule
from gem.step_options import step_options
from gem.train import build_trainer
from tests.events import write_dataset

pytestmark = pytest.mark.usefixtures("one_thread")
REPO = Path(__file__).resolve().parents[1]
# The debug teacher on small token-budgeted batches (~32 rows of up to 12 events, at most 256 tokens), without
# dropout: padded rows would draw other dropout masks (foundation/model/padding.py).
COMMON = [
    "data.batch_size=32", "data.token_budget=256", "model.teacher.dropout=0.0", "train.max_epochs=1",
    "train.progress_bar=false", "train.log_every_n_steps=1", "train.checkpoint_every_n_steps=3",
]
# Every batch fits a bucket: at most 32 rows and the 4 rows of 64 (max_len) events that pad 256 tokens.
BUCKETED = ["train.bucket_rows=(24,36)", "train.cuda_graphs=true"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("events"), rows={"train": 480, "valid": 96, "test": 96}, row_group_size=96)


class StepTrace(L.Callback):
    """Per training step: the loss (float32 on the host) and whether the batch came padded."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.padded: list[bool] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(pl_module.step_losses["loss"]))
        self.padded.append(isinstance(batch, PaddedBatch))


def fit(dataset, tmp_path, overrides: list[str], callbacks: tuple[L.Callback, ...] = ()) -> tuple[StepTrace, RecModule]:
    """The harness's Trainer (gem.train.build_trainer, no MLflow) on the debug teacher with ``overrides``, and
    ``callbacks`` beside its :class:`StepTrace`."""
    cfg = get_flavor("teacher-debug")
    apply_overrides(cfg, [f"data.path={dataset}", f"train.out_dir={tmp_path}", *COMMON, *overrides])
    L.seed_everything(cfg.train.seed, workers=True, verbose=False)
    datamodule = EventDataModule(cfg.data)
    module = RecModule(cfg.to_dict(), json.loads(datamodule.schema.to_json()))
    trainer = build_trainer(cfg, None, None)
    trace = StepTrace()
    trainer.callbacks.extend([trace, *callbacks])
    trainer.fit(module, datamodule=datamodule)
    return trace, module


def test_bucketed_batches_train_through_the_static_step_as_the_plain_step(dataset, tmp_path, caplog):
    """Padded in two DataLoader workers, every batch goes through gem.loop.StaticStep (on CPU the graphs are off,
    said once), each bucket prepared after the first step; float32 losses and parameters match the plain step's."""
    steps = ["train.max_steps=6", "data.num_workers=2"]
    plain, plain_module = fit(dataset, tmp_path / "plain", steps)
    with caplog.at_level(logging.WARNING, logger="gem.module"):
        bucketed, module = fit(dataset, tmp_path / "bucketed", [*steps, *BUCKETED])
    assert plain_module.static_step is None and not any(plain.padded)
    assert bucketed.padded == [True] * 6
    # Both buckets were prepared after the first step (their warm-up steps count: 2 each, one the first batch's).
    assert module.prepared_buckets == [24, 36]
    assert sum(slot.steps for slot in module.static_step.slots.values()) == 6 + 2 * 2 - 1
    assert {tuple(s.batch.offsets.shape) for s in module.static_step.slots.values()} == {(25,), (37,)}
    lines = [r.getMessage() for r in caplog.records if r.name == "gem.module"]
    assert lines == ["cuda graphs off: the model is on cpu; eager steps"]
    torch.testing.assert_close(torch.tensor(bucketed.losses), torch.tensor(plain.losses), rtol=0, atol=1e-5)
    assert bucketed.losses[-1] < bucketed.losses[0]
    # Padded and plain batches sum in other orders; Adam turns those roundings into whole steps where a gradient is
    # near zero (the domain experts' weights differ by up to 1.4e-5 over seeds 0-3).
    for name, value in module.model.state_dict().items():
        torch.testing.assert_close(value, plain_module.model.state_dict()[name], rtol=1e-4, atol=5e-5, msg=name)


class RowsBehind(L.Callback):
    """Per training step: how many item-table rows the deferred optimizer left behind the step count."""

    def __init__(self) -> None:
        self.counts: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        rows = pl_module.optimizers().optimizer.deferred[pl_module.model.items.collection.embeddings["t_item"].weight]
        self.counts.append(int((rows.last < rows.now).sum()))


def test_sparse_tables_train_clipped_through_the_static_step(dataset, tmp_path):
    """``model.teacher.sparse_tables``: the tables' gradients are sparse, clipped with the rest (the harness clips at
    ``train.grad_clip`` = 1), MasterAdamW steps them (whatever ``train.cast_once`` says) with AdamW's result: the
    losses, the trained tables and the checkpoint's are the dense tables' within the optimizers' rounding (the
    rows no step of the last ones named caught up when the checkpoint was taken). A parallel run steps them with
    the rest (said in one line; ``parallelize_teacher`` gives them dense gradients: tests/test_parallel_dims.py)."""
    behind = RowsBehind()
    trace, module = fit(dataset, tmp_path / "sparse", ["train.max_steps=8", "model.teacher.sparse_tables=true", *BUCKETED],
                        callbacks=(behind,))
    dense, dense_module = fit(dataset, tmp_path / "dense", ["train.max_steps=8", *BUCKETED])
    optimizer = module.optimizers().optimizer
    assert module.cfg.train.grad_clip > 0 and isinstance(optimizer, MasterAdamW)
    table = module.model.items.collection.embeddings["t_item"].weight
    assert table.grad.is_sparse and trace.padded == [True] * 8 and table in optimizer.deferred
    assert max(behind.counts) > 0  # item rows a step left for a later lookup to catch up
    assert trace.losses[-1] < trace.losses[0]
    torch.testing.assert_close(torch.tensor(trace.losses), torch.tensor(dense.losses), rtol=0, atol=1e-5)
    checkpoints = [load_checkpoint_file(tmp_path / run / "teacher-debug" / "checkpoints" / "last.ckpt")["state_dict"]
                   for run in ("sparse", "dense")]
    for name, value in dense_module.model.state_dict().items():
        torch.testing.assert_close(module.model.state_dict()[name], value, rtol=1e-4, atol=5e-5, msg=name)
        key = f"model.{name}"
        torch.testing.assert_close(checkpoints[0][key], checkpoints[1][key], rtol=1e-4, atol=5e-5, msg=key)
    cfg = get_flavor("teacher-debug")
    apply_overrides(cfg, ["model.teacher.sparse_tables=true", "parallel.enabled=true"])
    parallel, notes = step_options(cfg, has_lookups=True)
    assert not parallel.sparse_tables and notes[0].startswith("model.teacher.sparse_tables off: parallel.enabled")


def test_cast_once_under_bf16_trains_as_autocast(dataset, tmp_path):
    """bf16-mixed on CPU: the parameters cast once per step give autocast's losses, to the last bit where the
    optimizers agree. With cast once the optimizer is MasterAdamW, which keeps the copies (written in its update,
    not refreshed by the forward); torch's fused CPU AdamW, without, rounds its update otherwise from the second
    step on, so later losses agree within that rounding."""
    steps = ["train.max_steps=4", "train.precision=bf16-mixed"]
    autocast, autocast_module = fit(dataset, tmp_path / "autocast", [*steps, "train.cast_once=false"])
    once, module = fit(dataset, tmp_path / "once", steps)
    assert autocast_module.cast_once is None and type(autocast_module.optimizers().optimizer) is torch.optim.AdamW
    assert "blocks.0.uvqk.weight" in module.cast_once.names and module.cast_once.copies[0].dtype == torch.bfloat16
    assert isinstance(module.optimizers().optimizer, MasterAdamW) and module.cast_once.kept_by_optimizer
    copies_fresh = [torch.equal(c, p.detach().to(c.dtype)) for p, c in zip(module.cast_once.params, module.cast_once.copies, strict=True)]
    assert all(copies_fresh)
    assert once.losses[:2] == autocast.losses[:2]
    torch.testing.assert_close(torch.tensor(once.losses), torch.tensor(autocast.losses), rtol=1e-3, atol=0)


def test_bucketed_bf16_steps_stay_with_the_plain_bf16_steps(dataset, tmp_path):
    """Under bf16 autocast the static step (its own autocast, no cache) follows the plain step within bf16
    rounding of the padded shapes."""
    steps = ["train.max_steps=4", "train.precision=bf16-mixed"]
    plain, _ = fit(dataset, tmp_path / "plain", steps)
    bucketed, module = fit(dataset, tmp_path / "bucketed", [*steps, *BUCKETED])
    assert bucketed.padded == [True] * 4 and module.static_step.autocast_dtype == torch.bfloat16
    torch.testing.assert_close(torch.tensor(bucketed.losses), torch.tensor(plain.losses), rtol=2e-2, atol=0)


class KillAtStep(L.Callback):
    """SIGKILLs the process when training step ``step`` starts."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def killed_main() -> None:
    """``gem train`` that SIGKILLs itself when step ``$KILL_AT`` starts (this module as a script)."""
    import gem.train as train_module

    build_trainer = train_module.build_trainer

    def build_killed_trainer(cfg, *args):
        trainer = build_trainer(cfg, *args)
        trainer.callbacks.append(KillAtStep(int(os.environ["KILL_AT"])))
        return trainer

    train_module.build_trainer = build_killed_trainer
    sys.exit(main(sys.argv[1:]))


@pytest.mark.parametrize("switches", [BUCKETED, ["train.warmup_steps=4", "train.final_lr_frac=0.1"]],
                         ids=["bucketed", "cast_once_scheduled"])
def test_a_run_killed_with_the_switches_on_resumes_exactly(dataset, tmp_path, switches):
    """bf16 ``gem train`` SIGKILLed at step 5 (its checkpoint is step 3's) and run again ends where an uninterrupted
    run does, bit for bit (under a learning-rate schedule too: the resumed run goes on at its step's rate)."""

    def train(out, kill_at: int = -1) -> int:
        args = [
            "train", "--flavor", "teacher-debug", f"data.path={dataset}", f"train.out_dir={out}",
            f"train.tracking_uri=sqlite:///{out}/mlflow.db", "train.precision=bf16-mixed", "train.max_steps=8",
            "data.num_workers=2", *COMMON, *switches,
        ]
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "KILL_AT": str(kill_at)}
        proc = subprocess.run(
            [sys.executable, "-m", "tests.test_harness_fast_step", *args], cwd=tmp_path, env=env, capture_output=True,
            text=True, timeout=600,
        )
        assert proc.returncode in (0, -signal.SIGKILL), proc.stderr[-4000:]
        return proc.returncode

    assert train(tmp_path / "ref") == 0
    assert train(tmp_path / "cut", kill_at=5) == -signal.SIGKILL
    last = tmp_path / "cut" / "teacher-debug" / "checkpoints" / "last.ckpt"
    assert load_checkpoint_file(last)["global_step"] == 3
    assert train(tmp_path / "cut") == 0
    ref, cut = (load_checkpoint_file(tmp_path / run / "teacher-debug" / "checkpoints" / "last.ckpt") for run in ("ref", "cut"))
    assert ref["global_step"] == cut["global_step"] == 8
    for name, tensor in ref["state_dict"].items():
        assert torch.equal(tensor, cut["state_dict"][name]), name


def test_the_harness_bench_trains_as_bench_teacher_on_its_world(tmp_path):
    """experiments.bench_teacher_harness (the harness, bucketed) and experiments.bench_teacher (its own loop,
    bucketed) on the same generated world: the same batches and, in float32 without dropout, the same losses."""
    world = ["--data", str(tmp_path / "world"), "--examples", "2000", "--items", "500"]
    bench, harness = tmp_path / "bench.json", tmp_path / "harness.json"
    assert bench_teacher.main([
        "--flavor", "debug", *world, "--steps", "3", "--rows", "64", "--token-budget", "1024", "--max-history", "64",
        "--workers", "0", "--device", "cpu", "--precision", "fp32", "--bucketed", "40,64", "dropout=0.0", "--json", str(bench),
    ]) == 0
    assert bench_teacher_harness.main([
        "--flavor", "teacher-debug", *world, "--steps", "3", "--warmup", "1", "data.batch_size=64", "data.token_budget=1024",
        "data.num_workers=0", "train.bucket_rows=(40,64)", "--compare-losses", str(bench), "train.lr=1e-4",
        "train.grad_clip=0.0", "model.teacher.dropout=0.0", "--json", str(harness),
    ]) == 0
    result = json.loads(harness.read_text())
    assert result["step"]["padded_steps"] == 3 and result["step"]["buckets_used"] >= 1 and result["steps_run"] == 3
    comparison = result["loss_comparison"]
    assert comparison["same_batches"] and comparison["steps"] == 3 and comparison["max_abs_diff"] < 1e-5


def options(flavor: str, *overrides: str):
    cfg = apply_overrides(get_flavor(flavor), list(overrides))
    return step_options(cfg, has_lookups=cfg.model.arch == "teacher")


def test_the_large_teacher_takes_every_switch_and_parallel_runs_turn_them_off():
    large, notes = options("teacher-large")
    assert large.cast_once and large.autocast_dtype == torch.bfloat16 and large.graphs.cuda_graphs and not notes
    assert large.shapes.rows == (64, 128, 256, 512) and large.shapes.tokens == 16384 and large.shapes.max_len == 4096
    parallel, notes = options("teacher-large", "parallel.enabled=true")
    assert large.sparse_tables and not parallel.sparse_tables
    assert not parallel.cast_once and parallel.shapes is None and not parallel.graphs.cuda_graphs
    assert notes == ["model.teacher.sparse_tables off: parallel.enabled shards the tables (one device only); they get dense gradients",
                     "train.cast_once, train.bucket_rows, train.cuda_graphs off: parallel.enabled (single-device switches); the plain step runs"]
    scaled, notes = options("teacher-large", "train.precision=16-mixed")
    assert scaled.shapes is None and not scaled.cast_once and notes[0].startswith("train.bucket_rows off: train.precision=16-mixed")
    plain, notes = options("teacher-debug")
    assert not plain.cast_once and plain.shapes is None and not plain.graphs.cuda_graphs and not notes


@pytest.mark.parametrize(
    ("flavor", "overrides", "expected"),
    [
        ("teacher-debug", ["train.cuda_graphs=true"], "train.cuda_graphs replays static shapes: set train.bucket_rows"),
        ("debug", ["train.bucket_rows=(64,)"], "train.bucket_rows: model.arch='dlrm' has no static-shape step"),
        ("teacher-debug", ["train.bucket_rows=(64,)", "data.token_budget=0"], "pads batches to data.token_budget"),
        ("teacher-debug", ["train.bucket_rows=(64,32)"], "train.bucket_rows=(64, 32): static shapes: rows must be ascending"),
    ],
)
def test_switches_that_cannot_apply_are_refused_in_one_line(dataset, tmp_path, flavor, overrides, expected, capsys):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        options(flavor, *overrides)
    args = ["train", "--flavor", flavor, f"data.path={dataset}", f"train.out_dir={tmp_path}", *overrides]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err
    assert not (tmp_path / flavor).exists()


if __name__ == "__main__":
    killed_main()
