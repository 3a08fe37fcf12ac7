"""The GPU experiment scripts run end to end on CPU: the command lines the sweeps use, the recalibration, the
`small` teacher learning the synthetic world, and the teacher benchmark's profiler."""

from __future__ import annotations

import json
import re

import pytest
import torch

from experiments import bench_teacher
from experiments.teacher_vs_baseline import main, recalibrate
from foundation.data.synthetic import generate_world
from foundation.metrics import PredictionLog
from gem.flavors import synth_preset
from tests.events import write_dataset


def test_teacher_vs_baseline_takes_overrides_after_options_and_writes_best_epoch(tmp_path):
    data = write_dataset(tmp_path / "events", rows={"train": 400, "valid": 200, "test": 200}, row_group_size=100)
    out = tmp_path / "result.json"
    # Overrides before and after options, as the GPU sweeps write them.
    argv = ["--data", str(data), "model.dlrm.embedding_dim=8", "--flavor", "debug", "--epochs", "2",
            "--json", str(out), "data.batch_size=64", "--device", "cpu"]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["config"]["model"]["dlrm"]["embedding_dim"] == 8 and result["config"]["data"]["batch_size"] == 64
    assert [r["epoch"] for r in result["history"]] == [0, 1]
    best = min(result["history"], key=lambda r: r["valid"]["click/ne"])
    assert result["best_epoch"] == best["epoch"] and result["test"] == best["test"]
    for block in ("test", "test_recalibrated"):
        assert {"click/ne", "click/auc", "click/ne/d0", "click/oracle_ne"} <= set(result[block])


def _miscalibrated_log(n: int, generator: torch.Generator) -> PredictionLog:
    """Labels drawn from ``sigmoid(z - 3)``; predictions ``sigmoid(2(z - 3) + 1.5)``: same ranking, wrong scale."""
    z = torch.randn(n, generator=generator)
    log = PredictionLog()
    log.rows["domain"] = [torch.randint(0, 2, (n,), generator=generator)]
    log.rows["click/label"] = [(torch.rand(n, generator=generator) < torch.sigmoid(z - 3)).float()]
    log.rows["click/mask"] = [torch.ones(n, dtype=torch.bool)]
    log.rows["click/prob"] = [torch.sigmoid(2 * (z - 3) + 1.5)]
    return log


def test_recalibration_fitted_on_valid_fixes_the_scale_and_keeps_the_ranking():
    generator = torch.Generator().manual_seed(0)
    valid, test = _miscalibrated_log(20_000, generator), _miscalibrated_log(20_000, generator)
    before, after = test.metrics(2), recalibrate(valid, test, 2).metrics(2)
    assert after["click/ne"] < before["click/ne"] - 0.05
    assert abs(after["click/calibration"] - 1) < 0.05 < abs(before["click/calibration"] - 1)
    for d in (0, 1):  # a monotone map per domain: the ranking inside each domain is unchanged
        assert after[f"click/auc/d{d}"] == before[f"click/auc/d{d}"]


@pytest.mark.parametrize("tables", ["dense", "sparse"])
def test_small_teacher_learns_the_synthetic_world_and_beats_the_constant_predictor(tmp_path, tables):
    """The `small` recipe on the `debug` world: loss falls, held-out click NE and AUC beat the constant
    base-rate predictor (NE 1, AUC 0.5) and stay below the oracle's ceiling (seeds 0-2: NE .952-.975, AUC .649-.673);
    so does it with its tables stepped lazily (`sparse_tables`, clipped with the rest)."""
    data = tmp_path / "world"
    generate_world(synth_preset("debug"), data, progress=False)
    argv = ["--data", str(data), "--flavor", "teacher-small", "--epochs", "2", "--device", "cpu",
            "--json", str(tmp_path / "t.json"), "data.max_len=32", "model.teacher.max_len=32"]
    if tables == "sparse":
        argv.append("model.teacher.sparse_tables=true")
    assert main(argv) == 0
    result = json.loads((tmp_path / "t.json").read_text())
    losses = [r["loss"] for r in result["history"]]
    assert losses[1] < losses[0], losses
    test = result["test"]
    assert test["click/ne"] < 0.985 and test["click/auc"] > 0.6, test
    assert test["click/oracle_ne"] < test["click/ne"]
    # Overall only: a domain of this 4k-row test split holds 24-221 clicks (reels 48), too few for a per-domain
    # bound (reels' AUC standard error is ~0.04; seeds 0-2 score .547-.559 there).


def test_teacher_vs_baseline_trains_bucketed_flavors_through_the_static_step_as_the_plain_one(tmp_path):
    """With ``train.bucket_rows`` (as ``teacher-large`` sets it) the padded batches go through the static step
    (eagerly on the CPU; every bucket prepared after the first with ``train.cuda_graphs``): in float32 without
    dropout the same losses and test metrics as the plain step on the same batches (padding changes neither)."""
    data = write_dataset(tmp_path / "events", rows={"train": 480, "valid": 96, "test": 96}, row_group_size=96)
    common = ["--data", str(data), "--flavor", "teacher-debug", "--epochs", "2", "--device", "cpu",
              "data.batch_size=32", "data.token_budget=256", "model.teacher.dropout=0.0", "train.precision=32-true"]
    results = {}
    for name, extra in (("plain", []), ("bucketed", ["train.bucket_rows=(24,36)", "train.cuda_graphs=true"])):
        assert main([*common, "--json", str(tmp_path / f"{name}.json"), *extra]) == 0
        results[name] = json.loads((tmp_path / f"{name}.json").read_text())
    plain, bucketed = (results[k]["history"] for k in ("plain", "bucketed"))
    assert [r["padded_steps"] for r in plain] == [0, 0]
    assert [r["padded_steps"] for r in bucketed] == [r["steps"] for r in bucketed] == [r["steps"] for r in plain]
    assert [r["rows"] for r in bucketed] == [r["rows"] for r in plain]
    for a, b in zip(plain, bucketed, strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-4, (a["loss"], b["loss"])
        assert abs(a["test"]["click/ne"] - b["test"]["click/ne"]) < 1e-4


def test_bench_teacher_times_steps_and_profiles_the_next_ones(tmp_path):
    """`bench_teacher --profile N` (what found the bias-gradient hot spot): the timed steps, then a
    profiler table of N more and their time by group, in the JSON; a second run compares its losses with
    the first and both append a row to the results table."""
    out, table = tmp_path / "bench.json", tmp_path / "results" / "teacher_mfu.json"
    argv = ["--flavor", "debug", "--steps", "2", "--rows", "256", "--examples", "2000", "--token-budget", "2048",
            "--workers", "0", "--device", "cpu", "--data", str(tmp_path / "world"), "--record", str(table)]
    assert bench_teacher.main([*argv, "--profile", "1", "--profile-top", "3", "--profile-shapes", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["steps_run"] == 2 and result["losses_finite"] and result["negatives"] == "batch"
    # The first step's parts: its batch's wait and the step itself (no precompile on CPU), inside its time; with
    # the build and the rest they add up to the time from the build's start.
    parts = result["first_step_parts"]
    assert parts["precompile_s"] is None and parts["batch_wait_s"] >= 0 and parts["step_s"] > 0
    assert parts["batch_wait_s"] + parts["step_s"] <= result["first_step_ms"] / 1e3
    assert parts["build_s"] == result["build_s"] and parts["other_s"] >= 0
    assert sum(v or 0.0 for v in parts.values()) == pytest.approx(result["first_step_from_build_s"])
    assert result["first_step_autotuned"] == []  # nothing tunes on the CPU
    profile = result["trace"]["profile"]
    assert "aten::" in profile["table"] and "Self CPU" in profile["table"]
    # --profile-shapes: the busiest operators again, each by the shapes of its inputs.
    assert "Input Shapes" in profile["shape_table"] and "aten::" in profile["shape_table"]
    assert re.search(r"\[\[\d+, \d+", profile["shape_table"])
    groups = profile["groups"]["groups_ms_per_step"]
    # The debug flavor has every part: each named range and the optimizer's own range get time.
    assert all(groups[g] > 0 for g in ("generative_loss", "attention", "embeddings", "optimizer", "gemm"))
    assert sum(groups.values()) == pytest.approx(profile["groups"]["kernel_ms_per_step"])
    top = profile["groups"]["top_kernels"]
    assert len(top) == 3 and all(k["launches_per_step"] >= 1 for k in top)
    again = tmp_path / "again.json"
    argv += ["--glue-backend", "pytorch", "--compare-losses", str(out), "--json", str(again), "--record-label", "b"]
    assert bench_teacher.main(argv) == 0
    comparison = json.loads(again.read_text())["loss_comparison"]
    # On CPU both runs use the references: the same batches give the same losses.
    assert comparison["same_batches"] and comparison["steps"] == 2 and comparison["max_abs_diff"] == 0
    rows = json.loads(table.read_text())["rows"]
    assert [r.get("label") for r in rows] == [None, "b"] and rows[1]["command"].endswith("--record-label b")
    # The fields, and the MFU without outlier steps that the docs report beside the steady one.
    assert set(rows[0]) == {
        "max_history", "mfu", "tokens_per_s", "step_ms_median", "first_step_after_build_s", "command", "date", "device",
        "mfu_no_outliers", "outlier_steps",
    }
    assert rows[0]["outlier_steps"] >= 0


def test_bench_teacher_counts_host_work_and_trains_bucketed_batches_as_the_eager_step(tmp_path, capsys):
    """`--count-ops N` counts the eager step's operators by phase; `--bucketed` pads the same batches to static
    shapes and trains them through gem.loop.StaticStep with the same losses (float32, no dropout: padding
    changes nothing but rounding), also when each step's loss is read only after the next is enqueued
    (`--overlap-steps`); `--cuda-graphs` on a CPU says so once and runs eagerly, each bucket warmed up after the
    first step (`--prepare-buckets`) without changing a loss; `--timeline` profiles one more."""
    argv = ["--flavor", "debug", "--steps", "3", "--rows", "256", "--examples", "2000", "--token-budget", "2048",
            "--max-history", "64", "--workers", "0", "--device", "cpu", "--data", str(tmp_path / "world"),
            "--precision", "fp32", "dropout=0.0"]
    eager = tmp_path / "eager.json"
    assert bench_teacher.main([*argv, "--count-ops", "1", "--json", str(eager)]) == 0
    counts = json.loads(eager.read_text())["trace"]["op_counts"]
    assert counts["steps_counted"] == counts["steps_timed"] == 1
    # The default optimizer (MasterAdamW) runs its PyTorch reference on CPU: elementwise ops in its phase.
    assert counts["kinds"]["forward"]["gemm"] > 0 and counts["kinds"]["optimizer"]["elementwise"] >= 1
    assert counts["sync_sites"] == {}  # nothing in the step reads a device value on the host
    bucketed = tmp_path / "bucketed.json"
    argv += ["--bucketed", "33,35,64", "--cuda-graphs", "--overlap-steps", "--compare-losses", str(eager),
             "--json", str(bucketed), "--timeline", "1"]
    assert bench_teacher.main(argv) == 0
    assert "cuda graphs off: the model is on cpu; eager steps" in capsys.readouterr().out
    result = json.loads(bucketed.read_text())
    static = result["trace"]["static"]
    assert static["padded_steps"] == 3 and static["graphs_captured"] == 0 and not static["cuda_graphs"]
    # Each bucket after the first step's, once, at its first step; nothing compiles in-process on the CPU.
    later = static["later_buckets"]
    assert len(later) == static["buckets_used"] - 1 >= 1, later
    assert len({b["rows"] for b in later}) == len(later) and all(b["compiled"] == [] for b in later)
    assert [b["step"] for b in later] == sorted({b["step"] for b in later}) and later[0]["step"] > 1
    # Every bucket a stand-in of the first batch fits was warmed up after the first step, outside the timed steps.
    prepared = result["prepare_buckets"]
    assert prepared["buckets"] and set(prepared["buckets"]) <= {33, 35, 64} and prepared["compiled"] == []
    assert result["steps_run"] == 3 and len(result["trace"]["times"]) == 3 and min(result["trace"]["times"]) > 0
    assert result["trace"]["timeline"] == {"steps": 1, "device_activity": False}  # a CPU run has no device
    comparison = result["loss_comparison"]
    assert comparison["same_batches"] and comparison["steps"] == 3 and comparison["max_abs_diff"] < 1e-5


def test_kernel_names_fall_into_their_groups():
    """Kernels outside the teacher's ranges are grouped by name (CUDA names as the H200 profiles show them)."""
    from experiments.kernel_groups import name_group

    names = {
        "nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT": "gemm",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1": "gemm",
        "aten::addmm": "gemm",
        "_bwd_dkdv_kernel": "attention",
        "_fwd_kernel": "attention",
        "_ln_fwd_kernel": "elementwise_norm",
        "_modulate_bwd_kernel": "elementwise_norm",
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>": "elementwise_norm",
        "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float, true>": "elementwise_norm",
        "Memcpy HtoD (Pinned -> Device)": "other",
        "_adamw_kernel": "optimizer",
        "_multi_copy_kernel": "optimizer",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>": "optimizer",
    }
    assert {n: name_group(n) for n in names} == names


def test_kernels_the_device_ran_but_no_group_holds_are_listed():
    """The device's own records against the groups' credit: a kernel linked to no host op (here `_adamw_kernel`,
    absent from the breakdown) and one credited only in part are listed per step; fully credited ones and
    differences below the threshold are not."""
    from experiments.kernel_groups import unattributed_kernels

    breakdown = {"top_kernels": [
        {"name": "_ln_bwd_kernel", "group": "elementwise_norm", "ms_per_step": 4.0, "launches_per_step": 102},
        {"name": "gemm_a", "group": "gemm", "ms_per_step": 1.0, "launches_per_step": 2},
        {"name": "gemm_a", "group": "attention", "ms_per_step": 0.5, "launches_per_step": 1},
        {"name": "Memset (Device)", "group": "other", "ms_per_step": 0.25, "launches_per_step": 300},
    ]}
    device_us = {"_ln_bwd_kernel": 12_000.0, "gemm_a": 4_500.0 + 600.0, "_adamw_kernel": 10_500.0,
                 "Memset (Device)": 750.0 + 30.0}
    missing = unattributed_kernels(device_us, breakdown, steps=3)
    assert [k["name"] for k in missing] == ["_adamw_kernel", "gemm_a"]
    assert missing[0]["ms_per_step"] == pytest.approx(3.5) and missing[1]["ms_per_step"] == pytest.approx(0.2)
    assert unattributed_kernels({}, breakdown, steps=3) == []


def test_kernels_no_group_holds_join_the_group_their_names_give():
    """With them added by name the groups add up to the device's own kernel time: the optimizer's update kernel
    (linked to no host op) joins the optimizer's group, a GEMM credited in part the GEMMs'."""
    from experiments.kernel_groups import GROUPS, with_unattributed

    groups = {g: 0.0 for g in GROUPS} | {"gemm": 1.0, "optimizer": 0.25, "elementwise_norm": 4.0}
    missing = [{"name": "_adamw_kernel", "ms_per_step": 3.5}, {"name": "nvjet_sm90_tst_128x128", "ms_per_step": 0.2}]
    added = with_unattributed({"groups_ms_per_step": groups}, missing)
    assert added["optimizer"] == pytest.approx(3.75) and added["gemm"] == pytest.approx(1.2)
    assert added["elementwise_norm"] == 4.0 and groups["optimizer"] == 0.25
    assert sum(added.values()) == pytest.approx(sum(groups.values()) + 3.7)


class _DeviceEvent:
    def __init__(self, name, device, annotation, us):
        self._name, self._device, self._annotation, self._us = name, device, annotation, us

    def name(self):
        return self._name

    def device_type(self):
        return self._device

    def is_user_annotation(self):
        return self._annotation

    def start_ns(self):
        return 1_000

    def end_ns(self):
        return 1_000 + int(self._us * 1e3)


def test_device_records_keep_kernels_and_drop_the_ranges_device_spans():
    """A ``record_function`` range (``gem.attention``, ``Optimizer.step#...``) also leaves a span on the device's
    timeline; it is not a kernel and must not be listed as one no group holds."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from experiments.kernel_groups import device_kernel_us

    events = [_DeviceEvent("_adamw_kernel", DeviceType.CUDA, False, 30.0),
              _DeviceEvent("_adamw_kernel", DeviceType.CUDA, False, 10.0),
              _DeviceEvent("gem.attention", DeviceType.CUDA, True, 500.0),
              _DeviceEvent("Optimizer.step#MasterAdamW.step", DeviceType.CUDA, True, 900.0),
              _DeviceEvent("aten::mm", DeviceType.CPU, False, 70.0)]
    prof = SimpleNamespace(profiler=SimpleNamespace(kineto_results=SimpleNamespace(events=lambda: events)))
    assert device_kernel_us(prof) == {"_adamw_kernel": pytest.approx(40.0)}


def test_ab_teacher_alternates_the_trees_and_reads_the_losses_of_the_same_batches(tmp_path):
    """Two pairs of runs, base first then this tree first; the repository against itself on the CPU: the same
    batches and losses (differences 0), medians per tree, every run's JSON kept."""
    from experiments import ab_teacher

    assert ab_teacher.run_order(3) == [(0, "base"), (0, "this"), (1, "this"), (1, "base"), (2, "base"), (2, "this")]
    out = tmp_path / "ab.json"
    bench = (f"--flavor debug --steps 2 --rows 256 --examples 2000 --token-budget 2048 --workers 0 --device cpu "
             f"--data {tmp_path / 'world'}")
    assert ab_teacher.main(["--base", str(ab_teacher.REPO), "--lengths", "64", "--pairs", "2", "--bench-args", bench,
                            "--json", str(out), "--", "dropout=0.0"]) == 0
    result = json.loads(out.read_text())
    length = result["lengths"]["64"]
    assert [(r["pair"], r["tree"], r["status"]) for r in length["runs"]] == [
        (0, "base", "done"), (0, "this", "done"), (1, "this", "done"), (1, "base", "done")]
    assert all(r["step_ms_median"] > 0 for r in length["runs"])
    assert length["median_step_ms"]["base"] > 0 and length["change"] is not None
    diffs = length["loss_vs_base"] + length["loss_noise"]["base"] + length["loss_noise"]["this"]
    assert len(diffs) == 4
    assert all(d["same_batches"] and d["steps"] == 2 and d["max_abs_diff"] == 0.0 for d in diffs)


def test_ab_teacher_skips_runs_past_its_budget_and_refuses_a_base_that_is_not_the_repository(tmp_path, capsys):
    from experiments import ab_teacher

    out = tmp_path / "ab.json"
    assert ab_teacher.main(["--base", str(ab_teacher.REPO), "--lengths", "512", "--pairs", "1", "--budget", "-1",
                            "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["lengths"]["512"]["runs"]
    assert [r["status"].split(":")[0] for r in runs] == ["skipped", "skipped"]
    with pytest.raises(SystemExit, match="not a copy of the repository"):
        ab_teacher.main(["--base", str(tmp_path), "--lengths", "512"])
