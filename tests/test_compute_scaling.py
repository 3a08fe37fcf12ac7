"""The compute-scaling sweep's dry run on CPU (prepare, runs, summary, combine, merge, plot) and its pieces:
balanced shards, world reuse, one-line errors."""

from __future__ import annotations

import dataclasses
import json
import tarfile
import time

import pytest
import torch

from experiments.compute_scaling import (
    PLANS,
    build_parser,
    flops_per_example,
    main,
    parse_shard,
    plan_runs,
    prepare,
    run_budget,
    shard_runs,
)
from foundation.data.schema import EventSchema
from foundation.data.synthetic import build_schema


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    """The dry plan run as one shard: ``(tmp dir, its summary)``."""
    tmp = tmp_path_factory.mktemp("scaling")
    argv = ["run", "--plan", "dry", "--world", str(tmp / "world"), "--out", str(tmp / "out"), "--device", "cpu",
            "--workers", "1", "--bundle", str(tmp / "bundle"), "--call-budget", "400", "--poll", "0.2"]
    assert main(argv) == 0
    return tmp, json.loads((tmp / "out" / "summary.json").read_text())


def test_dry_run_trains_every_size_and_counts_its_flops(dry):
    tmp, summary = dry
    plan = PLANS["dry"]()
    assert {r["name"] for r in summary["runs"]} == {r.name for r in plan_runs(plan)}
    assert all(r["status"] == "ok" for r in summary["runs"]), summary["runs"]
    for run in summary["runs"]:
        assert run["train_rows"] == plan.steps * plan.batch_rows
        assert run["train_flops"] == pytest.approx(run["flops_per_example"] * run["train_rows"])
        assert run["train_flops_at_best"] == run["train_flops"]  # one epoch
        assert run["test"]["click/ne"] > 0 and set(run["per_domain"]) == {"feed", "reels", "marketplace"}
    # The DLRM's FLOPs per row do not depend on the batch: what its runs counted step by step is the config's.
    schema = EventSchema.load(tmp / "world")
    for size in (s for s in plan.sizes if s.family == "dlrm"):
        (row,) = [r for r in summary["runs"] if r["size"] == size.name]
        assert row["flops_per_example"] == pytest.approx(flops_per_example(size, schema, torch.tensor([0, 5])))
    for family in ("teacher", "dlrm"):
        rows = [g for g in summary["rows"] if g["model"] == family]
        assert len(rows) == 2
        small, large = sorted(rows, key=lambda g: g["parameters"])
        assert large["flops_per_example"] > 2 * small["flops_per_example"]
        assert large["train_flops"] > small["train_flops"]
        assert {"seeds", "click_ne_mean", "click_ne_std", "click_auc_mean", "per_domain", "command", "date",
                "data"} <= set(large)
    assert summary["world"]["oracle_test"]["click"]["ne"] < 1
    with tarfile.open(tmp / "bundle" / "runs-0of1.tar.gz") as tar:
        names = tar.getnames()
    assert {f"runs-0of1/{r['name']}/result.json" for r in summary["runs"]} <= set(names)


def test_combine_merge_and_plot_from_the_bundle(dry, tmp_path):
    tmp, summary = dry
    bundled = tmp / "bundle" / "summary-0of1.json"
    half = json.loads(bundled.read_text())
    half["runs"], half["shard"] = half["runs"][:2], "0/2"
    other = {**half, "runs": summary["runs"][2:], "shard": "1/2"}
    (tmp_path / "a.json").write_text(json.dumps(half))
    (tmp_path / "b.json").write_text(json.dumps(other))
    assert main(["combine", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(tmp_path / "s.json")]) == 0
    combined = json.loads((tmp_path / "s.json").read_text())
    assert combined["rows"] == summary["rows"] and combined["missing"] == []
    assert main(["combine", str(tmp_path / "a.json"), "--out", str(tmp_path / "half.json")]) == 0
    assert json.loads((tmp_path / "half.json").read_text())["missing"] == sorted(r["name"] for r in other["runs"])
    # The same run in two shards is refused.
    assert main(["combine", str(tmp_path / "a.json"), str(tmp_path / "a.json"), "--out", str(tmp_path / "x.json")]) == 2

    results = tmp_path / "results" / "teacher_vs_dlrm.json"
    results.parent.mkdir()
    stale = {**summary["rows"][0], "click_ne_mean": 9.0}
    other_world = {**summary["rows"][0], "data": "another world"}
    results.write_text(json.dumps({"rows": [stale, other_world]}))
    assert main(["merge", str(tmp_path / "s.json"), str(results)]) == 0
    rows = json.loads(results.read_text())["rows"]
    assert other_world in rows and stale not in rows and len(rows) == 1 + len(summary["rows"])

    png = tmp_path / "docs" / "scaling.png"
    assert main(["plot", str(tmp_path / "s.json"), str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_world_reused_when_the_same_and_refused_when_not(dry):
    tmp, _ = dry
    plan = PLANS["dry"]()
    before = (tmp / "world" / "synth.json").stat().st_mtime_ns
    assert prepare(plan, tmp / "world", workers=1) == tmp / "world"
    assert (tmp / "world" / "synth.json").stat().st_mtime_ns == before
    other = dataclasses.replace(plan, world=dataclasses.replace(plan.world, seed=1))
    with pytest.raises(ValueError, match=r"another world \(differs in \['seed'\]\)"):
        prepare(other, tmp / "world", workers=1)


def test_shards_split_the_plan_once_and_balance_it():
    plan = PLANS["scaling"]()
    runs = plan_runs(plan)
    seconds = {"teacher": 100.0, "dlrm": 20.0}
    costs = {r.size_key: {"seconds": seconds[r.size.family] * (1 + len(r.size.name))} for r in runs}
    shards = [shard_runs(runs, costs, i, 2) for i in range(2)]
    assert sorted(r.name for s in shards for r in s) == sorted(r.name for r in runs)
    loads = [sum(costs[r.size_key]["seconds"] for r in s) for s in shards]
    assert abs(loads[0] - loads[1]) <= max(c["seconds"] for c in costs.values())
    assert shard_runs(runs, costs, 1, 2) == shards[1]
    assert len({r.size_key for r in runs if r.size.family == "teacher"}) >= 4
    assert len({r.size_key for r in runs if r.size.family == "dlrm"}) >= 3 and plan.seeds == (0, 1, 2)


def test_scaling_plan_spans_ten_times_the_teacher_flops():
    plan = PLANS["scaling"]()
    schema = build_schema(plan.world)
    offsets = torch.tensor([0, 20, 120, 446, 1470])  # histories of 20, 100, 326 and 1,024 events
    teacher = [flops_per_example(s, schema, offsets) for s in plan.sizes if s.family == "teacher"]
    dlrm = [flops_per_example(s, schema, offsets) for s in plan.sizes if s.family == "dlrm"]
    assert teacher == sorted(teacher) and dlrm == sorted(dlrm)
    assert teacher[-1] > 10 * teacher[0] and dlrm[-1] > 10 * dlrm[0]


def test_run_budget_leaves_grace_before_the_call_ends():
    def args(*extra):
        return build_parser().parse_args(["run", "--world", "w", "--out", "o", "--grace", "100", *extra])

    now = time.monotonic()
    assert run_budget(args(), now) == 0  # no limit at all
    assert run_budget(args("--time-budget", "300"), now) == 300
    assert 339 < run_budget(args("--call-budget", "560"), now - 120) <= 340  # 120 s spent generating the world
    assert run_budget(args("--call-budget", "560", "--time-budget", "200"), now) == 200
    assert run_budget(args("--call-budget", "560"), now - 600) == 1.0  # too late: one second, then score


@pytest.mark.parametrize("text", ["2/2", "1", "a/2", "3/x"])
def test_bad_shard_is_a_one_line_error(text, tmp_path, capsys):
    with pytest.raises(ValueError, match="expected I/N"):
        parse_shard(text)
    argv = ["run", "--plan", "dry", "--world", str(tmp_path / "w"), "--out", str(tmp_path / "o"), "--shard", text]
    assert main(argv) == 2
    assert capsys.readouterr().err.count("\n") == 1
