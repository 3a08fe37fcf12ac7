"""Parameter sharing: tables by name, projection where dims differ, each policy, clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from foundation.config import DLRMConfig, ExperimentConfig, ModelConfig
from foundation.data.io import CorruptFileError
from foundation.train import RecModule
from tests.events import SCHEMA
from transfer.sharing import (
    ProjectedTable,
    SharingConfig,
    SharingError,
    apply_sharing,
    build_param_groups,
    init_projection,
    read_teacher_state,
    teacher_tables,
)

TEACHER_DIM = 8


@pytest.fixture(scope="module")
def teacher_ckpt(tmp_path_factory):
    """A DLRM teacher checkpoint in the layout ``foundation.train`` writes (``state_dict`` with ``model.`` keys)."""
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


def test_read_teacher_state_strips_the_module_prefix(teacher_ckpt):
    state = read_teacher_state(teacher_ckpt)
    assert "item_ebc.embedding_bags.t_item_id.weight" in state
    assert not any(k.startswith("model.") for k in state)
    assert sorted(teacher_tables(state)) == ["t_item_category", "t_item_id", "t_user_age"]
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        read_teacher_state(teacher_ckpt.parent / "missing.ckpt")


def test_read_teacher_state_refuses_pickled_code(tmp_path):
    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "payload": Student()}, path)
    with pytest.raises(CorruptFileError, match="unreadable checkpoint"):
        read_teacher_state(path)


def test_same_dim_tables_and_tower_are_copied_and_finetuned(teacher_ckpt):
    state = read_teacher_state(teacher_ckpt)
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
    state = read_teacher_state(teacher_ckpt)
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
    state = read_teacher_state(teacher_ckpt)
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
    state = read_teacher_state(teacher_ckpt)
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
    state = read_teacher_state(teacher_ckpt)
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
