"""The compute-scaling sweep's dry run on CPU (prepare, runs, summary, combine, merge, plot) and its pieces:
balanced shards, world reuse, one-line errors."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import tarfile
import time

import pytest
import torch

from experiments import scaling_run, teacher_vs_baseline
from experiments.compute_scaling import (
    FAMILIES,
    PLANS,
    WORLD_TRAIN_ROWS,
    Run,
    build_parser,
    check_rows,
    estimated_seconds,
    flops_per_example,
    main,
    parse_shard,
    plan_runs,
    prepare,
    rows_label,
    run_budget,
    run_command,
    shard_runs,
    shard_weights,
    width_scaled_lr,
)
from foundation.config import apply_overrides
from foundation.data.schema import EventSchema
from foundation.data.synthetic import build_schema
from gem.flavors import get_flavor


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
    sizes = {Run(size, 0).size_key: size for size in (*plan.sizes, *plan.probes)}
    for run in summary["runs"]:
        assert run["train_rows"] == plan.steps * plan.batch_rows and run["stopped_by"] == "steps"
        # Each run trained at its size's peak rate, warmed up, then decayed towards a tenth of it.
        assert run["lr"] == pytest.approx(sizes[f"{run['model']}-{run['size']}"].lr)
        curve = [c["lr"] for c in run["curve"]]
        assert curve[0] < run["lr"] and max(curve) == pytest.approx(run["lr"]) and curve[-1] < run["lr"]
        assert run["train_flops"] == pytest.approx(run["flops_per_example"] * run["train_rows"])
        assert run["train_flops_at_best"] == run["train_flops"]  # one epoch
        assert run["test"]["click/ne"] > 0 and set(run["per_domain"]) == {"feed", "reels", "marketplace"}
    # The DLRM's FLOPs per row do not depend on the batch: what its runs counted step by step is the config's.
    schema = EventSchema.load(tmp / "world")
    for size in (s for s in plan.sizes if s.family == "dlrm"):
        (row,) = [r for r in summary["runs"] if r["size"] == size.name]
        assert row["flops_per_example"] == pytest.approx(flops_per_example(size, schema, torch.tensor([0, 5])))
    for family in ("teacher", "dlrm"):
        rows = [g for g in summary["rows"] if g["model"] == family and not g["probe"]]
        assert len(rows) == 2
        small, large = sorted(rows, key=lambda g: g["parameters"])
        assert large["flops_per_example"] > 2 * small["flops_per_example"]
        assert large["train_flops"] > small["train_flops"]
        assert {"seeds", "click_ne_mean", "click_ne_std", "click_auc_mean", "per_domain", "command", "date",
                "data"} <= set(large)
        assert large["device"] == summary["device"] == "cpu"
    assert summary["world"]["oracle_test"]["click"]["ne"] < 1
    probes = {g["size"].split("@")[1]: g for g in summary["rows"] if g["probe"]}
    assert set(probes) == {"lr2x", "recent8"} and all(g["seeds"] == [0] for g in probes.values())
    base = {g["size"]: g for g in summary["rows"] if not g["probe"]}
    assert probes["lr2x"]["lr"] == pytest.approx(2 * base[probes["lr2x"]["size"].split("@")[0]]["lr"])
    assert probes["recent8"]["probe"] == "model.teacher.num_recent=8"
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
    # The same run in two shards is refused, unless one copy was cut by time: the complete one (a rerun) stays.
    assert main(["combine", str(tmp_path / "a.json"), str(tmp_path / "a.json"), "--out", str(tmp_path / "x.json")]) == 2
    cut = {**half, "runs": [{**r, "stopped_by": "time", "test": {**r["test"], "click/ne": 9.0}} for r in half["runs"]]}
    (tmp_path / "cut.json").write_text(json.dumps(cut))
    paths = [str(tmp_path / n) for n in ("cut.json", "a.json", "b.json")]
    assert main(["combine", *paths, "--out", str(tmp_path / "rerun.json")]) == 0
    assert json.loads((tmp_path / "rerun.json").read_text())["rows"] == summary["rows"]
    (tmp_path / "cut2.json").write_text(json.dumps({**cut, "shard": "9/9"}))
    assert main(["combine", str(tmp_path / "cut.json"), str(tmp_path / "cut2.json"), "--out", str(tmp_path / "x.json")]) == 2

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
    # Runs cut by their time budget (drawn hollow until a rerun replaces them) plot too.
    assert main(["plot", str(tmp_path / "cut.json"), str(tmp_path / "cut.png")]) == 0
    assert (tmp_path / "cut.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Another data budget on the same world beside it; a summary of another world is refused in one line.
    more = {**combined, "runs": [{**r, "train_rows": 2 * r["train_rows"]} for r in combined["runs"]]}
    assert rows_label(more) == f"{2 * combined['runs'][0]['train_rows'] / 1000:.0f}k rows"
    (tmp_path / "more.json").write_text(json.dumps(more))
    assert main(["plot", str(tmp_path / "s.json"), str(png), "--also", str(tmp_path / "more.json")]) == 0
    elsewhere = {**more, "world": {"oracle_test": {"click": {"ne": 0.5}}}}
    (tmp_path / "elsewhere.json").write_text(json.dumps(elsewhere))
    assert main(["plot", str(tmp_path / "s.json"), str(png), "--also", str(tmp_path / "elsewhere.json")]) == 2


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


def test_trained_plan_meets_the_issue_and_reads_no_row_twice():
    plan = PLANS["trained"]()
    schema = build_schema(plan.world)
    offsets = torch.tensor([0, 20, 120, 446, 1470])
    teacher = [s for s in plan.sizes if s.family == "teacher"]
    dlrm = [s for s in plan.sizes if s.family == "dlrm"]
    assert len(teacher) >= 4 and len(dlrm) >= 3 and plan.seeds == (0, 1, 2)
    flops = [flops_per_example(s, schema, offsets) for s in teacher]
    assert flops == sorted(flops) and flops[-1] > 10 * flops[0]
    # Wider models get lower peak rates, within each family.
    for family in (teacher, dlrm):
        assert all(a.lr > b.lr for a, b in itertools.pairwise(family))
    assert plan.schedule is not None and plan.train_rows <= plan.world.num_examples * plan.world.split_fractions[0]
    probes = [r for r in plan_runs(plan) if r.size.probe]
    assert probes and {r.seed for r in probes} == {0}
    assert {r.size.name.split("@")[0] for r in probes} >= {teacher[-1].name, dlrm[-1].name}
    assert len(plan.shard_weights) == 2


def test_width_scaled_rates():
    assert width_scaled_lr(2e-3, 32, 32) == 2e-3
    assert width_scaled_lr(2e-3, 32, 128) == pytest.approx(1e-3)
    assert width_scaled_lr(4e-3, 32, 2048) == pytest.approx(5e-4)


def test_recent_plan_runs_its_duel_on_five_seeds_and_gives_the_teacher_recent_tokens():
    plan = PLANS["recent"]()
    runs = plan_runs(plan)
    seeds: dict[str, set[int]] = {}
    for run in runs:
        if not run.size.probe:
            seeds.setdefault(run.size_key, set()).add(run.seed)
    assert {k for k, v in seeds.items() if len(v) == 5} == set(plan.duel)
    assert all(v == {0, 1, 2} for k, v in seeds.items() if k not in plan.duel)
    assert len({r.name for r in runs}) == len(runs)
    trained = {s.name: s.lr for s in PLANS["trained"]().sizes}
    for size in plan.sizes:
        assert size.lr == pytest.approx(2 * trained[size.name])
        assert ("model.teacher.num_recent=8" in size.overrides) == (size.family == "teacher")
    with pytest.raises(ValueError, match="duel names sizes"):
        plan_runs(dataclasses.replace(plan, duel=("teacher-w999-l1",)))


def test_recent_data_plan_reads_twice_the_rows_once():
    plan, recent = PLANS["recent-data"](), PLANS["recent"]()
    assert plan.train_rows == 2 * recent.train_rows <= plan.world.num_examples * plan.world.split_fractions[0]
    assert "614k rows" in plan.label and plan.world == recent.world
    assert {s.family for s in plan.sizes} == set(FAMILIES) and set(plan.sizes) <= set(recent.sizes)


def test_data2x_plan_spans_ten_times_the_flops_and_runs_the_duel_on_five_seeds():
    plan = PLANS["data2x"]()
    schema = build_schema(plan.world)
    offsets = torch.tensor([0, 20, 120, 446, 1470])
    flops = [flops_per_example(s, schema, offsets) for s in plan.sizes if s.family == "teacher"]
    assert len(flops) >= 4 and flops == sorted(flops) and flops[-1] > 10 * flops[0]
    assert len([s for s in plan.sizes if s.family == "dlrm"]) >= 3
    assert plan.train_rows == 2 * PLANS["recent"]().train_rows <= plan.world.num_examples * plan.world.split_fractions[0]
    seeds: dict[str, set[int]] = {}
    for run in plan_runs(plan):
        seeds.setdefault(run.size_key, set()).add(run.seed)
    assert {k for k, v in seeds.items() if len(v) == 5} == set(plan.duel)


def test_data4x_plan_reads_four_times_the_third_sweeps_rows_once():
    plan, data2x = PLANS["data4x"](), PLANS["data2x"]()
    assert plan.train_rows == 2 * data2x.train_rows <= plan.world.num_examples * plan.world.split_fractions[0]
    assert plan.world == data2x.world and "1229k rows" in plan.label and "614k" not in plan.label
    assert {f"{s.family}-{s.name}" for s in plan.sizes} == {
        "teacher-w32-l2", "teacher-w64-l2", "teacher-w128-l3", "dlrm-d128", "dlrm-d2048"
    }


def test_data_passes_plan_reads_the_whole_split_twice(tmp_path):
    plan, data4x = PLANS["data-passes"](), PLANS["data4x"]()
    assert plan.steps == 2 * math.ceil(WORLD_TRAIN_ROWS / 512) == 6254 and plan.batch_rows == 512
    assert plan.passes == 2 and plan.split_rows == WORLD_TRAIN_ROWS and data4x.passes == 1
    assert 2 * WORLD_TRAIN_ROWS <= plan.train_rows < 2 * WORLD_TRAIN_ROWS + 2 * 512
    assert plan.world == data4x.world and plan.sizes == data4x.sizes and plan.seeds == (0, 1, 2)
    assert plan.schedule == data4x.schedule and "2 passes over the 1601k train rows" in plan.label
    assert "1229k" not in plan.label and plan.label != data4x.label
    assert [r.name for r in plan_runs(plan)] == [r.name for r in plan_runs(data4x)]  # 5 sizes x 3 seeds
    args = build_parser().parse_args(["run", "--plan", "data-passes", "--world", "w", "--out", "o"])
    for run in plan_runs(plan):
        command = run_command(run, tmp_path, tmp_path / "r.json", plan, 300.0, args)
        assert command[command.index("--passes") + 1] == "2" and command[command.index("--steps") + 1] == "6254"
        parsed = scaling_run.build_parser().parse_intermixed_args(command[3:])
        assert parsed.passes == 2 and parsed.steps == 6254 and parsed.warmup_steps == round(0.05 * 6254)
    # One pass stays the runner's default: the other plans' commands are as they were.
    assert "--passes" not in run_command(plan_runs(data4x)[0], tmp_path, tmp_path / "r.json", data4x, 300.0, args)


def test_data_fresh_plan_reads_as_many_rows_as_data_passes_all_distinct(tmp_path):
    """Same sizes, seeds, schedule and (within 1%) rows as two passes over the 2M world, on a world of twice the
    impressions read once; its rows fit one pass of that world's train split with room for regeneration noise."""
    plan, passes = PLANS["data-fresh"](), PLANS["data-passes"]()
    assert plan.world.num_examples == 2 * passes.world.num_examples == 4_000_000
    assert plan.world.num_users == passes.world.num_users
    assert dataclasses.replace(plan.world, num_examples=passes.world.num_examples) == passes.world
    assert set(passes.sizes) < set(plan.sizes) and plan.seeds == passes.seeds and plan.schedule == passes.schedule
    # Plus the ends of data2x's ladders: the issue's figure (>= 4 teacher sizes over >= 10x FLOPs, >= 3 DLRM sizes).
    schema = build_schema(plan.world)
    offsets = torch.tensor([0, 20, 120, 446, 1470])
    flops = [flops_per_example(s, schema, offsets) for s in plan.sizes if s.family == "teacher"]
    assert len(flops) == 4 and flops == sorted(flops) and flops[-1] > 10 * flops[0]
    assert len([s for s in plan.sizes if s.family == "dlrm"]) == 3
    assert plan.passes == 1 and plan.split_rows == 0
    assert 0.99 * passes.train_rows < plan.train_rows < 2 * WORLD_TRAIN_ROWS * 0.995
    assert "4M impressions" in plan.label and "one pass" in plan.label and "2 passes" not in plan.label
    args = build_parser().parse_args(["run", "--plan", "data-fresh", "--world", "w", "--out", "o"])
    command = run_command(plan_runs(plan)[0], tmp_path, tmp_path / "r.json", plan, 300.0, args)
    assert command[command.index("--steps") + 1] == "6200" and "--passes" not in command


def test_passes_are_checked_against_the_world(dry):
    tmp, summary = dry
    have = summary["world"]["rows"]["train"]
    plan = PLANS["dry"]()
    whole = math.ceil(have / plan.batch_rows)
    twice = dataclasses.replace(plan, steps=2 * whole, passes=2, split_rows=have)
    check_rows(twice, tmp / "world")  # the whole split, twice (the last batch of each pass short)
    with pytest.raises(ValueError, match=rf"trains \d+ rows, .* has {have} train rows \(at most 2 passes\)"):
        check_rows(dataclasses.replace(twice, steps=2 * whole + 1), tmp / "world")
    with pytest.raises(ValueError, match=rf"2 passes over {have + 1} train rows, .* has {have} train rows"):
        check_rows(dataclasses.replace(twice, split_rows=have + 1), tmp / "world")
    with pytest.raises(ValueError, match="trains"):  # one pass reads no row twice
        check_rows(dataclasses.replace(plan, steps=have // plan.batch_rows + 1), tmp / "world")


def test_done_summaries_leave_their_finished_runs_out_of_the_shards(dry, tmp_path, capsys):
    tmp, summary = dry
    finished, cut, failed = (dict(r) for r in summary["runs"][:3])
    cut["stopped_by"], failed["status"] = "time", "failed"
    part = tmp_path / "part.json"
    part.write_text(json.dumps({**summary, "runs": [finished, cut, failed]}))
    capsys.readouterr()
    assert main(["plan", "--plan", "dry", "--world", str(tmp / "world"), "--shards", "2", "--done", str(part)]) == 0
    out = capsys.readouterr().out
    sharded = {name for line in out.splitlines() if line.startswith("shard ") for name in line.split(": ")[-1].split()}
    assert f"done before (--done): {finished['name']}" in out
    # Only a run trained to its schedule's end counts as done: a cut or failed one is run again.
    assert sharded == {r.name for r in plan_runs(PLANS["dry"]())} - {finished["name"]}

    elsewhere = {**summary, "world": {**summary["world"], "oracle_test": {}}}
    cases = {"other-plan.json": json.dumps({**summary, "plan": "trained"}),
             "other-data.json": json.dumps({**summary, "data": "another budget"}),
             "other-world.json": json.dumps(elsewhere),
             "truncated.json": json.dumps(summary)[:100],
             "list.json": "[1, 2]"}
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        assert main(["plan", "--plan", "dry", "--world", str(tmp / "world"), "--done", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"--done {tmp_path / name}" in err, err


def test_data2x_seeds_plan_completes_the_teacher_ladder_on_five_seeds():
    """With ``data2x`` (its two runs cut by time replaced by the reruns), every teacher size has seeds 0-4."""
    data2x, more = PLANS["data2x"](), PLANS["data2x-seeds"]()
    assert more.label == data2x.label and more.world == data2x.world and more.train_rows == data2x.train_rows
    extra = plan_runs(more)
    assert {r.name for r in extra} >= set(more.reruns) and set(more.reruns) <= {r.name for r in plan_runs(data2x)}
    seeds: dict[str, set[int]] = {}
    for run in plan_runs(data2x) + extra:
        seeds.setdefault(run.size_key, set()).add(run.seed)
    assert all(v == {0, 1, 2, 3, 4} for k, v in seeds.items() if k.startswith("teacher"))
    with pytest.raises(ValueError, match="rerun"):
        plan_runs(dataclasses.replace(more, reruns=("teacher-w999-l1.s0",)))


@pytest.mark.parametrize("plan_name", ["trained", "recent", "recent-data", "data2x", "data2x-seeds", "data2x-w128", "data4x",
                                       "data-passes", "data-fresh", "scaling", "dry"])
def test_every_run_command_parses_and_its_overrides_apply(plan_name, tmp_path):
    """What the GPU calls will start: each run's command line through its runner's own parser, and its
    overrides onto its flavor (argparse or a bad key must not cost a GPU call)."""
    plan = PLANS[plan_name]()
    args = build_parser().parse_args(["run", "--plan", plan_name, "--world", "w", "--out", "o"])
    for run in plan_runs(plan):
        command = run_command(run, tmp_path / "world", tmp_path / "r.json", plan, 300.0, args)
        assert command[1:3] == ["-m", "experiments.scaling_run" if plan.schedule else "experiments.teacher_vs_baseline"]
        runner = scaling_run if plan.schedule else teacher_vs_baseline
        parsed = runner.build_parser().parse_intermixed_args(command[3:])
        assert parsed.seed == run.seed and parsed.time_budget == 300.0
        if plan.schedule:
            assert parsed.steps == plan.steps and parsed.lr == pytest.approx(run.size.lr, rel=1e-5)
            assert parsed.warmup_steps == plan.schedule.warmup_steps(plan.steps) > 0
            assert parsed.final_lr_frac == plan.schedule.final_frac and parsed.passes == plan.passes
        else:
            assert parsed.max_steps == plan.steps
        cfg = apply_overrides(get_flavor(parsed.flavor), parsed.overrides)
        assert cfg.data.batch_size == plan.batch_rows and cfg.data.max_len == plan.history
        if plan_name in ("trained", "recent", "recent-data", "data2x", "data-passes", "data-fresh"):
            assert cfg.train.precision == "bf16-mixed" and cfg.data.num_workers == 2
            if run.size.family == "teacher":
                assert cfg.model.teacher.dropout == (0.1 if "dropout" in run.size.probe else 0.0)
                assert cfg.model.teacher.num_recent == (8 if plan_name in ("recent", "recent-data", "data2x", "data-passes", "data-fresh") or "recent" in run.size.name else 0)


def test_weighted_shards_follow_the_weights():
    plan = PLANS["trained"]()
    runs = plan_runs(plan)
    costs = {r.size_key: {"seconds": 10.0, "gpu_seconds": 1.0 + len(r.size.name)} for r in runs}
    shards = [shard_runs(runs, costs, i, 2, (1.0, 2.0), overlap=6.0) for i in range(2)]
    assert sorted(r.name for s in shards for r in s) == sorted(r.name for r in runs)
    loads = [sum(costs[r.size_key]["gpu_seconds"] for r in s) for s in shards]
    assert abs(loads[1] / 2 - loads[0]) <= max(c["gpu_seconds"] for c in costs.values())
    assert shard_weights(plan, None, 2) == plan.shard_weights
    assert shard_weights(plan, None, 3) == (1.0, 1.0, 1.0)
    assert shard_weights(plan, "1,4", 2) == (1.0, 4.0)
    for bad in ("1", "1,0", "a,b", "1,2,3"):
        with pytest.raises(ValueError, match="--weights"):
            shard_weights(plan, bad, 2)


def test_estimate_is_compute_or_loader_bound():
    plan = PLANS["dry"]()  # 4 steps of 64 rows; cost: 40 ms (teacher) per step, 25 TFLOP/s, 2 x 5k rows/s
    slow = estimated_seconds(plan, "teacher", 1e12, eval_rows=1024)  # 64 TFLOP per step: 2.56 s of GPU
    assert slow["gpu_seconds"] == pytest.approx((4 * 64e12 + 1024e12 / 3) / 25e12)
    assert slow["seconds"] == pytest.approx(4 * (0.04 + 2.56) + 0.04 + 1024e12 / 3 / 25e12)
    light = estimated_seconds(plan, "teacher", 1e3, eval_rows=1024)  # the loader decides: 64 rows at 10k rows/s
    assert light["seconds"] == pytest.approx(4 * 0.04 + 1024 / 1e4)  # 40 ms > 6.4 ms a step; eval 102 ms > 40 ms
    assert light["gpu_seconds"] < 1e-6


def test_plan_refuses_more_rows_than_the_split_and_extra_epochs(dry, tmp_path):
    tmp, _ = dry
    big = dataclasses.replace(PLANS["dry"](), steps=10_000)
    with pytest.raises(ValueError, match=r"trains 640000 rows, .* has \d+ train rows"):
        check_rows(big, tmp / "world")
    argv = ["run", "--plan", "dry", "--world", str(tmp / "world"), "--out", str(tmp_path / "o"), "--epochs", "2"]
    assert main(argv) == 2


def test_an_override_for_every_run_comes_last(tmp_path):
    plan = PLANS["trained"]()
    args = build_parser().parse_args(["run", "--plan", "trained", "--world", "w", "--out", "o",
                                      "--override", "train.precision=32-true", "--override", "data.num_workers=4"])
    run = plan_runs(plan)[0]
    parsed = scaling_run.build_parser().parse_intermixed_args(
        run_command(run, tmp_path, tmp_path / "r.json", plan, 10.0, args)[3:])
    cfg = apply_overrides(get_flavor(parsed.flavor), parsed.overrides)
    assert parsed.overrides[-2:] == ["train.precision=32-true", "data.num_workers=4"]
    assert cfg.train.precision == "32-true" and cfg.data.num_workers == 4  # the plan said bf16-mixed and 2
