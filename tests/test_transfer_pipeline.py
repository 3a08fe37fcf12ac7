"""Teacher -> teacher outputs -> students trained through the harness -> transfer report, with lineage;
and ``gem pipeline``, the whole chain from the synthetic world, resumed stage by stage."""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlflow
import pytest

from foundation.config import apply_overrides
from gem.cli import main
from gem.evaluate import predict_split
from gem.flavors import get_flavor
from gem.module import RecModule, load_module
from gem.report import REPORT_MD, ReportConfig, run_transfer_report
from gem.train import train
from tests.events import write_dataset
from transfer.teacher_outputs import TeacherOutputsError


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """A tiny DLRM teacher, then a report over ``alone``, KD, AH+SA with representations and the full stack
    (which also shares the DLRM's tables), 1 seed."""
    root = tmp_path_factory.mktemp("transfer")
    data = write_dataset(root / "data", rows={"train": 640, "valid": 192, "test": 192}, row_group_size=64)
    uri = f"sqlite:///{root}/mlflow.db"
    common = [f"train.tracking_uri={uri}", "train.progress_bar=false", f"train.out_dir={root / 'runs'}"]
    teacher_cfg = apply_overrides(
        get_flavor("debug"),
        [*common, f"data.path={data}", "train.max_steps=10", "model.dlrm.repr_dim=6", "model.dlrm.top_mlp=(16,)"],
    )
    teacher = train(teacher_cfg)
    cfg = ReportConfig(
        teacher_ckpt=teacher["checkpoint"],
        out_dir=str(root / "report"),
        methods=("kd", "ah-sa-repr", "full"),
        seeds=1,
        rows_per_shard=256,
        overrides=(*common, "train.max_steps=6", "model.student.hidden=(16,)"),
    )
    path = run_transfer_report(cfg)
    # Strict JSON: an undefined metric is null, never the non-standard NaN.
    report = json.loads(path.read_text(), parse_constant=lambda name: pytest.fail(f"{name} in {path}"))
    return {"teacher": teacher, "report": report, "path": path, "uri": uri}


def test_report_has_every_method_with_finite_ne_and_transfer_ratio(pipeline):
    report = pipeline["report"]
    assert set(report["methods"]) == {"alone", "kd", "ah-sa-repr", "full"}
    keys = ("click", "conversion", "click/d0")
    gained = [key for key in keys if report["teacher_gain"][key]["mean"] > 0]
    for name, method in report["methods"].items():
        for section in ("ne", "auc", "tr"):
            for key in keys:
                stat = method[section][key]
                if section == "tr" and key not in gained:
                    # No gain to share: the ratio is undefined (null), not a number that reads as one.
                    assert stat["mean"] is None, (name, key, stat)
                    continue
                assert math.isfinite(stat["mean"]) and stat["std"] == 0.0, (name, section, key)
    for key in gained:
        assert report["methods"]["alone"]["tr"][key]["mean"] == 0.0
    alone, teacher = report["methods"]["alone"]["ne"]["click"]["mean"], report["teacher"]["metrics"]["click/ne"]
    assert report["teacher_gain"]["click"]["mean"] == pytest.approx(alone - teacher)
    assert report["teacher"]["checkpoint_sha256"] == pipeline["teacher"]["checkpoint_sha256"]
    assert "| kd |" in (pipeline["path"].parent / REPORT_MD).read_text()

    client = mlflow.tracking.MlflowClient(pipeline["uri"])
    artifacts = {a.path for a in client.list_artifacts(report["mlflow_run_id"])}
    assert {"transfer_report.json", "transfer_report.md", "transfer_report.png"} <= artifacts


def test_student_runs_carry_the_teachers_lineage(pipeline):
    client = mlflow.tracking.MlflowClient(pipeline["uri"])
    kd = client.get_run(pipeline["report"]["methods"]["kd"]["runs"][0]).data.tags
    assert kd["gem.teacher_run_id"] == pipeline["teacher"]["run_id"]
    assert kd["gem.checkpoint_sha256"] == pipeline["teacher"]["checkpoint_sha256"]
    for split in ("train", "valid", "test"):
        manifest = json.loads(Path(kd[f"gem.teacher_outputs.{split}"]).read_text())
        assert manifest["source"]["split"] == split
    alone = client.get_run(pipeline["report"]["methods"]["alone"]["runs"][0]).data.tags
    assert "gem.teacher_run_id" not in alone, "the no-transfer baseline must not read the teacher"
    full = client.get_run(pipeline["report"]["methods"]["full"]["runs"][0]).data.tags
    assert full["gem.shared_from"] == str(Path(pipeline["teacher"]["checkpoint"]).resolve())


def test_full_stack_student_starts_from_the_teachers_tables_and_loads_alone(pipeline):
    student = load_module(pipeline["report"]["methods"]["full"]["checkpoints"][0])
    assert student.cfg.transfer.shared_dims == {"t_item_category": 16, "t_item_id": 16, "t_user_age": 16}
    assert student.sharing.policy == "freeze" and len(student.sharing.new) == 3
    kd = load_module(pipeline["report"]["methods"]["kd"]["checkpoints"][0])
    assert kd.sharing is None


def test_harness_rejects_outputs_of_another_split_or_teacher(pipeline):
    ckpt = pipeline["report"]["methods"]["kd"]["checkpoints"][0]
    module = load_module(ckpt)
    outputs = module.cfg.transfer.teacher_outputs
    module.cfg.transfer.teacher_outputs = {**outputs, "valid": outputs["test"]}
    with pytest.raises(TeacherOutputsError, match="example ids have no teacher outputs"):
        predict_split(module, module.cfg.data, "valid")

    module = load_module(ckpt)
    module.cfg.transfer.checkpoint_sha256 = "0" * 64
    with pytest.raises(TeacherOutputsError, match="not the requested"):
        predict_split(module, module.cfg.data, "test")

    dlrm = load_module(pipeline["teacher"]["checkpoint"])
    dlrm.cfg.transfer.teacher_outputs = outputs
    with pytest.raises(ValueError, match=r"model\.arch='dlrm' takes no teacher outputs"):
        RecModule(dlrm.cfg.to_dict(), dict(dlrm.hparams["schema"]))


def test_cli_validates_transfer_report_arguments(pipeline, tmp_path, capsys):
    assert main(["transfer-report", "--ckpt", str(tmp_path / "none.ckpt"), "--out", str(tmp_path)]) == 2
    assert "checkpoint not found" in capsys.readouterr().err
    args = ["transfer-report", "--ckpt", pipeline["teacher"]["checkpoint"], "--out", str(tmp_path), "--methods", "kd,nope"]
    assert main(args) == 2
    assert "unknown transfer methods ['nope']" in capsys.readouterr().err
    assert main([*args[:-1], "kd", "--flavor", "student-debug-kd"]) == 2
    assert "must be a student with no transfer on" in capsys.readouterr().err


SYNTH_TINY = ("num_users=300", "num_items=200", "num_examples=3000", "users_per_block=128", "num_advertisers=20",
              "rows_per_shard=1024", "split_fractions=(0.6,0.2,0.2)")


def test_pipeline_runs_the_debug_world_end_to_end_and_resumes(tmp_path, capsys):
    """``gem pipeline``: a (shrunk) debug world, the GEM teacher, students on the later window, the report;
    a rerun reuses every stage, and a lost report is rebuilt from the recorded students."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    common = [f"train.tracking_uri={uri}", "train.progress_bar=false"]
    args = ["pipeline", "--preset", "debug", "--out", str(tmp_path / "pipe"), "--data", str(tmp_path / "world"),
            "--methods", "full", "--seeds", "1", "--synth", *SYNTH_TINY,
            "--teacher", *common, "train.max_steps=6", "--student", *common, "train.max_steps=4"]
    assert main(args) == 0
    path = Path(capsys.readouterr().out.strip().splitlines()[-1])
    state = json.loads((tmp_path / "pipe" / "pipeline.json").read_text())
    assert state["stages"] == {"data": "generated", "teacher": "trained", "report": "written"}
    report = json.loads(path.read_text())
    assert set(report["methods"]) == {"alone", "full"}
    assert report["student_split"] == "valid" and report["test_split"] == "test"
    assert report["teacher"]["run_id"] == state["teacher"]["run_id"]
    teacher = load_module(state["teacher"]["checkpoint"]).cfg.model
    full = load_module(report["methods"]["full"]["checkpoints"][0])
    assert teacher.arch == "teacher" and full.cfg.transfer.shared_dims["t_item_id"] == teacher.teacher.item_dim

    assert main(args) == 0
    assert Path(capsys.readouterr().out.strip().splitlines()[-1]) == path
    state = json.loads((tmp_path / "pipe" / "pipeline.json").read_text())
    assert state["stages"] == {"data": "reused", "teacher": "reused", "report": "reused"}
    assert json.loads(path.read_text())["mlflow_run_id"] == report["mlflow_run_id"]

    path.unlink()
    assert main(args) == 0
    rebuilt = json.loads(path.read_text())
    assert json.loads((tmp_path / "pipe" / "pipeline.json").read_text())["stages"]["report"] == "written"
    assert {m: r["runs"] for m, r in rebuilt["methods"].items()} == {m: r["runs"] for m, r in report["methods"].items()}

    synth, teacher = args.index("--synth") + 1, args.index("--teacher")
    other = [*args[:synth], *SYNTH_TINY[:-1], "split_fractions=(0.5,0.3,0.2)", *args[teacher:]]
    assert main(other) == 2
    assert "generated with another config (differs in ['split_fractions'])" in capsys.readouterr().err
    assert main([*args, "--teacher-ckpt", str(tmp_path / "none.ckpt")]) == 2
    assert "checkpoint not found" in capsys.readouterr().err
