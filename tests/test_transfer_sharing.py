"""Parameter sharing: tables by name, projection where dims differ, each policy, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from foundation.data.io import CorruptFileError, sha256_file
from foundation.model.baseline import DLRMConfig
from gem.cli import POLICY_CHOICES
from gem.config import ExperimentConfig, ModelConfig
from gem.module import RecModule
from gem.registry import ITEM_TABLES
from tests.events import SCHEMA
from transfer.sharing import (
    POLICIES,
    ProjectedTable,
    SharingConfig,
    SharingError,
    apply_sharing,
    build_param_groups,
    default_table_map,
    init_projection,
    read_teacher_checkpoint,
    teacher_tables,
)
from value_models.serving import load_student

TEACHER_DIM = 8


@pytest.fixture(scope="module")
def teacher_ckpt(tmp_path_factory):
    """A DLRM teacher checkpoint in the layout ``gem train`` writes (``state_dict`` with ``model.`` keys)."""
    torch.manual_seed(0)
    cfg = ExperimentConfig(model=ModelConfig(dlrm=DLRMConfig(embedding_dim=TEACHER_DIM, repr_dim=6)))
    module = RecModule(cfg.to_dict(), json.loads(SCHEMA.to_json()))
    path = tmp_path_factory.mktemp("teacher") / "last.ckpt"
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": {}}, path)
    return path


class Student(nn.Module):
    """Two tables named like the DLRM's, and an item tower shaped like the teacher's."""

    def __init__(self, item_dim: int = TEACHER_DIM) -> None:
        super().__init__()
        self.tables = nn.ModuleDict(
            {"t_user_age": nn.EmbeddingBag(5, TEACHER_DIM, mode="mean"), "t_item_id": nn.EmbeddingBag(40, item_dim)}
        )
        self.item_tower = nn.Linear(2 * TEACHER_DIM, 6)
        self.head = nn.Linear(TEACHER_DIM + item_dim, 1)

    def forward(self, age: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
        bags = [self.tables["t_user_age"](age[:, None]), self.tables["t_item_id"](item[:, None])]
        return self.head(torch.cat(bags, dim=1)).squeeze(-1)


def _step(student: Student, groups: list[dict]) -> None:
    opt = torch.optim.SGD(groups, lr=groups[0]["lr"])
    loss = student(torch.tensor([0, 1, 2, 3]), torch.tensor([1, 5, 7, 39])).pow(2).sum()
    loss.backward()
    opt.step()


def test_read_teacher_checkpoint_strips_the_module_prefix(teacher_ckpt):
    teacher = read_teacher_checkpoint(teacher_ckpt)
    state = teacher.state
    assert "item_ebc.embedding_bags.t_item_id.weight" in state
    assert not any(k.startswith("model.") for k in state)
    assert sorted(teacher_tables(state)) == ["t_item_category", "t_item_id", "t_user_age"]
    assert teacher.arch is None and teacher.sha256 == sha256_file(teacher_ckpt)
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        read_teacher_checkpoint(teacher_ckpt.parent / "missing.ckpt")


def test_read_teacher_checkpoint_refuses_pickled_code(tmp_path):
    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "payload": Student()}, path)
    with pytest.raises(CorruptFileError, match=r"evil\.ckpt: refused: not a weights-only checkpoint .*it was not loaded"):
        read_teacher_checkpoint(path)


def test_same_dim_tables_and_tower_are_copied_and_finetuned(teacher_ckpt):
    state = read_teacher_checkpoint(teacher_ckpt).state
    student = Student()
    cfg = SharingConfig(towers={"item_tower": "item_tower"})
    result = apply_sharing(student, state, cfg)
    assert result.report["t_item_id"] == {"teacher_table": "t_item_id", "teacher_shape": [40, 8], "projected": False}
    assert torch.equal(student.tables["t_user_age"].weight, state["sparse_ebc.embedding_bags.t_user_age.weight"])
    assert torch.equal(student.item_tower.weight, state["item_tower.weight"])
    assert not result.new

    groups = build_param_groups(student, result, lr=0.1)
    assert len(groups) == 1 and {id(p) for p in groups[0]["params"]} == {id(p) for p in student.parameters()}
    before = student.tables["t_item_id"].weight.detach().clone()
    _step(student, groups)
    assert not torch.equal(student.tables["t_item_id"].weight, before)


def test_projection_where_dims_differ(teacher_ckpt):
    state = read_teacher_checkpoint(teacher_ckpt).state
    student = Student(item_dim=4)
    result = apply_sharing(student, state, SharingConfig(tables={"t_item_id": "t_item_id"}))
    table = student.tables["t_item_id"]
    assert isinstance(table, ProjectedTable) and table.embedding_dim == 4
    assert result.report["t_item_id"]["projected"] and result.new == [table.proj.weight]
    teacher_w = state["item_ebc.embedding_bags.t_item_id.weight"]
    assert torch.equal(table.table.weight, teacher_w)
    ids = torch.tensor([3, 9, 3])
    torch.testing.assert_close(table(ids[:, None]), teacher_w[ids] @ table.proj.weight.T)
    # Principal directions: orthonormal rows, and zero rows when the student is wider than the teacher.
    torch.testing.assert_close(table.proj.weight @ table.proj.weight.T, torch.eye(4), atol=1e-5, rtol=0)
    wide = init_projection(teacher_w, 10)
    assert torch.count_nonzero(wide[8:]) == 0
    # Untouched: a table the config did not map keeps its random init.
    assert not torch.equal(student.tables["t_user_age"].weight, state["sparse_ebc.embedding_bags.t_user_age.weight"])

    with pytest.raises(SharingError, match=r"table 't_item_id': teacher dim 8 != student dim 4 and project=False"):
        apply_sharing(Student(item_dim=4), state, SharingConfig(project=False))


def test_freeze_keeps_teacher_values_while_projection_learns(teacher_ckpt):
    state = read_teacher_checkpoint(teacher_ckpt).state
    student = Student(item_dim=4)
    result = apply_sharing(student, state, SharingConfig(policy="freeze"))
    assert all(not p.requires_grad for p in result.shared)
    groups = build_param_groups(student, result, lr=0.1)
    in_groups = {id(p) for g in groups for p in g["params"]}
    assert not in_groups & {id(p) for p in result.shared}
    assert id(student.tables["t_item_id"].proj.weight) in in_groups

    proj_before = student.tables["t_item_id"].proj.weight.detach().clone()
    _step(student, groups)
    assert torch.equal(student.tables["t_item_id"].table.weight, state["item_ebc.embedding_bags.t_item_id.weight"])
    assert torch.equal(student.tables["t_user_age"].weight, state["sparse_ebc.embedding_bags.t_user_age.weight"])
    assert not torch.equal(student.tables["t_item_id"].proj.weight, proj_before)


def test_finetune_lower_lr_puts_shared_params_in_a_slower_group(teacher_ckpt):
    state = read_teacher_checkpoint(teacher_ckpt).state
    results = {}
    for policy in ("finetune", "finetune_lower_lr"):
        torch.manual_seed(1)
        student = Student()
        result = apply_sharing(student, state, SharingConfig(policy=policy, lr_scale=0.1))
        groups = build_param_groups(student, result, lr=0.5)
        before = student.tables["t_user_age"].weight.detach().clone()
        _step(student, groups)
        results[policy] = (groups, student.tables["t_user_age"].weight.detach() - before)
    groups, slow_delta = results["finetune_lower_lr"]
    assert [(g["name"], g["lr"]) for g in groups] == [("student", 0.5), ("shared", pytest.approx(0.05))]
    # Same data, same start: plain SGD moves the shared table exactly lr_scale as far.
    torch.testing.assert_close(slow_delta, 0.1 * results["finetune"][1])


def test_missing_or_misshapen_teacher_parameters_are_named(teacher_ckpt):
    state = read_teacher_checkpoint(teacher_ckpt).state
    with pytest.raises(SharingError, match=r"student table 't_user_age': teacher table 't_age' not in the checkpoint"):
        apply_sharing(Student(), state, SharingConfig(tables={"t_user_age": "t_age"}))
    with pytest.raises(SharingError, match=r"student has no table 't_nope'"):
        apply_sharing(Student(), state, SharingConfig(tables={"t_nope": "t_user_age"}))
    with pytest.raises(SharingError, match=r"table 't_item_id': teacher has 6 rows, student 40"):
        apply_sharing(Student(), state, SharingConfig(tables={"t_item_id": "t_item_category"}))
    with pytest.raises(SharingError, match=r"tower 'head': parameter 'weight' is \[1, 16\] in the student, \[6, 16\]"):
        apply_sharing(Student(), state, SharingConfig(towers={"head": "item_tower"}))
    with pytest.raises(SharingError, match=r"tower 'head': teacher has no parameter 'user_head.weight'"):
        apply_sharing(Student(), state, SharingConfig(towers={"head": "user_head"}))
    with pytest.raises(ValueError, match="unknown sharing policy 'thaw'"):
        SharingConfig(policy="thaw")


def test_default_table_map_translates_the_item_table_of_each_arch():
    student_tables = ["t_user_age", "t_item_category", "t_item_id"]
    assert default_table_map(student_tables, "student", "dlrm", ITEM_TABLES) == {t: t for t in student_tables}
    assert default_table_map(student_tables, "student", "teacher", ITEM_TABLES) == {
        "t_user_age": "t_user_age", "t_item_category": "t_item_category", "t_item_id": "t_item",
    }
    with pytest.raises(SharingError, match=r"no table-name map for model.arch 'hstu'.*transfer.share_tables"):
        default_table_map(student_tables, "student", "hstu", ITEM_TABLES)
    with pytest.raises(SharingError, match=r"does not name its model\.arch"):
        default_table_map(student_tables, "student", None, ITEM_TABLES)


def _module(arch: str, **transfer) -> RecModule:
    """A RecModule of ``arch`` on the test schema (teacher: the debug GEM config; tables wider than the
    student's 8, so they are projected), with ``transfer`` fields set."""
    cfg = ExperimentConfig(model=ModelConfig(arch=arch, dlrm=DLRMConfig(embedding_dim=12, repr_dim=6)))
    for key, value in transfer.items():
        setattr(cfg.transfer, key, value)
    return RecModule(cfg.to_dict(), json.loads(SCHEMA.to_json()))


def _save(module: RecModule, path) -> str:
    """Save as the harness does: ``state_dict`` with ``model.`` keys and the config in ``hyper_parameters``."""
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, path)
    return str(path)


@pytest.mark.parametrize("teacher_arch, item_table", [("dlrm", "t_item_id"), ("teacher", "t_item")])
def test_harness_shares_from_either_teacher_arch_and_loads_without_it(tmp_path, teacher_arch, item_table):
    torch.manual_seed(0)
    teacher = _save(_module(teacher_arch), tmp_path / "teacher.ckpt")
    teacher_state = read_teacher_checkpoint(teacher).state
    teacher_item = teacher_tables(teacher_state)[item_table]
    student = _module("student", share_from=teacher, share_policy="finetune_lower_lr", share_lr_scale=0.25)
    tables = student.model.tables
    assert sorted(student.sharing.report) == ["t_item_category", "t_item_id", "t_user_age"]
    assert student.sharing.report["t_item_id"]["teacher_table"] == item_table
    assert torch.equal(tables["t_item_id"].table.weight, teacher_item)
    # The teacher dims are recorded in the config the checkpoint keeps.
    recorded = student.hparams["config"]["transfer"]["shared_dims"]
    assert recorded == {name: teacher_tables(teacher_state)[r["teacher_table"]].shape[1]
                        for name, r in student.sharing.report.items()}

    optimizer = student.configure_optimizers()
    lrs = {g["name"]: g["lr"] for g in optimizer.param_groups}
    assert lrs == {"student": student.cfg.train.lr, "shared": pytest.approx(0.25 * student.cfg.train.lr)}
    shared = {id(p) for p in optimizer.param_groups[1]["params"]}
    assert shared == {id(p) for p in student.sharing.shared} and id(tables["t_item_id"].table.weight) in shared

    # A trained student loads (e.g. for serving) from its own checkpoint once the teacher file is gone.
    with torch.no_grad():
        tables["t_item_id"].table.weight.add_(1.0)
    saved = _save(student, tmp_path / "student.ckpt")
    Path(teacher).unlink()
    ckpt = torch.load(saved, weights_only=True)
    loaded = RecModule(ckpt["hyper_parameters"]["config"], ckpt["hyper_parameters"]["schema"], from_checkpoint=True)
    loaded.load_state_dict(ckpt["state_dict"])
    assert torch.equal(loaded.model.tables["t_item_id"].table.weight, teacher_item + 1.0)
    # Serving rebuilds it without the training harness, from the same record.
    served = load_student(saved)
    assert torch.equal(served.tables["t_item_id"].table.weight, teacher_item + 1.0)
    assert not served.training and isinstance(served.tables["t_item_id"], ProjectedTable)


def test_harness_sharing_errors_name_the_checkpoint_and_table(tmp_path):
    torch.manual_seed(0)
    teacher = _save(_module("teacher"), tmp_path / "teacher.ckpt")
    with pytest.raises(SharingError, match=r"teacher.ckpt \(model.arch='teacher'\): student table 't_item_id': "
                                           r"teacher table 't_item_id' not in the checkpoint"):
        _module("student", share_from=teacher, share_tables={"t_item_id": "t_item_id"})
    # A teacher of another world: its item table has other rows than the student's id space.
    other = ExperimentConfig(model=ModelConfig(arch="dlrm"))
    wide = json.loads(SCHEMA.to_json()) | {"num_items": 80}
    dlrm = _save(RecModule(other.to_dict(), wide), tmp_path / "other.ckpt")
    with pytest.raises(SharingError, match=r"other.ckpt .*table 't_item_id': teacher has 80 rows, student 40"):
        _module("student", share_from=dlrm)
    with pytest.raises(SharingError, match="share from the same teacher"):
        _module("student", share_from=teacher, checkpoint_sha256="0" * 64)
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        _module("student", share_from=str(tmp_path / "missing.ckpt"))
    with pytest.raises(ValueError, match="unknown sharing policy 'thaw'"):
        _module("student", share_from=teacher, share_policy="thaw")
    assert POLICY_CHOICES == POLICIES, "the CLI offers exactly the sharing policies"
