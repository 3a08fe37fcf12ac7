"""How much of a synthetic world's click signal depends on the order of the history, which mean-pooling loses.

Usage::

    python -m experiments.world_signal --out /tmp/world-signal --examples 400000 --history 1024 --probe-rows 150000
    python -m experiments.world_signal --preset sequential --out /tmp/world-signal-seq --examples 100000 --history 256
    python -m experiments.world_signal --preset sequential --transition-locality 0 --out /tmp/ws-seq-uniform

Two measurements on a preset (``default``) (issue 16, item 5: can a sequence model beat a DLRM that mean-pools the
same 1,024 events?):

1. **The oracle without a term.** The world is generated again with one ground-truth term switched off
   (``recent_weight=0``: the user's current and previous focus topic, the recency signal; ``noise_std=0``: the
   per-impression noise no model can know; in a world with item-to-item transitions, also ``transition_weight=0``:
   the bonus of a candidate that follows one of the last events' items, and both order-dependent terms at once).
   Switching a weight off leaves every random draw in place, so the
   rows, candidates and labels' uniforms are the same (the script checks the example ids); the click
   probabilities differ. Scoring the full world's labels with the ablated world's probabilities, after a Platt
   scaling per domain fitted on valid (the term's mean shifts the rate), gives the test NE of a predictor that
   knows everything but that term; its gap to the full oracle (scaled the same way) is what the term is worth.
2. **A linear probe.** A logistic regression on features computed from each row's stored history with the world's
   true topic similarity ``S``: pooled ones, which a DLRM's mean-pooled bags and dot products can express (mean
   ``S[topic_j, k]`` over all events and over clicked ones, history length, candidate topic, domain, dense
   features), against the same plus order-dependent ones (mean ``S`` over the last 1, 8 and 32 events and with
   weights ``exp(-age / 7 days)``). In a world with transitions both sides also get the share of events whose
   successors include the candidate: over all events and clicked ones (pooled: a bag of item ids can hold it),
   against over the last 1 and 8 events and the world's position-decayed sum (order). The NE it gains on test is
   order-dependent signal a simple model can use. Those features read the world's successor map, which a model
   must learn pair by pair; the ``probe_compare_*`` probes leave them out and add what a model that only compares
   items can compute, the share of events of the candidate's topic (over all and clicked events against over the
   last 1 and 8): with ``transition_locality`` > 0 a successor shares its item's topic, so this reaches part of
   the transition term.

Prints one JSON object (test click NE of each predictor).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from foundation.data.io import list_shards
from foundation.data.synthetic import (
    STATS_FILE,
    SynthConfig,
    World,
    generate_world,
    make_world,
    transition_affinity,
)
from foundation.metrics import normalized_entropy
from gem.flavors import synth_preset

ABLATIONS = {"no_recency": {"recent_weight": 0.0}, "no_noise": {"noise_std": 0.0}}
TRANSITION_ABLATIONS = {"no_transition": {"transition_weight": 0.0},
                        "no_order": {"recent_weight": 0.0, "transition_weight": 0.0}}


def ablations(cfg: SynthConfig) -> dict[str, dict[str, float]]:
    """The worlds to measure ``cfg`` against: the transition ones only where ``cfg`` has the term."""
    return {**ABLATIONS, **(TRANSITION_ABLATIONS if cfg.transition_weight > 0 else {})}
DAY = 86_400.0
# feature groups of history_features per probe: 0 pooled, 1 order, 2 pooled_table, 3 order_table
PROBES = {"probe_pooled": (0, 2), "probe_pooled_and_order": (0, 1, 2, 3),
          "probe_compare_pooled": (0,), "probe_compare_pooled_and_order": (0, 1)}


def world(cfg: SynthConfig, directory: Path, workers: int) -> Path:
    """``directory`` holding the world of ``cfg`` (generated unless its ``synth.json`` already has this config)."""
    stats = directory / STATS_FILE
    if not stats.is_file() or json.loads(stats.read_text())["config"] != json.loads(json.dumps(dataclasses.asdict(cfg))):
        generate_world(cfg, directory, progress=False, workers=workers)
    return directory


def read_split(directory: Path, split: str, columns: list[str]):
    return pq.read_table(list_shards(directory, split), columns=columns)


def fit_logistic(x: torch.Tensor, y: torch.Tensor, l2: float = 1e-4, steps: int = 200) -> torch.Tensor:
    """Weights ``[F+1]`` (bias last) of an L2-regularised logistic regression of ``y[N]`` on ``x[N, F]`` (LBFGS)."""
    xb = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], dim=1)
    w = torch.zeros(xb.shape[1], dtype=x.dtype, requires_grad=True)
    optimizer = torch.optim.LBFGS([w], max_iter=steps, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(xb @ w, y) + l2 * (w[:-1] ** 2).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    return w.detach()


def predict(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x @ w[:-1] + w[-1])


def platt_per_domain(valid: tuple, test: tuple, domains: int) -> torch.Tensor:
    """Test probabilities from ``(logit[N], label[N], domain[N])`` triples: ``sigmoid(a_d * logit + b_d)`` fitted on valid."""
    (v_logit, v_y, v_dom), (t_logit, _, t_dom) = valid, test
    out = torch.empty_like(t_logit)
    for d in range(domains):
        w = fit_logistic(v_logit[v_dom == d, None], v_y[v_dom == d], l2=0.0)
        out[t_dom == d] = predict(w, t_logit[t_dom == d, None])
    return out


def oracle_triples(full: Path, other: Path, split: str) -> tuple[tuple, tuple]:
    """``(full oracle, other world's oracle)`` as ``(logit, full world's label, domain)`` over one split."""
    a = read_split(full, split, ["example_id", "click", "p_click", "domain"])
    b = read_split(other, split, ["example_id", "p_click"])
    if not np.array_equal(a.column("example_id").to_numpy(), b.column("example_id").to_numpy()):
        raise ValueError(f"{full} and {other}: the worlds' {split} rows differ (not the same draws)")
    y = torch.from_numpy(a.column("click").to_numpy().astype(np.float64))
    dom = torch.from_numpy(a.column("domain").to_numpy().astype(np.int64))

    def logit(table) -> torch.Tensor:
        return torch.logit(torch.from_numpy(table.column("p_click").to_numpy().astype(np.float64)), eps=1e-7)

    return (logit(a), y, dom), (logit(b), y, dom)


def history_features(w: World, directory: Path, split: str, rows: int, seed: int) -> tuple[torch.Tensor, ...]:
    """``(pooled[N, P], order[N, Q], pooled_table[N, R], order_table[N, S], click[N])`` for ``rows`` rows of
    ``split`` drawn at random (all when fewer). The ``*_table`` features read the world's successor map (a zero
    column in a world without transitions); the others only compare the candidate with the history's items."""
    columns = ["history_item_ids", "history_timestamps", "history_actions", "item_id", "item_topic", "domain",
               "timestamp", "dense", "click"]
    table = read_split(directory, split, columns)
    table = table.take(np.sort(np.random.default_rng(seed).permutation(table.num_rows)[:rows]))
    history = table.column("history_item_ids").combine_chunks()
    offsets, items = history.offsets.to_numpy(), history.values.to_numpy()
    n = table.num_rows
    row = np.repeat(np.arange(n), np.diff(offsets))
    topic = table.column("item_topic").combine_chunks().values.to_numpy()  # one topic per candidate
    sim = w.topic_sim[w.item_topic[items], topic[row]]
    age = (table.column("timestamp").to_numpy()[row]
           - table.column("history_timestamps").combine_chunks().values.to_numpy()) / DAY
    from_end = offsets[1:][row] - 1 - np.arange(len(items))
    clicked = table.column("history_actions").combine_chunks().values.to_numpy() > 0

    def weighted_mean(weight: np.ndarray) -> np.ndarray:
        total = np.bincount(row, weights=weight, minlength=n)
        return np.bincount(row, weights=sim * weight, minlength=n) / np.maximum(total, 1e-12)

    domain = np.eye(w.cfg.num_domains)[table.column("domain").to_numpy()]
    pooled_all, pooled_clicked = weighted_mean(np.ones(len(items))), weighted_mean(clicked.astype(float))
    pooled = [
        domain, np.eye(w.cfg.num_topics)[topic], np.stack(table.column("dense").to_numpy(zero_copy_only=False)),
        np.log1p(np.diff(offsets)), np.bincount(row, weights=clicked, minlength=n) > 0, pooled_all, pooled_clicked,
        domain * pooled_all[:, None], domain * pooled_clicked[:, None],
    ]
    recent = [weighted_mean((from_end < k).astype(float)) for k in (1, 8, 32)]
    decayed = weighted_mean(np.exp(-age / 7.0))
    order = [*recent, decayed, domain * decayed[:, None], domain * recent[1][:, None]]
    pooled_table, order_table = [np.zeros(n)], [np.zeros(n)]
    if w.cfg.transition_weight > 0:
        candidate = table.column("item_id").to_numpy()
        same_topic = (w.item_topic[items] == topic[row]).astype(float)
        follows = (w.item_successors[items] == candidate[row, None]).any(axis=1).astype(float)

        def share(hit: np.ndarray, weight: np.ndarray) -> np.ndarray:
            return np.bincount(row, weights=hit * weight, minlength=n) / np.maximum(
                np.bincount(row, weights=weight, minlength=n), 1e-12)

        last = [(from_end < k).astype(float) for k in (1, 8)]
        pooled += [share(same_topic, np.ones(len(items))), share(same_topic, clicked.astype(float))]
        order += [share(same_topic, weight) for weight in last]
        pooled_table = [share(follows, np.ones(len(items))), share(follows, clicked.astype(float))]
        order_table = [*(share(follows, weight) for weight in last), transition_affinity(w, offsets, items, candidate)]
    click = table.column("click").to_numpy().astype(np.float64)
    features = (*(np.column_stack(f) for f in (pooled, order, pooled_table, order_table)), click)
    return tuple(torch.from_numpy(np.asarray(a, dtype=np.float64)) for a in features)


def probe(w: World, directory: Path, train_rows: int) -> dict[str, float]:
    """Test click NE of the linear probe on pooled features, and on pooled + order-dependent ones."""
    train, test = history_features(w, directory, "train", train_rows, 0), history_features(w, directory, "test", 10**9, 1)
    out = {}
    for name, groups in PROBES.items():
        x, x_test = (torch.cat([f[g] for g in groups], 1) for f in (train, test))
        mean, std = x.mean(0), x.std(0).clamp_min(1e-6)  # standardised: one L2 weight fits every feature
        weights = fit_logistic((x - mean) / std, train[-1])
        out[name] = normalized_entropy(predict(weights, (x_test - mean) / std), test[-1])
    return out


def measure(args: argparse.Namespace) -> dict[str, float]:
    locality = {} if args.transition_locality is None else {"transition_locality": args.transition_locality}
    cfg = synth_preset(args.preset, num_examples=args.examples, max_history=args.history, users_per_block=1024,
                       **locality)
    out_dir = Path(args.out)
    full = world(cfg, out_dir / "full", args.workers)
    valid, test = oracle_triples(full, full, "valid"), oracle_triples(full, full, "test")
    result = {
        "oracle": normalized_entropy(torch.sigmoid(test[0][0]), test[0][1]),
        "oracle_platt": normalized_entropy(platt_per_domain(valid[0], test[0], cfg.num_domains), test[0][1]),
    }
    for name, change in ablations(cfg).items():
        other = world(dataclasses.replace(cfg, **change), out_dir / name, args.workers)
        valid, test = oracle_triples(full, other, "valid"), oracle_triples(full, other, "test")
        result[f"oracle_{name}_platt"] = normalized_entropy(platt_per_domain(valid[1], test[1], cfg.num_domains), test[1][1])
    result.update(probe(make_world(cfg), full, args.probe_rows))
    return {k: round(v, 4) for k, v in result.items()}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the worlds go here (reused when their config matches)")
    parser.add_argument("--preset", default="default", help="the synthetic preset of gem.flavors")
    parser.add_argument("--examples", type=int, default=400_000)
    parser.add_argument("--history", type=int, default=1024)
    parser.add_argument("--probe-rows", type=int, default=150_000, help="train rows the linear probe fits on")
    parser.add_argument("--transition-locality", type=float, default=None,
                        help="override the preset's SynthConfig.transition_locality (e.g. 0: uniform successors)")
    parser.add_argument("--workers", type=int, default=1, help="processes generating each world")
    return parser


def main(argv: list[str] | None = None) -> int:
    print(json.dumps(measure(build_parser().parse_args(argv)), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
