"""The harness keeps the host off the step: a small split cached in the trainer's process, fused AdamW, no tensor
read between logs, validation every n epochs and after the last, and exact resume with all of them."""

from __future__ import annotations

import json
from collections import Counter

import lightning as L
import mlflow
import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import foundation.data.pipeline as pipeline
from experiments import bench_ml1m_harness
from foundation.checkpoint import load_checkpoint_file
from foundation.config import ConfigError, apply_overrides
from foundation.data.converters import convert
from foundation.data.pipeline import DataConfig, EventStream, RowBlock, caches_split, decoded_bytes
from gem.datamodule import EventDataModule
from gem.flavors import get_flavor
from gem.loop import train_step
from gem.module import RecModule, fuses_adamw
from gem.tracking import MetricRecorder, ensure_experiment
from gem.train import build_trainer, train
from tests.events import write_dataset

# Operators that read a tensor's value on the host: on a GPU each waits for the device (torch's sync debug
# mode flags the same ones).
READS = {"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten._unique2", "aten.equal"}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_dataset(
        tmp_path_factory.mktemp("events"), rows={"train": 640, "valid": 96, "test": 64}, row_group_size=64
    )


def _cfg(dataset, out, *overrides: str):
    return apply_overrides(
        get_flavor("debug"),
        [
            f"data.path={dataset}",
            "data.batch_size=32",
            f"train.out_dir={out}",
            f"train.tracking_uri=sqlite:///{out}/mlflow.db",
            "train.progress_bar=false",
            "train.checkpoint_every_n_steps=1000",
            *overrides,
        ],
    )


def _module(cfg) -> RecModule:
    return RecModule(cfg.to_dict(), json.loads(EventDataModule(cfg.data).schema.to_json()))


def _block_bytes(block: RowBlock) -> int:
    arrays = [*block.scalars.values(), *(a for pair in block.jagged.values() for a in pair), block.dense]
    arrays += [*block.labels.values(), *block.label_mask.values(), *block.oracle.values()]
    return sum(a.nbytes for a in arrays)


def test_decoded_size_bounds_the_cache_and_decides_what_is_cached(dataset):
    stream = EventStream(dataset, "train", DataConfig(path=str(dataset)), training=True, cache_blocks=True)
    held = sum(_block_bytes(stream.load_block(shard, rg)) for shard, rg in stream.units)
    estimate = decoded_bytes(dataset, "train")
    assert held <= estimate <= 2 * held

    def caches(**kw) -> bool:
        return caches_split(dataset, "train", DataConfig(path=str(dataset), **kw))

    assert caches(cache_bytes=estimate)
    assert not caches(cache_bytes=estimate - 1)
    assert not caches(cache_bytes=0)
    assert not caches(cache_bytes=estimate, num_workers=2), "a worker's cache would not outlive its epoch"
    with pytest.raises(ValueError, match=r"data\.cache_bytes=-1"):
        DataConfig(path=str(dataset), cache_bytes=-1)


def test_data_module_reads_a_small_split_once_and_batches_as_it_would_uncached(dataset, monkeypatch):
    reads = []
    real = pipeline.iter_valid_row_groups

    def counting(shard, *args, row_groups, **kwargs):
        reads.append(f"{shard.parent.name}/{row_groups}")
        return real(shard, *args, row_groups=row_groups, **kwargs)

    monkeypatch.setattr(pipeline, "iter_valid_row_groups", counting)
    cached = EventDataModule(DataConfig(path=str(dataset), max_len=8, batch_size=32))
    uncached = EventDataModule(DataConfig(path=str(dataset), max_len=8, batch_size=32, cache_bytes=0))
    loaders = {}
    for name, module in (("cached", cached), ("uncached", uncached)):
        loaders[name] = (module.train_dataloader(), module.val_dataloader())
    per_epoch = Counter()
    for epoch in range(3):
        batches = {}
        for name, module in (("cached", cached), ("uncached", uncached)):
            module.start_epoch(epoch)
            before = len(reads)
            train_loader, val_loader = loaders[name]
            batches[name] = [*train_loader, *val_loader]
            per_epoch[name, epoch] = len(reads) - before
        got, expected = batches["cached"], batches["uncached"]
        assert [b.example_id.tolist() for b in got] == [b.example_id.tolist() for b in expected]
        assert all(torch.equal(g.history["item_ids"], e.history["item_ids"]) for g, e in zip(got, expected, strict=True))
        assert [b.position for b in got] == [b.position for b in expected]
    row_groups = per_epoch["uncached", 0]
    assert row_groups == 12  # 10 train + 2 valid row groups
    assert [per_epoch["uncached", e] for e in range(3)] == [row_groups] * 3
    assert [per_epoch["cached", e] for e in range(3)] == [row_groups, 0, 0]


def test_the_harness_optimizer_is_fused_where_torch_has_the_kernel(dataset, tmp_path):
    optimizer = _module(_cfg(dataset, tmp_path)).configure_optimizers()
    assert optimizer.defaults["fused"] is True
    # The distributed checkpoint keeps the unfused optimizer's state layout.
    assert _module(_cfg(dataset, tmp_path, "parallel.enabled=true")).configure_optimizers().defaults["fused"] is False
    assert not fuses_adamw([torch.nn.Parameter(torch.zeros(2, device="meta"))])
    assert not fuses_adamw([torch.nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)])
    assert not fuses_adamw([])


class ReadCounter(TorchDispatchMode):
    """Counts the :data:`READS` operators dispatched while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.reads += str(func.overloadpacket) in READS
        return func(*args, **(kwargs or {}))


class ReadsPerStep(L.Callback):
    """Reads from each batch's start to the end of the last callback's ``on_train_batch_end`` (append it
    last): the step, the harness's logging and checkpoints, the progress bar; by global step."""

    def __init__(self) -> None:
        self.by_step: dict[int, int] = {}
        self.bar_refreshes: set[int] = set()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.counter = ReadCounter()
        self.counter.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.counter.__exit__(None, None, None)
        self.by_step[trainer.global_step] = self.counter.reads
        bar = trainer.progress_bar_callback
        if bar is not None and bar._should_update(batch_idx + 1, bar.train_progress_bar.total):
            self.bar_refreshes.add(trainer.global_step)


def test_no_step_reads_a_tensor_between_logs_and_refreshes(dataset, tmp_path):
    cfg = _cfg(dataset, tmp_path, "train.max_epochs=1", "train.log_every_n_steps=4", "train.progress_bar=true")
    module = _module(cfg)
    # The model's own step, outside the harness: what a bare gem.loop.train_step reads.
    bare_module = _module(cfg)
    optimizer = bare_module.configure_optimizers()
    stream = EventStream(dataset, "train", cfg.data, training=True)
    counter = ReadCounter()
    with counter:
        for batch, _ in zip(stream, range(3), strict=False):
            train_step(bare_module.model, batch, optimizer, grad_clip=cfg.train.grad_clip)
    bare = counter.reads / 3
    assert bare == 0, "the DLRM's own step reads no tensor: any read below is the harness's"

    mlflow.set_tracking_uri(cfg.train.tracking_uri)
    # Named, not the active one: an earlier test's experiment id stays active in mlflow's module state.
    with mlflow.start_run(experiment_id=ensure_experiment("host")) as run:
        trainer = build_trainer(cfg, None, MetricRecorder(run.info.run_id, resumed=False))
        steps = ReadsPerStep()
        trainer.callbacks.append(steps)
        trainer.fit(module, datamodule=EventDataModule(cfg.data))
    assert len(steps.by_step) == 20
    logged = {s for s in steps.by_step if s % cfg.train.log_every_n_steps == 0}
    quiet = set(steps.by_step) - logged - steps.bar_refreshes
    assert len(quiet) >= 10
    assert {s: steps.by_step[s] for s in quiet} == dict.fromkeys(quiet, 0)
    # The counter sees the harness's reads where there are some: logging reads the step's losses.
    assert all(steps.by_step[s] > 0 for s in logged)
    assert all(steps.by_step[s] > 0 for s in steps.bar_refreshes)


class ValidatedEpochs(L.Callback):
    def __init__(self) -> None:
        self.epochs: list[int] = []

    def on_validation_end(self, trainer, pl_module) -> None:
        self.epochs.append(trainer.current_epoch)


def test_validation_every_n_epochs_and_after_the_last(dataset, tmp_path):
    cfg = _cfg(dataset, tmp_path, "train.max_epochs=5", "train.check_val_every_n_epoch=2")
    trainer = build_trainer(cfg, None, None)
    validated = ValidatedEpochs()
    trainer.callbacks.append(validated)
    trainer.fit(_module(cfg), datamodule=EventDataModule(cfg.data))
    assert validated.epochs == [1, 3, 4]
    with pytest.raises(ConfigError, match=r"train\.check_val_every_n_epoch=0 must be at least 1"):
        build_trainer(_cfg(dataset, tmp_path, "train.check_val_every_n_epoch=0"), None, None)


@pytest.mark.parametrize(
    "stop",
    [20, 30, 40, 50],
    ids=["at-an-epoch-end-without-validation", "mid-epoch", "after-a-validation", "mid-last-epoch"],
)
def test_resume_with_a_validation_cadence_and_a_cached_split_is_exact(dataset, tmp_path, stop):
    overrides = ("train.max_epochs=3", "train.check_val_every_n_epoch=2", "train.checkpoint_every_n_steps=7")
    whole = train(_cfg(dataset, tmp_path / "whole", *overrides), resume=False)
    cut = tmp_path / "cut"
    train(_cfg(dataset, cut, *overrides, f"train.max_steps={stop}"), resume=False)
    resumed = train(_cfg(dataset, cut, *overrides), resume=True)
    a, b = load_checkpoint_file(whole["checkpoint"]), load_checkpoint_file(resumed["checkpoint"])
    assert a["global_step"] == b["global_step"] == 60
    for name, tensor in a["state_dict"].items():
        assert torch.equal(tensor, b["state_dict"][name]), name
    for key in ("val/click/ne", "val/loss"):
        assert whole["metrics"][key] == resumed["metrics"][key], key


@pytest.fixture(scope="module")
def sequences(tmp_path_factory):
    """A small next-item dataset: 200 users walking a ring of 40 items."""
    root = tmp_path_factory.mktemp("seq")
    rng = np.random.default_rng(0)
    lines = []
    for user in range(200):
        walk = (int(rng.integers(1, 41)) + np.cumsum(rng.integers(1, 3, int(rng.integers(6, 14))))) % 40 + 1
        lines.append(f"{user}\t{' '.join(map(str, walk))}")
    (root / "seq.tsv").write_text("\n".join(lines) + "\n")
    convert("seq-tsv", root / "seq.tsv", root / "data")
    return root / "data"


def test_the_harness_benchmark_times_each_side_epoch_by_epoch(sequences, tmp_path):
    """``experiments.bench_ml1m_harness`` as the GPU call runs it, at a tiny size (its figures are not checked)."""
    out = tmp_path / "bench.json"
    tiny = ["data.max_len=16", "model.teacher.max_len=16", "model.teacher.num_negatives=8", "data.batch_size=64"]
    assert bench_ml1m_harness.main(["--data", str(sequences), "--epochs", "2", "--runs", "2", "--json", str(out), *tiny]) == 0
    report = json.loads(out.read_text())
    for side in ("harness", "loop"):
        runs = report["runs"][side]
        assert len(runs) == 2 and all(len(epochs) == 2 for epochs in runs)
        # 200 users in batches of 64; validation only after the last epoch (cadence 10).
        assert all([e["steps"] for e in epochs] == [4, 4] for epochs in runs)
        assert all([e["val_passes"] for e in epochs] == [0, 1] for epochs in runs)
        summary = report["summary"][side]
        assert summary["val_every"] == 10 and summary["projected_cpu_s"] > 0
