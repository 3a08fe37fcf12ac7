"""The student ranker: model protocol, short history, transfer modes, sharing layout, size versus the teacher."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from foundation.config import dataclass_from_dict
from foundation.data.pipeline import DataConfig, EventStream
from foundation.model.baseline import DLRMConfig
from foundation.model.teacher import GEMTeacher
from foundation.model.teacher_config import TeacherConfig
from gem.config import ExperimentConfig, ModelConfig
from gem.module import RecModule, load_trained
from tests.events import SCHEMA, write_dataset
from transfer.distill import AdapterConfig, AuxHeadConfig
from transfer.sharing import SharingConfig, apply_sharing
from transfer.teacher_outputs import read_teacher_outputs, write_teacher_outputs
from value_models.student import StudentConfig, StudentRanker, recent_history


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    root = write_dataset(tmp_path_factory.mktemp("events"), rows={"train": 64}, shards=1, row_group_size=64)
    stream = EventStream(root, "train", DataConfig(path=str(root), max_len=12, batch_size=64), training=False)
    return next(iter(stream))


def fake_teacher(batch, repr_dim: int = 6) -> dict[str, torch.Tensor]:
    """What ``TeacherOutputs.take`` returns for the batch, with made-up values."""
    g = torch.Generator().manual_seed(1)
    b = batch.batch_size
    out = {"user_repr": torch.randn(b, repr_dim, generator=g), "item_repr": torch.randn(b, repr_dim, generator=g)}
    for task in ("click", "conversion"):
        out[f"{task}_logit"] = torch.randn(b, generator=g)
        out[f"{task}_prob"] = torch.sigmoid(out[f"{task}_logit"])
    return out


def test_recent_history_keeps_the_most_recent_items(batch):
    values, starts = recent_history(batch, 3)
    lengths = batch.lengths
    assert torch.equal(starts, torch.cumsum(lengths.clamp(max=3), 0) - lengths.clamp(max=3))
    for i in range(batch.batch_size):
        row = batch.history["item_ids"][batch.offsets[i] : batch.offsets[i + 1]]
        end = starts[i + 1] if i + 1 < batch.batch_size else len(values)
        assert torch.equal(values[starts[i] : end], row[-3:] if len(row) else row)


def test_forward_and_loss_follow_the_model_protocol(batch):
    model = StudentRanker(StudentConfig(), SCHEMA)
    out = model(batch)
    assert set(out.logits) == {"click", "conversion"}
    assert all(v.shape == (batch.batch_size,) for v in out.logits.values())
    assert out.user_repr.shape == (batch.batch_size, 8 * 2) and out.item_repr.shape == (batch.batch_size, 8 * 2)
    losses = model.loss(batch, out)
    assert losses["loss"].isfinite() and set(losses) == {"loss", "loss_click", "loss_conversion"}
    losses["loss"].backward()
    assert model.tables["t_item_id"].weight.grad.abs().sum() > 0


def test_history_changes_the_prediction_only_when_enabled(batch):
    torch.manual_seed(0)
    with_hist = StudentRanker(StudentConfig(history_len=4), SCHEMA)
    torch.manual_seed(0)
    no_hist = StudentRanker(StudentConfig(history_len=0), SCHEMA)
    assert no_hist.input_dim == with_hist.input_dim - 8
    shuffled = batch.history["item_ids"].flip(0)
    moved = type(batch)(**{**batch.__dict__, "history": {**batch.history, "item_ids": shuffled}})
    assert not torch.allclose(with_hist(batch).logits["click"], with_hist(moved).logits["click"])
    torch.testing.assert_close(no_hist(batch).logits["click"], no_hist(moved).logits["click"])


def test_transfer_modes_need_teacher_outputs_and_use_them(batch):
    teacher = fake_teacher(batch)
    kd = StudentRanker(StudentConfig(distill="kd"), SCHEMA)
    with pytest.raises(ValueError, match=r"needs teacher outputs: forward\(batch, teacher="):
        kd(batch)
    losses = kd.loss(batch, kd(batch, teacher))
    assert {"click/loss_true", "click/loss_kd"} <= set(losses)

    cfg = StudentConfig(distill="ah", aux=AuxHeadConfig(alpha=1.2, weight=0.5, beta=0.1), use_adapter=True)
    ah = StudentRanker(cfg, SCHEMA)
    out = ah(batch, teacher)
    assert set(out.extra) == {f"{k}/{t}" for k in ("distill_logit", "teacher_logit") for t in ("click", "conversion")}
    losses = ah.loss(batch, out)
    assert {"click/loss_serve", "click/loss_distill", "click/loss_adapter", "click/loss_sa"} <= set(losses)
    losses["loss"].backward()
    assert all(p.grad is not None for p in ah.adapters.parameters())
    assert ah.heads.distill.weight.grad is not None and ah.heads.serve.weight.grad is not None

    with_repr = StudentRanker(StudentConfig(teacher_repr=True, user_repr_dim=6, item_repr_dim=6), SCHEMA)
    base = with_repr(batch, teacher).logits["click"]
    shifted = {**teacher, "user_repr": teacher["user_repr"] + 1.0}
    assert not torch.allclose(base, with_repr(batch, shifted).logits["click"])

    with pytest.raises(ValueError, match="set distill='ah'"):
        StudentConfig(use_adapter=True)
    with pytest.raises(ValueError, match="user_repr_dim and item_repr_dim"):
        StudentConfig(teacher_repr=True)


def test_student_tables_take_a_dlrm_teachers_tables(batch):
    cfg = ExperimentConfig(model=ModelConfig(dlrm=DLRMConfig(embedding_dim=16)))
    teacher = RecModule(cfg.to_dict(), json.loads(SCHEMA.to_json())).model
    state = teacher.state_dict()
    student = StudentRanker(StudentConfig(embedding_dim=8), SCHEMA)
    result = apply_sharing(student, state, SharingConfig(policy="freeze"))
    assert sorted(result.report) == ["t_item_category", "t_item_id", "t_user_age"]
    assert all(r["projected"] for r in result.report.values())
    assert student(batch).logits["click"].shape == (batch.batch_size,)


def test_student_is_far_smaller_than_the_teacher(batch):
    student = StudentRanker(StudentConfig(), SCHEMA).eval()
    teacher = GEMTeacher(TeacherConfig(), SCHEMA).eval()

    def flops(model) -> int:
        counter = FlopCounterMode(display=False)
        with torch.no_grad(), counter:
            model(batch)
        return counter.get_total_flops()

    student_flops = flops(student)
    assert student_flops == student.serving_flops() * batch.batch_size
    assert student_flops * 20 < flops(teacher)
    assert sum(p.numel() for p in student.parameters()) * 20 < sum(p.numel() for p in teacher.parameters())


def test_student_distils_from_written_teacher_outputs(tmp_path):
    """Teacher checkpoint -> teacher-output service -> AH+SA student joined by example_id, a few steps."""
    data = write_dataset(tmp_path / "data", rows={"train": 96}, shards=2, row_group_size=32)
    torch.manual_seed(0)
    cfg = ExperimentConfig(
        data=DataConfig(path=str(data), max_len=8, batch_size=32),
        model=ModelConfig(dlrm=DLRMConfig(embedding_dim=8, repr_dim=6)),
    )
    module = RecModule(cfg.to_dict(), json.loads(SCHEMA.to_json()))
    ckpt = tmp_path / "teacher.ckpt"
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, ckpt)
    write_teacher_outputs(load_trained(ckpt), data, "train", tmp_path / "outputs", rows_per_shard=40, progress=False)
    outputs = read_teacher_outputs(tmp_path / "outputs", checkpoint=ckpt)

    student_cfg = StudentConfig(
        distill="ah", use_adapter=True, adapter=AdapterConfig(hidden=(8,)), teacher_repr=True, user_repr_dim=6, item_repr_dim=6
    )
    student = StudentRanker(student_cfg, SCHEMA)
    opt = torch.optim.Adam(student.parameters(), lr=1e-2)
    stream = EventStream(data, "train", DataConfig(path=str(data), max_len=8, batch_size=32, seed=1), training=True)
    losses = []
    for epoch in range(4):
        stream.set_epoch(epoch)
        for b in stream:
            loss = student.loss(b, student(b, outputs.take(b.example_id)))["loss"]
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss))
    assert losses[-1] < losses[0]


def test_student_config_round_trips_through_the_harness_config_reader():
    cfg = StudentConfig(hidden=(16, 8), distill="ah", use_adapter=True, aux=AuxHeadConfig(beta=0.2))
    assert dataclass_from_dict(StudentConfig, asdict(cfg)) == cfg
