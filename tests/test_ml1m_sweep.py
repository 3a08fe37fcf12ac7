"""The ML-1M sweep driver: plans, run lists, dataset preparation, concurrent runs (one trains, one fails,
one outlives its budget), the summary rows and their merge into a results file."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from experiments.ml1m_sweep import (
    RATINGS,
    SEQUENCES,
    RunSpec,
    check_runs,
    first_users,
    group_rows,
    load_runs,
    main,
    parse_env,
    plan_runs,
    prepare_dataset,
)
from tests.test_teacher_ml1m import shared_ml1m

REPO = Path(__file__).resolve().parents[1]


def write_raw(raw: Path, users: int = 12) -> Path:
    """``sequences.tsv`` and a timestamped ratings file of the same users, with ties on the last two events."""
    raw.mkdir(parents=True, exist_ok=True)
    seqs = {u: [(7 * u + 3 * i) % 30 + 1 for i in range(6 + u % 5)] for u in range(1, users + 1)}
    seqs = {u: list(dict.fromkeys(items)) for u, items in seqs.items()}
    (raw / SEQUENCES).write_text("".join(f"{u}\t{' '.join(map(str, s))}\n" for u, s in seqs.items()))
    ratings = []
    for u, items in seqs.items():
        times = list(range(1000, 1000 + 10 * len(items), 10))
        times[-1] = times[-2]  # the last two events tie
        ratings += [f"{u}::{item}::4::{t}\n" for item, t in reversed(list(zip(items, times, strict=True)))]
    (raw / RATINGS).write_bytes(gzip.compress("".join(ratings).encode()))
    return raw


def test_plans():
    calibration = plan_runs("calibration", [0, 1, 2])
    assert {(r.flavor, r.data, r.variant) for r in calibration} == {
        (f, "sequences", "default") for f in ("sasrec", "ml1m_hstu", "ml1m_hstu_large")
    }
    assert len(calibration) == 9
    timebias = plan_runs("timebias", [0, 1, 2])
    assert {r.variant for r in timebias} == {"default", "query_time=event"} and {r.data for r in timebias} == {"ratings"}
    assert {r.flavor for r in plan_runs("timebias-large", [0])} == {"ml1m_hstu_large"}
    suspects = plan_runs("suspects", [0, 1, 2])
    assert {r.variant for r in suspects} == {
        "attention_norm=211", "attention_norm=row", "GEM_KERNELS_FAST_SIGMOID=0", "negative_pool=used"
    }
    assert {r.flavor for r in suspects} == {"ml1m_hstu"} and len(suspects) == 12
    realtime = plan_runs("realtime", [0, 1, 2])
    assert {(r.flavor, r.data, r.variant) for r in realtime} == {
        (f, d, "default") for f in ("ml1m_hstu", "ml1m_hstu_large") for d in ("ratings", "sequences")
    } and len(realtime) == 12
    more = plan_runs("realtime-more", [0, 1, 2])
    assert {(r.flavor, r.data, r.variant) for r in more} == {
        ("sasrec", "ratings", "default"), ("sasrec", "sequences", "default"), ("ml1m_hstu_large", "ratings", "time_buckets=0")
    } and len(more) == 9
    with pytest.raises(ValueError, match="unknown plan"):
        plan_runs("everything", [0])


def test_run_lists_and_their_errors(tmp_path):
    path = tmp_path / "runs.json"
    path.write_text(json.dumps([{"flavor": "sasrec", "seed": 3}, {"flavor": "ml1m_hstu", "seed": 0, "data": "ratings",
                                                                   "overrides": ["num_negatives=512"], "env": {"B": "2", "A": "1"}}]))
    first, second = load_runs(path)
    assert first == RunSpec("sasrec", 3)
    assert second.env == (("A", "1"), ("B", "2")) and second.variant == "num_negatives=512 A=1 B=2"
    assert second.name == "ml1m_hstu.ratings.num_negatives-512_A-1_B-2.s0"
    check_runs([first, second])
    path.write_text(json.dumps([{"flavor": "sasrec"}]))
    with pytest.raises(ValueError, match=r"runs\.json: run 0: a run needs flavor and seed"):
        load_runs(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        load_runs(path)
    with pytest.raises(ValueError, match="unknown flavor"):
        check_runs([RunSpec("gpt", 0)])
    with pytest.raises(ValueError, match="unknown data"):
        check_runs([RunSpec("sasrec", 0, data="ml-20m")])
    assert parse_env(["A=1", "B=x=y"]) == {"A": "1", "B": "x=y"}
    with pytest.raises(ValueError, match="NAME=VALUE"):
        parse_env(["A"])


def test_datasets_are_prepared_once_and_follow_sequences(tmp_path):
    raw = write_raw(tmp_path / "raw")
    small = first_users(raw, tmp_path / "small", 5)
    assert len((small / SEQUENCES).read_text().splitlines()) == 5
    with gzip.open(small / RATINGS, "rt") as f:
        assert {line.split("::")[0] for line in f} == {"1", "2", "3", "4", "5"}
    ratings = prepare_dataset("ratings", raw, tmp_path / "out")
    stats = json.loads((ratings / "conversion.json").read_text())
    assert stats["ties"] == "sequence" and stats["tied_events"] == 24 and stats["ties_unreferenced"] == 0
    # The file lists each user's events newest first, so only the reference puts the tied pair in order.
    test = pq.read_table(ratings / "test").to_pylist()
    expected = {int(line.split("\t")[0]): line.split("\t")[1].split() for line in (raw / SEQUENCES).read_text().splitlines()}
    assert {r["user_id"]: [*map(str, r["history_item_ids"]), str(r["item_id"])] for r in test} == expected
    assert main(["run", "--raw", str(raw), "--out", str(tmp_path / "out"), "--plan", "calibration", "--prepare-only"]) == 0
    sequences = prepare_dataset("sequences", raw, tmp_path / "out")
    assert not (tmp_path / "out" / "runs").exists()
    assert prepare_dataset("sequences", raw, tmp_path / "out") == sequences  # reused
    with pytest.raises(ValueError, match="use another --out"):
        prepare_dataset("sequences", small, tmp_path / "out")


def test_group_rows_average_seeds_and_keep_the_format():
    runs = [
        {"flavor": "sasrec", "data": "d", "variant": "default", "seed": s, "epochs": 100,
         "test": {"hr10": hr, "ndcg10": hr / 2},
         "best_valid": {"ndcg10": {"epoch": 50 + s, "test": {"hr10": hr + 0.01, "ndcg10": hr / 2}}}}
        for s, hr in ((1, 0.30), (0, 0.28), (2, 0.29))
    ] + [{"flavor": "sasrec", "data": "d", "variant": "default", "seed": 3, "status": "killed"}]
    (row,) = group_rows(runs, "python -m experiments.ml1m_sweep run ...", "2026-12-01")
    assert list(row)[:8] == ["flavor", "data", "seeds", "hr@10_mean", "hr@10_std", "ndcg@10_mean", "command", "date"]
    assert row["seeds"] == [0, 1, 2] and row["hr@10_mean"] == 0.29 and row["hr@10_std"] == 0.01
    assert row["ndcg@10_mean"] == 0.145 and row["epochs"] == [100, 100, 100]
    assert row["best_valid"]["hr@10_mean"] == 0.3 and row["best_valid"]["epochs"] == [50, 51, 52]


def test_sweep_runs_concurrently_and_summarises(tmp_path, capsys, monkeypatch):
    """Three processes at once: one trains, one fails on a bad override, one is killed past its budget."""
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    raw = write_raw(tmp_path / "raw")
    runs = tmp_path / "runs.json"
    runs.write_text(json.dumps([
        {"flavor": "ml1m_hstu", "seed": 0, "data": "ratings"},
        {"flavor": "sasrec", "seed": 0, "overrides": ["no_such_field=1"]},
    ]))
    out = tmp_path / "sweep"
    common = ["--raw", str(raw), "--out", str(out), "--epochs", "1", "--max-steps", "1", "--batch-size", "4",
              "--device", "cpu", "--poll", "0.2"]
    assert main(["run", *common, "--runs", str(runs), "--parallel", "2", "--time-budget", "600"]) == 1
    summary = json.loads((out / "summary.json").read_text())
    by_name = {r["name"]: r for r in summary["runs"]}
    good, bad = by_name["ml1m_hstu.ratings.default.s0"], by_name["sasrec.sequences.no_such_field-1.s0"]
    assert good["status"] == "ok" and good["epochs"] == 1 and 0 <= good["test"]["hr10"] <= 1
    assert good["env"] == {} and "--flavor ml1m_hstu" in good["command"]
    assert bad["status"] == "failed" and bad["rc"] != 0 and "no_such_field" in Path(bad["log"]).read_text()
    (row,) = summary["rows"]
    assert row["flavor"] == "ml1m_hstu" and row["data"] == f"{RATINGS} (ties=sequence)" and row["seeds"] == [0]
    assert row["command"].startswith("python -m experiments.ml1m_sweep run --raw")
    assert summary["env"]["OMP_NUM_THREADS"] == "1" and summary["env"]["GEM_KERNELS_AUTOTUNE"] == "0"
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1] == f"1/2 runs ok; summary {out / 'summary.json'}"
    assert any(line.startswith("run sasrec.sequences.no_such_field-1.s0: failed") for line in printed)

    killed_out = tmp_path / "killed"
    args = ["run", *common[:2], "--out", str(killed_out), *common[4:], "--plan", "calibration", "--seeds", "0"]
    assert main([*args, "--parallel", "3", "--time-budget", "0.01", "--grace", "0", "--env", "EXTRA=1"]) == 1
    summary = json.loads((killed_out / "summary.json").read_text())
    assert {r["status"] for r in summary["runs"]} == {"killed"} and summary["rows"] == []
    assert summary["env"]["EXTRA"] == "1"


def test_merge_replaces_rows_of_the_same_flavor_data_and_variant(tmp_path):
    results = tmp_path / "ml1m.json"
    results.write_text(json.dumps({"rows": [
        {"flavor": "ml1m_hstu", "data": "sequences.tsv", "hr@10_mean": 0.2897},
        {"flavor": "sasrec", "data": "sequences.tsv", "variant": "default", "hr@10_mean": 0.1},
    ]}))
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"rows": [{"flavor": "sasrec", "data": "sequences.tsv", "variant": "default",
                                             "hr@10_mean": 0.28}]}))
    assert main(["merge", str(summary), str(results)]) == 0
    rows = json.loads(results.read_text())["rows"]
    assert [(r["flavor"], r["hr@10_mean"]) for r in rows] == [("ml1m_hstu", 0.2897), ("sasrec", 0.28)]


@pytest.mark.data
@pytest.mark.skipif(not shared_ml1m().is_file(), reason="ML-1M sequences.tsv not present (../shared/data)")
def test_first_users_of_the_real_files(tmp_path):
    raw = shared_ml1m().parent
    small = first_users(raw, tmp_path / "raw", 3)
    users = [line.split("\t")[0] for line in (small / SEQUENCES).read_text().splitlines()]
    assert users == ["1", "2", "3"]
    if (raw / RATINGS).is_file():
        stats = json.loads((prepare_dataset("ratings", small, tmp_path / "out") / "conversion.json").read_text())
        assert stats["users"] == 3 and stats["ties_unreferenced"] == 0
