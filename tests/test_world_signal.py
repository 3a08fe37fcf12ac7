"""The world-signal measurements: the logistic fit, the same-draws check of ablated worlds, and the whole
measurement on a small world."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from experiments.world_signal import fit_logistic, main, oracle_triples, predict, world
from gem.flavors import SYNTH_PRESETS, synth_preset


def test_logistic_fit_recovers_known_weights():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20_000, 2, generator=g, dtype=torch.float64)
    y = torch.bernoulli(torch.sigmoid(x @ torch.tensor([1.5, -0.5], dtype=torch.float64) - 1.0), generator=g)
    w = fit_logistic(x, y, l2=0.0)
    assert w.tolist() == pytest.approx([1.5, -0.5, -1.0], abs=0.08)
    assert predict(w, torch.zeros(1, 2, dtype=torch.float64)).item() == pytest.approx(torch.sigmoid(w[-1]).item())


def test_worlds_of_other_draws_are_refused(tmp_path):
    cfg = synth_preset("debug", num_users=100, num_examples=1_000, max_history=16, users_per_block=100)
    a = world(cfg, tmp_path / "a", workers=1)
    b = world(dataclasses.replace(cfg, seed=1), tmp_path / "b", workers=1)
    with pytest.raises(ValueError, match="rows differ"):
        oracle_triples(a, b, "test")
    same = world(dataclasses.replace(cfg, recent_weight=0.0), tmp_path / "c", workers=1)
    (full, _, _), (ablated, labels, _) = oracle_triples(a, same, "test")
    assert not torch.equal(full, ablated) and labels.numel() == full.numel()  # same rows, other probabilities


def test_measurement_on_a_small_world(tmp_path, capsys):
    argv = ["--out", str(tmp_path), "--preset", "debug", "--examples", "20000", "--history", "64", "--probe-rows",
            "8000"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    result = json.loads(out[out.index("{"):])
    assert set(result) == {"oracle", "oracle_platt", "oracle_no_recency_platt", "oracle_no_noise_platt",
                           "probe_pooled", "probe_pooled_and_order", "probe_compare_pooled",
                           "probe_compare_pooled_and_order"}
    # Without transitions the successor-map features are a zero column: the probes with and without them agree.
    assert result["probe_pooled"] == pytest.approx(result["probe_compare_pooled"], abs=2e-4)
    # The truth beats the truth without a term, and both beat a linear probe of the history.
    assert result["oracle_platt"] < min(result["oracle_no_recency_platt"], result["oracle_no_noise_platt"])
    assert max(result["oracle_no_recency_platt"], result["oracle_no_noise_platt"]) < result["probe_pooled"] < 1.05


def test_transitions_are_measured_where_the_world_has_them(tmp_path, capsys, monkeypatch):
    sequential = synth_preset("sequential")
    monkeypatch.setitem(SYNTH_PRESETS, "debug-sequential", synth_preset(
        "debug", transition_rate=sequential.transition_rate, transition_target_frac=sequential.transition_target_frac,
        transition_weight=sequential.transition_weight, transition_locality=sequential.transition_locality))
    argv = ["--out", str(tmp_path), "--preset", "debug-sequential", "--examples", "40000", "--history", "64",
            "--probe-rows", "16000"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    result = json.loads(out[out.index("{"):])
    assert result["oracle_platt"] < result["oracle_no_transition_platt"] <= result["oracle_no_order_platt"]
    # The transition term is worth NE to the oracle, and a linear probe finds part of it in the order.
    assert result["oracle_no_transition_platt"] - result["oracle_platt"] > 0.03
    assert result["probe_pooled_and_order"] < result["probe_pooled"] - 0.01
    # Successors share their item's topic, so comparing the candidate with the last events finds part of it too.
    assert result["probe_compare_pooled_and_order"] < result["probe_compare_pooled"] - 0.01
