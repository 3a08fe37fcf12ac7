"""The synthetic ads world: determinism, schema validity, the properties its ground truth promises."""

from __future__ import annotations

import errno
import threading

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

import foundation.data.synthetic as synthetic
from foundation.config import ConfigError
from foundation.data.io import list_shards, open_shard
from foundation.data.schema import EventSchema
from foundation.data.synthetic import (
    SPLITS,
    SynthConfig,
    _user_activity,
    build_schema,
    generate_world,
    make_world,
)
from foundation.data.validate import find_bad_rows
from gem.flavors import SYNTH_PRESETS, synth_preset

SMALL = {"num_users": 400, "num_examples": 3_000, "rows_per_shard": 1_000, "users_per_block": 128}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The debug world: ``(cfg, dataset_dir, stats)``."""
    cfg = synth_preset("debug")
    out = tmp_path_factory.mktemp("synth")
    return cfg, out, generate_world(cfg, out, progress=False)


def _read(path, split) -> pa.Table:
    return pa.concat_tables(pq.read_table(p) for p in list_shards(path, split))


def _flat(table: pa.Table, column: str) -> np.ndarray:
    """Values of a single-valued list column, ``[S]``."""
    return table.column(column).combine_chunks().values.to_numpy()


def test_same_seed_same_rows_and_other_seed_differs(tmp_path):
    """Also with the user blocks drawn by two worker processes: the same rows, shards and statistics."""
    cfg = synth_preset("debug", **SMALL)
    stats_a = generate_world(cfg, tmp_path / "a", progress=False)
    stats_b = generate_world(cfg, tmp_path / "b", progress=False, workers=2)
    assert {k: v for k, v in stats_a.items() if "per_s" not in k and k != "seconds"} == {
        k: v for k, v in stats_b.items() if "per_s" not in k and k != "seconds"
    }
    generate_world(synth_preset("debug", **SMALL, seed=1), tmp_path / "c", progress=False)
    for split in SPLITS:
        a, b = list_shards(tmp_path / "a", split), list_shards(tmp_path / "b", split)
        assert [p.name for p in a] == [p.name for p in b]
        for pa_, pb in zip(a, b, strict=True):
            assert pq.read_table(pa_).equals(pq.read_table(pb))
    assert (
        not _read(tmp_path / "a", "train")
        .column("p_click")
        .equals(_read(tmp_path / "c", "train").column("p_click"))
    )


def test_a_failed_shard_write_fails_the_world_and_leaves_it_unmarked(tmp_path, monkeypatch):
    """Shards are written on a thread pool: a write that fails there (the disk full) still stops the world, and the
    dataset is left without ``schema.json``, so no reader takes it for complete."""
    written, lock = [], threading.Lock()

    def write_until_full(table, path):
        with lock:  # the pool's threads count the writes: check and count as one step
            if len(written) == 2:
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            written.append(path)
        return real_write(table, path)

    real_write = synthetic.write_table
    monkeypatch.setattr(synthetic, "write_table", write_until_full)
    with pytest.raises(OSError, match="No space left"):
        generate_world(synth_preset("debug", **SMALL), tmp_path / "w", progress=False, workers=2)
    assert len(written) == 2
    assert not (tmp_path / "w" / "schema.json").exists()


def test_schema_and_every_row_valid(world):
    cfg, path, stats = world
    schema = EventSchema.load(path)
    assert schema == build_schema(cfg)
    assert schema.has_oracle and schema.task == "ctr" and schema.num_actions == 3
    ids = []
    for split in SPLITS:
        for shard in list_shards(path, split):
            table = open_shard(shard, schema).read()
            bad, reasons = find_bad_rows(table, schema)
            assert len(bad) == 0, reasons[:3]
            ids.append(table.column("example_id").to_numpy())
    ids = np.concatenate(ids)
    assert len(ids) == cfg.num_examples == sum(stats["rows"].values())
    assert len(np.unique(ids)) == len(ids)


def test_domains_unequal_with_a_data_poor_one_and_different_rates(world):
    cfg, _, stats = world
    shares = np.array(list(stats["domain_share"].values()))
    assert len(shares) == cfg.num_domains >= 3
    assert shares.max() > 0.5 and shares.min() < 0.1
    clicks = np.array(list(stats["domain_click_rate"].values()))
    assert clicks.max() / clicks.min() > 1.3
    assert 0.005 < stats["click_rate"] < 0.1


def test_conversions_rare_need_a_click_and_are_sometimes_absent(world):
    _, path, stats = world
    assert 0 < stats["conv_per_click"] < 0.05
    table = _read(path, "train")
    click, conv = table.column("click"), table.column("conversion")
    assert click.null_count == 0
    assert 0.1 < conv.null_count / len(conv) < 0.5
    present = conv.is_valid().to_numpy(zero_copy_only=False)
    assert np.all(conv.to_numpy(zero_copy_only=False)[present] <= click.to_numpy()[present])
    p_click, p_conv = table.column("p_click").to_numpy(), table.column("p_conversion").to_numpy()
    assert np.all(p_conv <= p_click) and p_conv.mean() < 0.05 * p_click.mean()


def test_history_lengths_heavy_tailed_and_capped(world):
    cfg, path, stats = world
    lengths = pc.list_value_length(_read(path, "train").column("history_item_ids")).to_numpy()
    assert lengths.max() == cfg.max_history and lengths.min() >= 1
    assert (lengths == cfg.max_history).mean() > 0.2 and (lengths < 50).mean() > 0.1
    true_len = stats["true_history_len"]
    assert true_len["p1"] < 50 and true_len["max"] > 2_000 and true_len["p99"] > 20 * true_len["p10"]
    assert stats["history_len"]["max"] == cfg.max_history


def test_split_by_time(world):
    cfg, path, stats = world
    ts = {split: _read(path, split).column("timestamp").to_numpy() for split in SPLITS}
    assert ts["train"].max() <= ts["valid"].min() and ts["valid"].max() <= ts["test"].min()
    for split, frac in zip(SPLITS, cfg.split_fractions, strict=True):
        assert abs(stats["rows"][split] / cfg.num_examples - frac) < 0.02


def test_drift_topic_mix_changes_over_time(world):
    cfg, path, _ = world
    train, test = _read(path, "train"), _read(path, "test")

    def mix(topics):
        return np.bincount(topics, minlength=cfg.num_topics) / len(topics)

    topics, ts = _flat(train, "item_topic"), train.column("timestamp").to_numpy()
    early = topics[ts < np.quantile(ts, 0.15)]
    test_topics = _flat(test, "item_topic")
    drift = 0.5 * np.abs(mix(early) - mix(test_topics)).sum()
    # Sampling noise at the same sizes: two random samples of the same (train) period.
    rng = np.random.default_rng(0)
    perm = rng.permutation(len(topics))
    noise = 0.5 * np.abs(mix(topics[perm[: len(early)]]) - mix(topics[perm[-len(test_topics) :]])).sum()
    assert drift > 2 * noise


def test_oracle_beats_chance(world):
    _, _, stats = world
    assert stats["oracle_test"]["click"]["auc"] > 0.75
    assert stats["oracle_test"]["click"]["ne"] < 0.9


def _history_features(table: pa.Table, item_topic: np.ndarray) -> dict[str, np.ndarray]:
    """Per row: the share of the last 32 / older history events on the candidate's topic, ``[S, 2]`` each."""
    topic = _flat(table, "item_topic")
    hist = table.column("history_item_ids").combine_chunks()
    offsets, items = hist.offsets.to_numpy(), hist.values.to_numpy()
    row = np.repeat(np.arange(table.num_rows), np.diff(offsets))
    recent = offsets[1:][row] - np.arange(len(items)) <= 32
    same = item_topic[items] == topic[row]
    out = {}
    for name, mask in (("recent", recent), ("older", ~recent)):
        share = np.bincount(row, weights=same & mask, minlength=table.num_rows) / np.maximum(
            np.bincount(row, weights=mask, minlength=table.num_rows), 1
        )
        out[name] = np.stack([share, np.sqrt(share)], axis=1)
    return out


def _base_features(table: pa.Table, cfg: SynthConfig) -> np.ndarray:
    """What a model without history sees of the candidate and context: one-hots and dense, ``[S, F]``."""
    eye = np.eye(cfg.num_topics)
    return np.hstack(
        [
            np.eye(cfg.num_domains)[table.column("domain").to_numpy()],
            eye[_flat(table, "item_topic")],
            table.column("dense").combine_chunks().values.to_numpy().reshape(table.num_rows, -1),
        ]
    )


def _fit_logistic(x: np.ndarray, y: np.ndarray, l2: float = 1e-3) -> np.ndarray:
    """Newton's method for L2-regularised logistic regression; returns weights ``[F+1]`` (bias last)."""
    x = np.hstack([x, np.ones((len(x), 1))])
    w = np.zeros(x.shape[1])
    for _ in range(15):
        p = 1 / (1 + np.exp(-x @ w))
        grad = x.T @ (p - y) + l2 * len(y) * w
        hess = (x * (p * (1 - p))[:, None]).T @ x + l2 * len(y) * np.eye(len(w))
        w -= np.linalg.solve(hess, grad)
    return w


def _expected_ne(x: np.ndarray, w: np.ndarray, p_true: np.ndarray) -> float:
    """NE against the true probabilities (expected log loss), so label noise does not blur the comparison."""
    q = np.clip(1 / (1 + np.exp(-np.hstack([x, np.ones((len(x), 1))]) @ w)), 1e-7, 1 - 1e-7)
    base = p_true.mean()
    loss = -np.mean(p_true * np.log(q) + (1 - p_true) * np.log(1 - q))
    return float(loss / -(base * np.log(base) + (1 - base) * np.log(1 - base)))


def test_history_carries_signal_including_long_range(world):
    cfg, path, _ = world
    item_topic = make_world(cfg).item_topic
    train, test = _read(path, "train"), pa.concat_tables([_read(path, "valid"), _read(path, "test")])
    y, p_true = (
        train.column("click").to_numpy().astype(float),
        test.column("p_click").to_numpy().astype(float),
    )
    base_tr, base_te = _base_features(train, cfg), _base_features(test, cfg)
    hist_tr, hist_te = _history_features(train, item_topic), _history_features(test, item_topic)

    def ne(*parts: str) -> float:
        x_tr = np.hstack([base_tr, *(hist_tr[p] for p in parts)])
        x_te = np.hstack([base_te, *(hist_te[p] for p in parts)])
        return _expected_ne(x_te, _fit_logistic(x_tr, y), p_true)

    without, recent, everything = ne(), ne("recent"), ne("recent", "older")
    assert recent < without - 0.01
    assert everything < recent - 0.003  # events more than 32 back still matter


def test_few_rows_per_user(world):
    _, path, _ = world
    users = _read(path, "train").column("user_id").to_numpy()
    assert np.median(np.bincount(users)[np.bincount(users) > 0]) <= 15


def test_tenure_sets_how_fast_each_user_produces_events():
    """``rate_u = N_u / tenure_u``: one fixed tenure of 20 days gives every user N_u / 20 events a day (within
    the generator's clip), and a tenure ten times shorter makes every user ten times as active."""
    n_pre, rate, _ = _user_activity(synth_preset("debug", **SMALL, tenure_days=(20.0, 20.0)))
    assert np.allclose(rate, np.clip(n_pre / 20.0, 0.05, 200.0))
    _, fast, _ = _user_activity(synth_preset("debug", **SMALL, tenure_days=(2.0, 2.0)))
    unclipped = (rate > 0.05) & (fast < 200.0)
    assert unclipped.any() and np.allclose(fast[unclipped], 10 * rate[unclipped])


def test_presets_and_config_checks(tmp_path):
    assert set(SYNTH_PRESETS) >= {"debug", "default", "large"}
    default, large = SYNTH_PRESETS["default"], SYNTH_PRESETS["large"]
    assert 150_000 <= default.num_examples <= 300_000 and default.max_history == 256
    assert large.num_examples >= 10_000_000 and large.max_history >= 4096
    assert synth_preset("debug", seed=3).seed == 3 and SYNTH_PRESETS["debug"].seed == 0
    with pytest.raises(ValueError, match="num_domains"):
        SynthConfig(num_domains=4)
    with pytest.raises(ValueError, match="split_fractions"):
        SynthConfig(split_fractions=(0.5, 0.5, 0.0))
    for tenure in ((60.0, 15.0), (0.0, 10.0), (30.0,)):
        with pytest.raises(ValueError, match="tenure_days"):
            SynthConfig(tenure_days=tenure)
    with pytest.raises(ConfigError, match="unknown synthetic preset"):
        synth_preset("huge")
    generate_world(synth_preset("debug", **SMALL), tmp_path, progress=False)
    assert len(list_shards(tmp_path, "train")) > 1
    # Regenerating in place replaces the dataset: no shard of the earlier run survives.
    stats = generate_world(
        synth_preset("debug", **{**SMALL, "rows_per_shard": 100_000}), tmp_path, progress=False
    )
    assert stats["shards"] == {"train": 1, "valid": 1, "test": 1}
    assert [p.name for p in list_shards(tmp_path, "train")] == ["part-00000.parquet"]
