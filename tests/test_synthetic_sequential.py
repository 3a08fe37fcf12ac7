"""The synthetic world's order-dependent ground truth: item-to-item transitions (``transition_*`` of SynthConfig)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from experiments.compute_scaling import build_plan
from experiments.world_signal import ablations
from foundation.data.io import list_shards
from foundation.data.pipeline import DataConfig, EventStream
from foundation.data.synthetic import (
    SPLITS,
    TRANSITION_SPAN,
    SynthConfig,
    generate_world,
    make_world,
    transition_affinity,
)
from gem.flavors import synth_preset

SMALL = {"num_users": 400, "num_examples": 3_000, "rows_per_shard": 1_000, "users_per_block": 128}
ON = {"transition_rate": 0.3, "transition_target_frac": 0.2, "transition_weight": 2.0}


def _rows(cfg: SynthConfig, out) -> pa.Table:
    generate_world(cfg, out, progress=False)
    return pa.concat_tables(pq.read_table(p) for s in SPLITS for p in list_shards(out, s))


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    """``(cfg, rows)`` of the debug world with transitions on, and its rows with ``transition_weight=0``."""
    cfg = synth_preset("debug", **SMALL, **ON)
    out = tmp_path_factory.mktemp("sequential")
    return cfg, _rows(cfg, out / "on"), _rows(dataclasses.replace(cfg, transition_weight=0.0), out / "off")


def _history(rows: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    history = rows.column("history_item_ids").combine_chunks()
    return history.offsets.to_numpy().astype(np.int64), history.values.to_numpy()


def _logit(rows: pa.Table) -> np.ndarray:
    p = rows.column("p_click").to_numpy().astype(np.float64)
    return np.log(p) - np.log1p(-p)


def test_default_world_is_unchanged(tmp_path):
    """Pinned from the generator before the transition terms existed: the weights at 0 draw nothing new."""
    rows = _rows(synth_preset("debug", **SMALL), tmp_path)
    assert pa.compute.sum(rows.column("item_id")).as_py() == 1_514_982
    assert pa.compute.sum(rows.column("click")).as_py() == 181
    assert int(_history(rows)[1].sum()) == 227_800_674
    assert rows.column("p_click").to_numpy().astype(np.float64).sum() == pytest.approx(192.9435928568637, rel=1e-12)


def test_weight_adds_exactly_its_term_read_from_the_stored_history(worlds):
    cfg, on, off = worlds
    assert on.column("example_id").equals(off.column("example_id"))
    for column in ("item_id", "timestamp", "domain", "dense", "history_item_ids", "history_timestamps"):
        assert on.column(column).equals(off.column(column)), column
    offsets, items = _history(on)
    term = transition_affinity(make_world(cfg), offsets, items, on.column("item_id").to_numpy())
    assert (term > 0).mean() > 0.1
    np.testing.assert_allclose(_logit(on) - _logit(off), cfg.transition_weight * term, atol=2e-4)


def test_ground_truth_depends_on_the_order_of_the_history(worlds):
    cfg, on, _ = worlds
    world, candidate = make_world(cfg), on.column("item_id").to_numpy()
    offsets, items = _history(on)
    term = transition_affinity(world, offsets, items, candidate)
    lengths = np.diff(offsets)
    row = np.repeat(np.arange(len(lengths)), lengths)
    position = np.arange(len(items)) - offsets[row]
    # The same bag of items, oldest first turned newest first: the term (so the oracle p) moves.
    reversed_items = items[offsets[row] + lengths[row] - 1 - position]
    moved = transition_affinity(world, offsets, reversed_items, candidate) != term
    assert moved[term > 0].mean() > 0.8
    # Shuffling only the events older than the last TRANSITION_SPAN leaves it in place.
    old = position < lengths[row] - TRANSITION_SPAN
    shuffled = items.copy()
    for r in np.flatnonzero(lengths > TRANSITION_SPAN + 1)[:200]:
        span = slice(offsets[r], offsets[r + 1] - TRANSITION_SPAN)
        shuffled[span] = np.random.default_rng(r).permutation(items[span])
    assert (shuffled != items)[old].any()
    np.testing.assert_array_equal(transition_affinity(world, offsets, shuffled, candidate), term)


def test_batches_cut_to_max_len_keep_the_last_events_oldest_first(worlds, tmp_path):
    """What a model reads: a batch's history cut to ``max_len`` is the tail of the stored one, in order, so the
    transition term (which reads the last ``TRANSITION_SPAN`` events) is the same from the batch as from the row."""
    cfg, _, _ = worlds
    generate_world(cfg, tmp_path, progress=False)
    data = DataConfig(path=str(tmp_path), max_len=TRANSITION_SPAN, batch_size=64)
    stored = pq.read_table(list_shards(tmp_path, "train"))
    by_id = {int(e): r for r, e in enumerate(stored.column("example_id").to_numpy())}
    offsets, items = _history(stored)
    world, cut_rows = make_world(cfg), 0
    term = transition_affinity(world, offsets, items, stored.column("item_id").to_numpy())
    for batch in EventStream(tmp_path, "train", data, training=True):
        b_offsets, b_items = batch.offsets.numpy(), batch.history["item_ids"].numpy()
        b_times = batch.history["timestamps"].numpy()
        rows = np.array([by_id[int(e)] for e in batch.example_id])
        for i, r in enumerate(rows):
            n = b_offsets[i + 1] - b_offsets[i]
            assert n == min(offsets[r + 1] - offsets[r], TRANSITION_SPAN)
            np.testing.assert_array_equal(b_items[b_offsets[i] : b_offsets[i + 1]], items[offsets[r + 1] - n : offsets[r + 1]])
            assert (np.diff(b_times[b_offsets[i] : b_offsets[i + 1]]) >= 0).all()  # oldest first
            cut_rows += int(offsets[r + 1] - offsets[r] > n)
        np.testing.assert_array_equal(
            transition_affinity(world, b_offsets, b_items, batch.candidate.numpy()),
            term[rows],
        )
    assert cut_rows > 100


def test_histories_chain_items_and_candidates_follow_the_last_events(worlds, tmp_path):
    cfg, on, _ = worlds
    default = _rows(synth_preset("debug", **SMALL), tmp_path)
    world = make_world(cfg)

    def follow_share(rows: pa.Table) -> float:
        offsets, items = _history(rows)
        pair = np.ones(len(items), dtype=bool)
        pair[offsets[:-1]] = False  # the first event of a row has no previous one in it
        nxt = np.flatnonzero(pair)
        return float((world.item_successors[items[nxt - 1]] == items[nxt, None]).any(axis=1).mean())

    assert follow_share(default) < 0.02
    assert 0.6 * cfg.transition_rate < follow_share(on) <= cfg.transition_rate + 0.02
    offsets, items = _history(on)
    near = transition_affinity(world, offsets, items, on.column("item_id").to_numpy()) > 0
    assert near.mean() > 0.8 * cfg.transition_target_frac


def test_uniform_successor_map_is_unchanged():
    """Pinned from the generator before ``transition_locality`` existed: locality 0 draws nothing new."""
    successors = make_world(synth_preset("debug", **ON)).item_successors
    assert int(successors.sum()) == 1_495_771
    assert int((successors * np.arange(successors.size).reshape(successors.shape)).sum() % 1_000_003) == 870_916


@pytest.mark.parametrize("locality", [0.0, 0.5, 1.0])
def test_locality_draws_that_share_of_successors_from_the_item_topic(locality):
    world = make_world(synth_preset("debug", num_items=20_000, transition_locality=locality, **ON))
    successors, items = world.item_successors, np.arange(world.cfg.num_items)
    same_topic = (world.item_topic[successors] == world.item_topic[:, None]).mean()
    chance = np.sum(np.bincount(world.item_topic) ** 2) / len(items) ** 2  # a uniform draw's odds of the same topic
    assert same_topic == pytest.approx(locality + (1 - locality) * chance, abs=0.01)
    if locality == 1.0:
        assert (successors != items[:, None]).all()  # a next item is another item
    # The rest of the world does not depend on the map.
    plain = make_world(synth_preset("debug", num_items=20_000, **ON))
    np.testing.assert_array_equal(world.item_topic, plain.item_topic)
    np.testing.assert_array_equal(world.sampler_cum, plain.sampler_cum)


def test_local_transitions_put_the_candidate_in_the_topic_of_the_events_it_follows(tmp_path):
    cfg = synth_preset("debug", **SMALL, **ON, transition_locality=1.0)
    rows, world = _rows(cfg, tmp_path), make_world(cfg)
    offsets, items = _history(rows)
    candidate = rows.column("item_id").to_numpy()
    term = transition_affinity(world, offsets, items, candidate)
    assert (term > 0).mean() > 0.1
    follows = np.flatnonzero(term >= 1)  # the last event's successor
    last_topic = world.item_topic[items[offsets[follows + 1] - 1]]
    np.testing.assert_array_equal(world.item_topic[candidate[follows]], last_topic)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"transition_rate": 1.0}, "transition_rate"),
        ({"transition_rate": -0.1}, "transition_rate"),
        ({"transition_target_frac": -0.1}, "transition_target_frac"),
        ({"transition_weight": -1.0}, "transition_weight"),
        ({"transition_weight": float("nan")}, "transition_weight"),
        ({"transition_target_frac": 0.5}, "transition_target_frac must be <= 1"),
        ({"transition_locality": -0.1}, "transition_locality"),
        ({"transition_locality": 1.5}, "transition_locality"),
        ({"transition_locality": float("nan")}, "transition_locality"),
    ],
)
def test_bad_transition_config_is_a_one_line_error(change, field):
    with pytest.raises(ValueError, match=field) as error:
        SynthConfig(**change)
    assert "\n" not in str(error.value)


def test_sequential_preset_reaches_the_measurement_and_the_scaling_plans():
    cfg = synth_preset("sequential")
    assert cfg.transition_weight > 0 and cfg.transition_rate > 0 and cfg.transition_target_frac > 0
    assert cfg.transition_locality > 0
    assert "no_transition" in ablations(cfg) and "no_transition" not in ablations(synth_preset("default"))
    plan, own = build_plan("trained", "sequential"), build_plan("trained")
    assert plan.world == dataclasses.replace(
        own.world, transition_rate=cfg.transition_rate, transition_target_frac=cfg.transition_target_frac,
        transition_weight=cfg.transition_weight, transition_locality=cfg.transition_locality,
    )
    assert plan.sizes == own.sizes and plan.label.startswith("synthetic sequential, ")
    assert own.label.startswith("synthetic default, ")
