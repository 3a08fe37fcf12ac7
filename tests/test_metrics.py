import math

import pytest
import torch

from foundation.metrics import (
    BINARY_KEYS,
    BinaryMetrics,
    GroupedBinaryMetrics,
    RankingMetrics,
    auc,
    binary_metrics,
    calibration,
    compute_grouped,
    log_loss,
    normalized_entropy,
    ranking_metrics,
    target_ranks,
    target_ranks_chunked,
)


def same(a: dict, b: dict) -> bool:
    """Dict equality where nan equals nan."""
    return a.keys() == b.keys() and all(
        (isinstance(a[k], float) and math.isnan(a[k]) and math.isnan(b[k])) or a[k] == b[k] for k in a
    )


def brute_auc(s, y, w):
    num = den = 0.0
    for si, yi, wi in zip(s, y, w, strict=True):
        for sj, yj, wj in zip(s, y, w, strict=True):
            if yi == 1 and yj == 0:
                den += wi * wj
                num += wi * wj * (1.0 if si > sj else 0.5 if si == sj else 0.0)
    return num / den


# --- NE / logloss ------------------------------------------------------------------------------


def test_ne_by_hand():
    p = torch.tensor([0.8, 0.4, 0.6, 0.2])
    y = torch.tensor([1.0, 0.0, 1.0, 0.0])
    # logloss = -(ln .8 + ln .6 + ln .6 + ln .8) / 4; base rate 1/2 -> entropy ln 2.
    expected_ll = -(2 * math.log(0.8) + 2 * math.log(0.6)) / 4
    assert log_loss(p, y) == pytest.approx(expected_ll, rel=1e-6)
    assert normalized_entropy(p, y) == pytest.approx(expected_ll / math.log(2), rel=1e-6)

    p = torch.tensor([0.5, 0.5, 0.25, 0.25])
    y = torch.tensor([1.0, 0.0, 0.0, 0.0])
    ll = -(math.log(0.5) + math.log(0.5) + 2 * math.log(0.75)) / 4
    entropy = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert normalized_entropy(p, y) == pytest.approx(ll / entropy, rel=1e-12)


def test_ne_of_base_rate_predictor_is_one():
    y = torch.tensor([1.0, 0.0, 0.0, 0.0])
    assert normalized_entropy(torch.full((4,), 0.25), y) == 1.0
    g = torch.Generator().manual_seed(0)
    y = (torch.rand(1000, generator=g) < 0.3).double()
    p = torch.full((1000,), float(y.mean()), dtype=torch.float64)
    assert normalized_entropy(p, y) == pytest.approx(1.0, abs=1e-12)


def test_ne_undefined_when_one_class():
    p = torch.tensor([0.3, 0.9])
    for labels in ([0.0, 0.0], [1.0, 1.0]):
        m = binary_metrics(p, torch.tensor(labels))
        assert math.isnan(m["ne"])
        assert math.isfinite(m["logloss"])
        assert math.isnan(m["auc"])
    assert math.isnan(calibration(p, torch.tensor([0.0, 0.0])))


def test_logloss_clamps_certain_mistakes():
    ll = log_loss(torch.tensor([0.0, 1.0]), torch.tensor([1.0, 0.0]))
    assert ll == pytest.approx(-math.log(1e-7), rel=1e-6)
    assert math.isfinite(normalized_entropy(torch.tensor([0.0, 1.0]), torch.tensor([1.0, 0.0])))


def test_empty_after_mask_is_nan():
    m = binary_metrics(torch.tensor([0.5]), torch.tensor([1.0]), mask=torch.tensor([False]))
    assert m["count"] == 0
    assert all(math.isnan(m[k]) for k in BINARY_KEYS if k != "count")
    empty = BinaryMetrics().compute()
    assert empty["count"] == 0 and math.isnan(empty["ne"])


def test_mask_ignores_absent_labels():
    p = torch.tensor([0.9, 0.2, 0.7, 0.4, 0.1])
    y = torch.tensor([1.0, 0.0, 7.0, 0.0, -1.0])  # fillers where absent must not be checked or used
    mask = torch.tensor([True, True, False, True, False])
    assert same(binary_metrics(p, y, mask), binary_metrics(p[mask], y[mask]))
    with pytest.raises(ValueError, match="labels"):
        binary_metrics(p, y)


def test_integer_weights_equal_repetition():
    p = torch.tensor([0.9, 0.2, 0.6, 0.4])
    y = torch.tensor([1.0, 0.0, 0.0, 1.0])
    w = torch.tensor([2.0, 1.0, 3.0, 1.0])
    rep = torch.repeat_interleave(torch.arange(4), w.long())
    a, b = binary_metrics(p, y, weights=w), binary_metrics(p[rep], y[rep])
    for k in ("ne", "auc", "calibration", "logloss", "base_rate"):
        assert a[k] == pytest.approx(b[k], rel=1e-12)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="logits"):
        binary_metrics(torch.tensor([1.5]), torch.tensor([1.0]))
    with pytest.raises(ValueError, match="NaN"):
        binary_metrics(torch.tensor([float("nan")]), torch.tensor([1.0]))
    with pytest.raises(ValueError, match="size"):
        binary_metrics(torch.tensor([0.5, 0.5]), torch.tensor([1.0]))
    with pytest.raises(ValueError, match="weights"):
        binary_metrics(torch.tensor([0.5]), torch.tensor([1.0]), weights=torch.tensor([-1.0]))


# --- AUC, calibration -------------------------------------------------------------------------


def test_auc_cases():
    assert auc(torch.tensor([0.5, 0.5]), torch.tensor([1, 0])) == 0.5
    assert auc(torch.tensor([0.1, 0.2, 0.8, 0.9]), torch.tensor([0, 0, 1, 1])) == 1.0
    assert auc(torch.tensor([0.9, 0.8, 0.2, 0.1]), torch.tensor([0, 0, 1, 1])) == 0.0
    assert auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])) == 0.75
    # Ties: the positive at 0.3 ties two negatives (2 x 1/2), the one at 0.9 beats both: 3/4.
    assert auc(torch.tensor([0.3, 0.3, 0.3, 0.9]), torch.tensor([1, 0, 0, 1])) == 0.75
    assert math.isnan(auc(torch.tensor([0.2, 0.7]), torch.tensor([1, 1])))
    assert math.isnan(auc(torch.tensor([0.2, 0.7]), torch.tensor([0, 0])))
    # Scores need not be probabilities.
    assert auc(torch.tensor([-3.0, 5.0]), torch.tensor([0, 1])) == 1.0


def test_auc_matches_pairwise_definition_with_ties_and_weights():
    g = torch.Generator().manual_seed(1)
    s = torch.randint(0, 5, (40,), generator=g).double()  # heavy ties
    y = torch.randint(0, 2, (40,), generator=g).double()
    w = torch.rand(40, generator=g, dtype=torch.float64)
    assert auc(s, y, weights=w) == pytest.approx(brute_auc(s.tolist(), y.tolist(), w.tolist()), rel=1e-12)
    assert auc(s, y) == pytest.approx(brute_auc(s.tolist(), y.tolist(), [1.0] * 40), rel=1e-12)


def test_calibration():
    assert calibration(torch.tensor([0.2, 0.6, 0.4]), torch.tensor([1, 0, 0])) == pytest.approx(1.2)
    assert calibration(torch.tensor([0.5, 0.5]), torch.tensor([1, 0])) == 1.0
    mask = torch.tensor([True, True, False])
    assert calibration(torch.tensor([0.3, 0.1, 0.9]), torch.tensor([1, 0, 1]), mask) == pytest.approx(0.4)


# --- streaming and grouped -----------------------------------------------------------------------


def test_streaming_equals_one_shot():
    g = torch.Generator().manual_seed(2)
    p = torch.rand(300, generator=g)
    y = (torch.rand(300, generator=g) < p).float()
    mask = torch.rand(300, generator=g) < 0.8
    acc = BinaryMetrics()
    for lo, hi in ((0, 7), (7, 150), (150, 151), (151, 300)):
        acc.update(p[lo:hi], y[lo:hi], mask[lo:hi])
    assert same(acc.compute(), binary_metrics(p, y, mask))
    assert same(acc.compute(), binary_metrics(p, y, mask))  # compute() is repeatable

    a, b = BinaryMetrics(), BinaryMetrics()
    a.update(p[:100], y[:100], mask[:100])
    b.update(p[100:], y[100:], mask[100:])
    a.merge(b)
    assert same(a.compute(), binary_metrics(p, y, mask))


def test_grouped_by_domain():
    g = torch.Generator().manual_seed(3)
    p = torch.rand(200, generator=g)
    y = (torch.rand(200, generator=g) < p).float()
    d = torch.randint(0, 3, (200,), generator=g)
    mask = torch.rand(200, generator=g) < 0.9
    mask[d == 2] = False  # a domain with no labels is absent, not nan
    out = compute_grouped(p, y, d, mask)
    assert set(out) == {0, 1}
    for k in (0, 1):
        sel = mask & (d == k)
        assert same(out[k], binary_metrics(p[sel], y[sel]))

    acc = GroupedBinaryMetrics()
    for lo, hi in ((0, 50), (50, 200)):
        acc.update("click", p[lo:hi], y[lo:hi], d[lo:hi], mask[lo:hi])
        acc.update("conversion", p[lo:hi], 1 - y[lo:hi], d[lo:hi])
    res = acc.compute()
    assert same(res[("click", 0)], out[0]) and same(res[("click", 1)], out[1])
    assert ("click", 2) not in res and ("conversion", 2) in res
    flat = acc.compute_flat()
    assert flat["click/d1/auc"] == out[1]["auc"]
    assert flat["click/all/ne"] == binary_metrics(p, y, mask)["ne"]
    assert flat["conversion/all/count"] == 200


# --- ranking ------------------------------------------------------------------------------------


def ranking_case():
    # Items 0..5; id 0 is padding (invalid) and scores high on purpose.
    scores = torch.tensor(
        [
            [9.0, 0.5, 0.9, 0.1, 0.7, 0.3],  # target 4 (0.7); history {2} hides the 0.9
            [0.0, 0.5, 0.5, 0.5, 0.2, 0.9],  # target 1 (0.5), ties with 2 and 3, below 5
            [0.0, 0.8, 0.6, 0.9, 0.1, 0.2],  # target 2 (0.6) was seen before: stays a candidate
        ]
    )
    targets = torch.tensor([4, 1, 2])
    values = torch.tensor([2, 2, 3])  # row 0: [2]; row 1: []; row 2: [2, 3]
    offsets = torch.tensor([0, 1, 1, 3])
    valid = torch.tensor([False, True, True, True, True, True])
    return scores, targets, values, offsets, valid


def test_target_ranks_by_hand():
    scores, targets, values, offsets, valid = ranking_case()
    ranks = target_ranks(scores, targets, values, offsets, valid_items=valid)
    # row 0: nothing above 0.7 once 0 (invalid) and 2 (history) are out -> 0;
    # row 1: 2, 3 tie (counted against the target) and 5 is above -> 3;
    # row 2: 3 is history, 1 (0.8) is above -> 1.
    assert ranks.tolist() == [0, 3, 1]
    # Without exclusions the padding id and the history count too.
    assert target_ranks(scores, targets).tolist() == [2, 3, 2]


def test_all_equal_scores_rank_last():
    ranks = target_ranks(torch.zeros(1, 10), torch.tensor([3]), valid_items=torch.arange(10) > 0)
    assert ranks.tolist() == [8]


def test_ranking_metrics_by_hand():
    m = ranking_metrics(torch.tensor([0, 3]), ks=(1, 4, 1000))
    assert m["hr1"] == 0.5
    assert m["ndcg1"] == 0.5
    assert m["hr4"] == 1.0
    assert m["ndcg4"] == pytest.approx((1.0 + 1.0 / math.log2(5)) / 2)
    assert m["hr1000"] == 1.0  # K beyond the catalogue: every target is a hit
    assert m["mrr"] == pytest.approx((1.0 + 0.25) / 2)
    assert m["count"] == 2
    assert math.isnan(ranking_metrics(torch.zeros(0, dtype=torch.long))["hr10"])


def test_ranking_accumulator_and_chunks():
    g = torch.Generator().manual_seed(4)
    n_items, batch = 37, 12
    scores = torch.randint(0, 6, (batch, n_items), generator=g).float()  # many ties
    targets = torch.randint(1, n_items, (batch,), generator=g)
    lengths = torch.randint(0, 6, (batch,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)])
    values = torch.randint(0, n_items, (int(offsets[-1]),), generator=g)
    valid = torch.arange(n_items) > 0
    ranks = target_ranks(scores, targets, values, offsets, valid_items=valid)

    for chunk in (1, 5, 36, 37, 100):
        chunked = target_ranks_chunked(
            lambda a, b: scores[:, a:b], n_items, targets, values, offsets, valid_items=valid, chunk_size=chunk
        )
        assert torch.equal(chunked, ranks)

    acc = RankingMetrics(ks=(10, 50, 200))
    acc.update(scores[:5], targets[:5], values[: offsets[5]], offsets[:6], valid_items=valid)
    acc.update_ranks(target_ranks(scores[5:], targets[5:], values[offsets[5] :], offsets[5:] - offsets[5], valid_items=valid))
    out = acc.compute()
    assert same(out, ranking_metrics(ranks, (10, 50, 200)))
    assert set(out) == {"hr10", "ndcg10", "hr50", "ndcg50", "hr200", "ndcg200", "mrr", "count"}
    assert out["hr50"] == 1.0  # 50 > 37 items


def test_ranking_bad_inputs():
    scores, targets, values, offsets, valid = ranking_case()
    with pytest.raises(ValueError, match="valid item"):
        target_ranks(scores, torch.tensor([0, 1, 2]), valid_items=valid)
    with pytest.raises(ValueError, match="offsets"):
        target_ranks(scores, targets, values, offsets[:-1])
    with pytest.raises(ValueError, match="history item ids"):
        target_ranks(scores, targets, torch.tensor([2, 2, 6]), offsets)
    with pytest.raises(ValueError, match="NaN"):
        target_ranks(torch.full((3, 6), float("nan")), targets)
