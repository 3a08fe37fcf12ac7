"""The synthetic ads world: the project's embedded default dataset, with a known ground truth.

One row is one ad impression (see :mod:`foundation.data.schema`); the true click and conversion
probabilities are stored beside the sampled labels (``p_click``, ``p_conversion``), so the oracle
NE/AUC ceiling of any split can be reported.

The world
=========

**Catalogue.** ``K = num_topics`` topics with a log-popularity each and a similarity matrix
``S[K, K]`` (1 on the diagonal; nearby topics in a hidden 3-d space share some appeal).
Advertisers have a topic, a price level and a conversion-tracking flag. Items (ads) have a topic
(mostly their advertiser's), an advertiser, a format, a price bucket, a quality, a conversion
propensity, a base bid, a popularity weight and a launch day: ``1 - new_item_frac`` of items are
evergreen, the rest launch over the 180 days before the window and during it, so later data holds
ads that earlier data never saw. Items are only ever shown after their launch.

**Users.** Observable attributes (age bucket, gender, region, device, and a noisy multi-hot
``interest_segments`` list, as a third-party audience segment would be) and latent interests:

- a *core* topic, stable for life, drawn partly from the demographics; expressed in only
  ``core_rate`` (15%) of the user's events, so it takes a long history to see it through the noise;
- a *dormant* topic (70% of users): the user's former main interest, expressed in
  ``dormant_rate`` (30%) of events up to ``D_u ~ U[64, 192]`` events before the window and almost
  never after. It still drives clicks and conversions, so interests expressed hundreds of events
  ago matter, and a model reading only the last 32 events hardly sees it;
- a drifting *focus* topic: time is cut into phases of a per-user length (mean ``phase_days``);
  each phase has its own focus (often near the core, otherwise a popular topic), expressed in
  ``focus_rate`` (55%) of events in that phase. This is the recent-history signal;
- a clickiness offset and a preference over domains.

**Global drift.** Each topic's popularity and appeal oscillate in time,
``g_k(t) = drift * a_k * sin(2 pi t / P_k + phi_k)`` with periods of 14-60 days, so the topic mix
and the click odds of later impressions differ from earlier ones (together with focus changes and
item launches, this makes a model trained on an early window stale on a later one).

**History.** Each user has ``N_u = min_history + LogNormal`` events before the window (median
``history_median``, log-sd ``history_sigma``, capped at ``history_limit``: tens to tens of
thousands; only ``max_history`` of them are ever stored), arriving as a
Poisson process at ``rate_u = N_u / tenure_u`` (``tenure_u ~ U[tenure_days]``: a short tenure makes an
active user, whose last few events are hours to days old), and keeps producing events at that rate during the
window. An event's topic is core / dormant / focus / a popular topic (by the rates above), its item
is drawn from that topic by popularity among launched items, its domain from the user's domain
preference, and its action is 0 view, 1 click or 2 conversion, drawn from the same affinity model
as impressions (with an organic base rate of about 20% engagement). **Transitions** (off by default): every
item has ``SUCCESSORS`` (3) "next" items (what people tend to engage with right after it: a sequel, an accessory,
the next step), ``transition_locality`` of them drawn from the item's own topic (a next item resembles the one
before it, so a model that compares items can find it) and the rest at random from the catalogue, and
``transition_rate`` of a user's events (all but the first materialised one) are instead a successor of the
previous event's item, when that is launched by then, so histories hold chains of successors. A row stores the
user's most recent ``max_history`` events strictly before its timestamp, oldest first; only those are ever
materialised, so the cost does not grow with ``N_u``.

**Impressions.** Rows are spread over users in proportion to ``rate_u ** 0.4`` (heavy users see
more ads, but every user has few rows, so nothing can be learnt by memorising ``user_id``: the
interests are recoverable only from history and attributes) and uniformly over the window of
``window_days`` days. The candidate comes from one of four retrieval channels: the topic of one
of the user's last 50 history events (``recent_target_frac``), an audience targeting the user's
core or dormant topic (``audience_target_frac``), a successor of one of the last history events (the ``a``-th
last with odds ``0.5 ** a``; ``transition_target_frac``, when that successor is launched), or a popular topic at
that time. Then::

    logit p_click = domain_bias[d]
                  + w_core[d] * core_weight * S[core, k] + dormant_weight * S[dormant, k]
                  + w_recent[d] * recent_weight * (S[focus_now, k] + 0.5 * S[focus_prev, k])
                  + cross[age, price] + cross[gender, k] + cross[device, format] + cross[region, k]
                  + quality[item] + clickiness[u] + domain_topic[d, k] + 0.5 * g_k(t)
                  + 0.4 * exp(-item_age / 5 days) - 0.3 * slot + 0.15 * cos(hour - 20h)
                  + 0.25 * exp(-hours since last event / 6) + N(0, noise_std)
                  + transition_weight * sum_{a < 8} 0.5 ** a * [item is a successor of the a-th last event's item]
    logit p_cvr   = cvr_bias[d] + 1.2 * S[core, k] + 0.8 * S[dormant, k] + cvr[item]
                  + cvr_cross[age, price] + N(0, noise_std)

``k`` is the candidate's topic and ``d`` the domain; ``domain_bias = logit(domain_base_ctr)`` and
``cvr_bias = logit(domain_base_cvr)``, so the base rates are those of a neutral impression and
realised rates come out several times higher (interest effects are positive). ``w_core[d]`` and ``w_recent[d]`` in ``[0.6, 1.4]`` make
the domains weigh long-term and recent interests differently. The transition term
(:func:`transition_affinity`) reads the stored history by position: a mean-pooled bag of the same items cannot
tell the last event from the 500th, a causal sequence model can; with the ``focus`` terms it is the world's
order-dependent signal (the ``sequential`` preset turns it on). ``p_conversion = p_click * p_cvr``
is ``P(conversion | impression)``; ``click ~ Bernoulli(p_click)`` and a conversion needs a click.

**Labels that are absent.** Advertisers without conversion tracking
(``untracked_advertiser_frac``) report no conversions: ``conversion`` is null on their rows, to be
masked in the loss (``click`` is always present).

**Domains.** ``domain_names`` / ``domain_shares`` / base rates: by default ``feed`` (60% of
traffic), ``reels`` (33%, lowest click and conversion rates) and ``marketplace`` (7%, the
data-poor domain, highest rates).

Features: sparse ``age_bucket``, ``gender``, ``region``, ``device``, ``interest_segments`` (user)
and ``item_topic``, ``advertiser``, ``ad_format``, ``price_bucket`` (item); ``dense`` holds
:data:`DENSE_FEATURES` in that order, each roughly in ``[-1, 1]``.

Layout and determinism
======================

Splits are by time: ``train`` holds the first ``split_fractions[0]`` of the window, ``test`` the
last, so ``max(train.timestamp) <= min(test.timestamp)``. Users are generated in blocks of
``users_per_block`` with one random stream per block, and rows are streamed to shards of
``rows_per_shard`` rows, so memory is bounded by a block plus a shard per split. Within a split,
rows are ordered by user, then time: consecutive rows of a user share most of their history, which
Parquet's compression then stores about 3x smaller than in time order. Readers shuffle (the
pipeline shuffles row groups and the rows within them). The same ``SynthConfig`` (seed included)
gives the same rows.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import multiprocessing
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import pyarrow as pa
import torch
from tqdm.auto import tqdm

from foundation.data.io import atomic_write_text, shard_path, write_table
from foundation.data.schema import SCHEMA_FILE, EventSchema, SparseFeature
from foundation.metrics import binary_metrics

T = TypeVar("T")

SPLITS = ("train", "valid", "test")
STATS_FILE = "synth.json"
DENSE_FEATURES = ("hour_sin", "hour_cos", "log_bid", "slot", "item_age", "session_gap")
BASE_TIMESTAMP = 1_704_067_200  # 2024-01-01 00:00 UTC, the start of the impression window
DAY = 86_400

AGE_PROBS = (0.08, 0.2, 0.22, 0.18, 0.14, 0.1, 0.08)
GENDER_PROBS = (0.49, 0.48, 0.03)
NUM_REGIONS = 16
DEVICE_PROBS = (0.55, 0.3, 0.1, 0.05)
FORMAT_PROBS = (0.4, 0.3, 0.2, 0.1)
NUM_PRICES = 5
SLOT_PROBS = (0.35, 0.25, 0.18, 0.13, 0.09)

# Ground-truth constants that are not worth a config field (see the module docstring).
EVERGREEN = -9e4  # launch day of items that were always there
KEY_SPAN = 2e5  # > any (day - EVERGREEN): separates topics in the item sampler's sorted keys
FIRST_DAY = -1500  # the topic-popularity table starts here; earlier events use its first day
RECENT_CHANNEL = 50  # how far back (events) the recent-history retrieval channel looks
DORMANT_RESIDUAL = 0.05  # share of the dormant rate left after the user moved on
NEAR_CORE_FOCUS = 0.35  # chance that a phase's focus is drawn near the core rather than by popularity
ORGANIC_CLICK_BIAS = -2.2  # organic engagement is far likelier than an ad click
ORGANIC_CONV_BIAS = -3.0
CONV_CORE, CONV_DORMANT = 1.2, 0.8
TREND_WEIGHT, FRESH_WEIGHT, SLOT_WEIGHT, HOUR_WEIGHT, SESSION_WEIGHT = 0.5, 0.4, 0.3, 0.15, 0.25
SUCCESSORS = 3  # "next" items per item in the transition map
TRANSITION_SPAN = 8  # how many of the last history events the transition term reads
TRANSITION_DECAY = 0.5  # the term's weight per event further back; also the next-item channel's anchor odds
_KEY_SHIFT = 40  # (user << 40) + seconds since BASE_TIMESTAMP + 2**38 orders events by user, then time
_KEY_BIAS = 2**38


@dataclass
class SynthConfig:
    """Size and ground truth of a synthetic ads world. Rates are per event, weights are logit units.

    ``transition_rate``, ``transition_target_frac`` and ``transition_weight`` (all 0 by default, which leaves the
    world exactly as without them) turn on the item-to-item transitions of the module docstring.
    ``transition_locality`` in [0, 1] is the share of each item's successors drawn from its own topic instead of
    the whole catalogue (0, the default, draws nothing more).

    ``num_examples`` impressions are written across the three splits; ``max_history`` caps the stored
    history per row (the most recent events are kept); ``users_per_block`` bounds memory (a block's
    rows and their histories are built at once).
    """

    num_users: int = 25_000
    num_items: int = 3_000
    num_domains: int = 3
    num_examples: int = 200_000
    max_history: int = 256
    seed: int = 0
    rows_per_shard: int = 32_768
    split_fractions: tuple[float, float, float] = (0.8, 0.1, 0.1)
    users_per_block: int = 2_048
    num_topics: int = 24
    num_advertisers: int = 300
    window_days: float = 14.0
    history_median: float = 100.0
    history_sigma: float = 1.4
    min_history: int = 16
    history_limit: int = 50_000
    tenure_days: tuple[float, float] = (90.0, 1095.0)
    domain_names: tuple[str, ...] = ("feed", "reels", "marketplace")
    domain_shares: tuple[float, ...] = (0.6, 0.33, 0.07)
    domain_base_ctr: tuple[float, ...] = (0.004, 0.003, 0.006)
    domain_base_cvr: tuple[float, ...] = (0.004, 0.003, 0.015)
    core_rate: float = 0.15
    dormant_rate: float = 0.3
    focus_rate: float = 0.55
    phase_days: float = 7.0
    core_weight: float = 2.0
    dormant_weight: float = 1.5
    recent_weight: float = 1.5
    cross_std: float = 0.3
    drift: float = 1.0
    noise_std: float = 0.35
    new_item_frac: float = 0.4
    untracked_advertiser_frac: float = 0.25
    recent_target_frac: float = 0.35
    audience_target_frac: float = 0.2
    transition_rate: float = 0.0
    transition_target_frac: float = 0.0
    transition_weight: float = 0.0
    transition_locality: float = 0.0

    def __post_init__(self) -> None:
        for name in (
            "split_fractions",
            "tenure_days",
            "domain_names",
            "domain_shares",
            "domain_base_ctr",
            "domain_base_cvr",
        ):
            setattr(self, name, tuple(getattr(self, name)))
        for name in (
            "num_users",
            "num_items",
            "num_examples",
            "max_history",
            "rows_per_shard",
            "users_per_block",
            "min_history",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"SynthConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_topics < 2 or self.num_items < self.num_topics or self.num_advertisers < 1:
            raise ValueError("SynthConfig needs num_topics >= 2, num_items >= num_topics and an advertiser")
        for name in ("domain_names", "domain_shares", "domain_base_ctr", "domain_base_cvr"):
            if len(getattr(self, name)) != self.num_domains:
                raise ValueError(
                    f"SynthConfig.{name} needs {self.num_domains} entries (num_domains), got {getattr(self, name)}"
                )
        if (
            len(self.split_fractions) != 3
            or min(self.split_fractions) <= 0
            or abs(sum(self.split_fractions) - 1) > 1e-6
        ):
            raise ValueError(
                f"SynthConfig.split_fractions must be 3 positive numbers summing to 1, got {self.split_fractions}"
            )
        if min(self.domain_shares) <= 0:
            raise ValueError(f"SynthConfig.domain_shares must be positive, got {self.domain_shares}")
        for name in ("domain_base_ctr", "domain_base_cvr"):
            if not all(0 < r < 1 for r in getattr(self, name)):
                raise ValueError(f"SynthConfig.{name} must lie in (0, 1), got {getattr(self, name)}")
        if (
            self.core_rate + self.dormant_rate + self.focus_rate > 1
            or min(self.core_rate, self.dormant_rate, self.focus_rate) < 0
        ):
            raise ValueError("SynthConfig: core_rate + dormant_rate + focus_rate must lie in [0, 1]")
        for name in ("recent_target_frac", "audience_target_frac", "transition_target_frac", "transition_weight"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"SynthConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.recent_target_frac + self.audience_target_frac + self.transition_target_frac > 1:
            raise ValueError(
                "SynthConfig: recent_target_frac + audience_target_frac + transition_target_frac must be <= 1"
            )
        if not 0 <= self.transition_rate < 1:
            raise ValueError(f"SynthConfig.transition_rate must lie in [0, 1), got {self.transition_rate}")
        if not 0 <= self.transition_locality <= 1:
            raise ValueError(f"SynthConfig.transition_locality must lie in [0, 1], got {self.transition_locality}")
        if not self.min_history <= self.history_limit:
            raise ValueError("SynthConfig: min_history must be <= history_limit")
        if self.window_days <= 0 or self.phase_days <= 0:
            raise ValueError("SynthConfig: window_days and phase_days must be positive")
        if len(self.tenure_days) != 2 or not 0 < self.tenure_days[0] <= self.tenure_days[1]:
            raise ValueError(f"SynthConfig.tenure_days must be (low, high) with 0 < low <= high, got {self.tenure_days}")


def build_schema(cfg: SynthConfig) -> EventSchema:
    """The :class:`EventSchema` of the world ``cfg`` describes (ctr task, 3 actions, with oracle)."""
    sparse = [
        SparseFeature("age_bucket", len(AGE_PROBS), "user"),
        SparseFeature("gender", len(GENDER_PROBS), "user"),
        SparseFeature("region", NUM_REGIONS, "user"),
        SparseFeature("device", len(DEVICE_PROBS), "user"),
        SparseFeature("interest_segments", cfg.num_topics, "user"),
        SparseFeature("item_topic", cfg.num_topics, "item"),
        SparseFeature("advertiser", cfg.num_advertisers, "item"),
        SparseFeature("ad_format", len(FORMAT_PROBS), "item"),
        SparseFeature("price_bucket", NUM_PRICES, "item"),
    ]
    return EventSchema(
        num_users=cfg.num_users,
        num_items=cfg.num_items,
        num_domains=cfg.num_domains,
        num_actions=3,
        sparse=sparse,
        dense_dim=len(DENSE_FEATURES),
        task="ctr",
        has_oracle=True,
        domain_names=list(cfg.domain_names),
        description=(
            f"synthetic ads world (seed {cfg.seed}); actions 0 view, 1 click, 2 conversion; "
            f"dense = {', '.join(DENSE_FEATURES)}; see foundation/data/synthetic.py for the ground truth"
        ),
    )


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(x, -30.0, 30.0)))


def _logit(p: float) -> float:
    return math.log(p / (1.0 - p))


def _cdf(weights: np.ndarray) -> np.ndarray:
    """Row-wise cumulative distribution of non-negative ``weights[R, C]``, last column exactly 1."""
    cum = np.cumsum(weights, axis=-1, dtype=np.float64)
    return cum / cum[..., -1:]


def _inverse_cdf(cdf: np.ndarray, rows: np.ndarray | int, u: np.ndarray) -> np.ndarray:
    """Category ``[n]`` drawn from row ``rows[n]`` of ``cdf[R, C]`` with uniforms ``u[n]``, vectorised.

    Offsetting row ``r`` by ``r`` makes the flattened table sorted, so one searchsorted serves all rows.
    """
    n_rows, n_cat = cdf.shape
    rows = np.broadcast_to(np.asarray(rows, dtype=np.int64), u.shape)
    flat = (cdf + np.arange(n_rows)[:, None]).ravel()
    idx = np.searchsorted(flat, u + rows, side="right") - rows * n_cat
    return np.clip(idx, 0, n_cat - 1)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _hash_uniform(*keys: np.ndarray) -> np.ndarray:
    """Uniforms in ``[0, 1)`` that depend only on the int64 ``keys`` (broadcast together).

    Counter-based, so a (user, phase) focus is the same wherever it is looked up, with no state to carry.
    """
    h = np.zeros(np.broadcast_shapes(*(np.shape(k) for k in keys)), dtype=np.uint64)
    for k in keys:
        h = _splitmix64(h ^ np.asarray(k, dtype=np.int64).view(np.uint64))
    return (h >> np.uint64(11)).astype(np.float64) * 2.0**-53


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(offsets[n+1], index[sum(lengths)])``: the concatenation of ``range(starts[i], starts[i]+lengths[i])``."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    index = np.arange(offsets[-1], dtype=np.int64) + np.repeat(starts - offsets[:-1], lengths)
    return offsets, index


@dataclass
class World:
    """The fixed parameters of the ground truth, drawn from ``seed`` alone. ``K`` topics, ``I`` items."""

    cfg: SynthConfig
    topic_pop: np.ndarray  # [K] log popularity
    topic_sim: np.ndarray  # [K, K] similarity, 1 on the diagonal
    trend_amp: np.ndarray  # [K]
    trend_period: np.ndarray  # [K] days
    trend_phase: np.ndarray  # [K]
    global_cdf: np.ndarray  # [days, K] topic distribution of popular picks per day from FIRST_DAY
    near_core_cdf: np.ndarray  # [K, K] focus distribution near each core topic
    static_pop_cdf: np.ndarray  # [1, K]
    core_cdf: np.ndarray  # [ages * genders, K] core topic given demographics
    cross_age_price: np.ndarray  # [ages, prices]
    cross_gender_topic: np.ndarray  # [genders, K]
    cross_device_format: np.ndarray  # [devices, formats]
    cross_region_topic: np.ndarray  # [regions, K]
    cvr_age_price: np.ndarray  # [ages, prices]
    domain_click_bias: np.ndarray  # [D]
    domain_cvr_bias: np.ndarray  # [D]
    domain_core_w: np.ndarray  # [D]
    domain_recent_w: np.ndarray  # [D]
    domain_topic: np.ndarray  # [D, K]
    advertiser_tracked: np.ndarray  # [A] bool
    item_topic: np.ndarray  # [I] int64
    item_advertiser: np.ndarray  # [I] int64
    item_format: np.ndarray  # [I] int64
    item_price: np.ndarray  # [I] int64
    item_quality: np.ndarray  # [I]
    item_cvr: np.ndarray  # [I] conversion propensity
    item_log_bid: np.ndarray  # [I]
    item_launch: np.ndarray  # [I] day (EVERGREEN for always-available items)
    item_successors: np.ndarray  # [I, SUCCESSORS] the items often engaged right after each item
    sampler_items: np.ndarray  # [I] item ids sorted by (topic, launch)
    sampler_keys: np.ndarray  # [I] topic * KEY_SPAN + launch - EVERGREEN, ascending
    sampler_cum: np.ndarray  # [I+1] cumulative popularity in sampler order, leading 0
    topic_start: np.ndarray  # [K] first sampler position of each topic

    def trend(self, topic: np.ndarray, t: np.ndarray) -> np.ndarray:
        """``g_k(t)`` for topics ``[n]`` at days ``[n]``."""
        angle = 2 * np.pi * t / self.trend_period[topic] + self.trend_phase[topic]
        return self.cfg.drift * self.trend_amp[topic] * np.sin(angle)

    def popular_topics(self, rng: np.random.Generator, t: np.ndarray) -> np.ndarray:
        """Topics ``[n]`` drawn by (drifting) popularity on the days of ``t[n]``."""
        day = np.clip(np.floor(t).astype(np.int64) - FIRST_DAY, 0, len(self.global_cdf) - 1)
        return _inverse_cdf(self.global_cdf, day, rng.random(len(t)))

    def sample_items(self, rng: np.random.Generator, topic: np.ndarray, t: np.ndarray) -> np.ndarray:
        """Items ``[n]`` of ``topic[n]`` launched by day ``t[n]``, drawn by popularity."""
        lo = self.topic_start[topic]
        hi = np.searchsorted(self.sampler_keys, topic * KEY_SPAN + (t - EVERGREEN), side="right")
        c0, c1 = self.sampler_cum[lo], self.sampler_cum[hi]
        pos = np.searchsorted(self.sampler_cum, c0 + rng.random(len(topic)) * (c1 - c0), side="right") - 1
        return self.sampler_items[np.clip(pos, lo, hi - 1)]


def make_world(cfg: SynthConfig) -> World:
    """Draw the world's fixed parameters (catalogue, cross effects, domains, trends) from ``cfg.seed``."""
    rng = np.random.default_rng([cfg.seed, 0])
    k, n_items, n_adv, n_dom = cfg.num_topics, cfg.num_items, cfg.num_advertisers, cfg.num_domains
    n_age, n_gender, n_dev = len(AGE_PROBS), len(GENDER_PROBS), len(DEVICE_PROBS)

    topic_pop = rng.normal(0, 0.7, k)
    centres = rng.normal(0, 1, (k, 3))
    topic_sim = np.exp(-0.5 * ((centres[:, None] - centres[None]) ** 2).sum(-1))
    trend_amp, trend_period, trend_phase = (
        rng.normal(0, 1, k),
        rng.uniform(14, 60, k),
        rng.uniform(0, 2 * np.pi, k),
    )
    days = np.arange(FIRST_DAY, math.ceil(cfg.window_days) + 1) + 0.5
    trend = cfg.drift * trend_amp * np.sin(2 * np.pi * days[:, None] / trend_period + trend_phase)
    global_cdf = _cdf(np.exp(topic_pop + trend))

    core_age, core_gender = rng.normal(0, 0.8, (n_age, k)), rng.normal(0, 0.8, (n_gender, k))
    core_logits = topic_pop + core_age[:, None, :] + core_gender[None, :, :]
    s = cfg.cross_std

    adv_topic = _inverse_cdf(_cdf(np.exp(topic_pop))[None], 0, rng.random(n_adv))
    adv_price = rng.integers(0, NUM_PRICES, n_adv)
    adv_tracked = rng.random(n_adv) >= cfg.untracked_advertiser_frac
    item_adv = _inverse_cdf(_cdf(rng.lognormal(0, 1, n_adv))[None], 0, rng.random(n_items))
    item_topic = np.where(rng.random(n_items) < 0.85, adv_topic[item_adv], rng.integers(0, k, n_items))
    item_launch = np.where(
        rng.random(n_items) < cfg.new_item_frac, rng.uniform(-180, cfg.window_days, n_items), EVERGREEN
    )
    # Every topic keeps one evergreen item, so there is always something to show.
    item_topic[:k], item_launch[:k] = np.arange(k), EVERGREEN
    item_price = np.clip(adv_price[item_adv] + rng.integers(-1, 2, n_items), 0, NUM_PRICES - 1)
    item_cvr = rng.normal(0, 0.6, n_items)
    order = np.lexsort((item_launch, item_topic))
    cum = np.zeros(n_items + 1)
    np.cumsum(rng.lognormal(0, 1, n_items)[order], out=cum[1:])
    return World(
        cfg=cfg,
        topic_pop=topic_pop,
        topic_sim=topic_sim,
        trend_amp=trend_amp,
        trend_period=trend_period,
        trend_phase=trend_phase,
        global_cdf=global_cdf,
        near_core_cdf=_cdf(topic_sim * np.exp(topic_pop)),
        static_pop_cdf=_cdf(np.exp(topic_pop))[None],
        core_cdf=_cdf(np.exp(core_logits)).reshape(n_age * n_gender, k),
        cross_age_price=rng.normal(0, s, (n_age, NUM_PRICES)),
        cross_gender_topic=rng.normal(0, s, (n_gender, k)),
        cross_device_format=rng.normal(0, s, (n_dev, len(FORMAT_PROBS))),
        cross_region_topic=rng.normal(0, s, (NUM_REGIONS, k)),
        cvr_age_price=rng.normal(0, s, (n_age, NUM_PRICES)),
        domain_click_bias=np.array([_logit(p) for p in cfg.domain_base_ctr]),
        domain_cvr_bias=np.array([_logit(p) for p in cfg.domain_base_cvr]),
        domain_core_w=rng.uniform(0.6, 1.4, n_dom),
        domain_recent_w=rng.uniform(0.6, 1.4, n_dom),
        domain_topic=rng.normal(0, 0.4, (n_dom, k)),
        advertiser_tracked=adv_tracked,
        item_topic=item_topic,
        item_advertiser=item_adv,
        item_format=_inverse_cdf(_cdf(np.array(FORMAT_PROBS))[None], 0, rng.random(n_items)),
        item_price=item_price,
        item_quality=rng.normal(0, 0.4, n_items),
        item_cvr=item_cvr,
        item_log_bid=0.5 * item_cvr + rng.normal(0, 0.4, n_items),
        item_launch=item_launch,
        item_successors=_draw_successors(cfg, item_topic, order),
        sampler_items=order,
        sampler_keys=item_topic[order] * KEY_SPAN + (item_launch[order] - EVERGREEN),
        sampler_cum=cum,
        topic_start=np.searchsorted(item_topic[order], np.arange(k)),
    )


def _draw_successors(cfg: SynthConfig, item_topic: np.ndarray, order: np.ndarray) -> np.ndarray:
    """``[I, SUCCESSORS]``: each item's next items, ``transition_locality`` of them another item of its topic.

    ``order[I]`` lists the items grouped by topic. Its own stream: the map exists in every world, and drawing it
    changes none of the other draws; at locality 0 it is exactly the uniform map.
    """
    rng = np.random.default_rng([cfg.seed, 4])
    n_items = len(item_topic)
    successors = rng.integers(0, n_items, (n_items, SUCCESSORS))
    if cfg.transition_locality == 0:
        return successors
    start = np.searchsorted(item_topic[order], np.arange(cfg.num_topics))
    others = np.diff(start, append=n_items)[item_topic] - 1  # items of the same topic, the item itself left out
    rank = np.empty(n_items, dtype=np.int64)
    rank[order] = np.arange(n_items)
    local = (rng.random((n_items, SUCCESSORS)) < cfg.transition_locality) & (others[:, None] > 0)
    pick = np.floor(rng.random((n_items, SUCCESSORS)) * others[:, None]).astype(np.int64)
    pick += start[item_topic][:, None]
    pick += pick >= rank[:, None]  # skips the item itself
    # An item alone in its topic is never local; the clip only keeps its unused index in range.
    return np.where(local, order[np.minimum(pick, n_items - 1)], successors)


def _user_activity(cfg: SynthConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(events_before_window[U], events_per_day[U], impressions[U])`` for all users.

    Drawn globally (a few numbers per user) because impressions are shared out over all users at once.
    """
    rng = np.random.default_rng([cfg.seed, 1])
    # Shifted so that every user has min_history events without a spike of users at exactly that count.
    excess = np.exp(
        rng.normal(math.log(max(cfg.history_median - cfg.min_history, 1)), cfg.history_sigma, cfg.num_users)
    )
    n_pre = np.minimum(cfg.min_history + np.round(excess), cfg.history_limit).astype(np.int64)
    rate = np.clip(n_pre / rng.uniform(*cfg.tenure_days, cfg.num_users), 0.05, 200.0)
    weight = rate**0.4
    return n_pre, rate, rng.multinomial(cfg.num_examples, weight / weight.sum())


@dataclass
class _Users:
    """Per-user state of one block of ``n`` users (local index ``0..n-1``)."""

    ids: np.ndarray  # [n] global user ids
    age: np.ndarray
    gender: np.ndarray
    region: np.ndarray
    device: np.ndarray
    core: np.ndarray
    dormant: np.ndarray
    has_dormant: np.ndarray  # [n] bool
    dormant_until: np.ndarray  # [n] events before the window end of the dormant era
    clickiness: np.ndarray
    domain_cdf: np.ndarray  # [n, D]
    phase_len: np.ndarray  # [n] days
    phase_offset: np.ndarray  # [n] days
    seg_offsets: np.ndarray  # [n+1] into seg_values
    seg_values: np.ndarray  # interest_segments, sorted per user


def _draw_users(rng: np.random.Generator, world: World, ids: np.ndarray) -> _Users:
    cfg, n, k = world.cfg, len(ids), world.cfg.num_topics
    age = _inverse_cdf(_cdf(np.array(AGE_PROBS))[None], 0, rng.random(n))
    gender = _inverse_cdf(_cdf(np.array(GENDER_PROBS))[None], 0, rng.random(n))
    region = _inverse_cdf(_cdf(1.0 / np.arange(1, NUM_REGIONS + 1) ** 0.8)[None], 0, rng.random(n))
    device = _inverse_cdf(_cdf(np.array(DEVICE_PROBS))[None], 0, rng.random(n))
    core = _inverse_cdf(world.core_cdf, age * len(GENDER_PROBS) + gender, rng.random(n))
    dormant = _inverse_cdf(world.core_cdf, age * len(GENDER_PROBS) + gender, rng.random(n))
    dormant = np.where(dormant == core, (core + 1 + rng.integers(0, k - 1, n)) % k, dormant)
    has_dormant = rng.random(n) < 0.7
    shares = np.array(cfg.domain_shares) / sum(cfg.domain_shares)
    phase_len = cfg.phase_days * rng.lognormal(-0.125, 0.5, n)  # mean phase_days

    # interest_segments: a noisy audience segment list (core 40%, dormant 30%, 0-3 random topics), never empty.
    cand = rng.integers(0, k, (n, 5))
    cand[:, 0], cand[:, 1] = core, dormant
    keep = np.zeros((n, 5), dtype=bool)
    keep[:, 0] = rng.random(n) < 0.4
    keep[:, 1] = has_dormant & (rng.random(n) < 0.3)
    keep[:, 2:] = np.arange(3) < np.minimum(rng.poisson(1.0, n), 3)[:, None]
    keep[:, 2] |= ~keep.any(axis=1)
    vals = np.sort(np.where(keep, cand, -1), axis=1)
    valid = (vals >= 0) & np.concatenate([np.ones((n, 1), bool), vals[:, 1:] != vals[:, :-1]], axis=1)
    seg_offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(valid.sum(axis=1), out=seg_offsets[1:])
    return _Users(
        ids=ids,
        age=age,
        gender=gender,
        region=region,
        device=device,
        core=core,
        dormant=dormant,
        has_dormant=has_dormant,
        dormant_until=rng.integers(64, 193, n),
        clickiness=rng.normal(0, 0.35, n),
        domain_cdf=_cdf(rng.dirichlet(shares * 10, n)),
        phase_len=phase_len,
        phase_offset=rng.uniform(0, 1, n) * phase_len,
        seg_offsets=seg_offsets,
        seg_values=vals[valid],
    )


def _focus(world: World, users: _Users, u: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(focus_now[n], focus_prev[n])``: focus topics of users ``u[n]`` at days ``t[n]`` and the phase before."""
    phase = np.floor((t + users.phase_offset[u]) / users.phase_len[u]).astype(np.int64)
    out = []
    for p in (phase, phase - 1):
        u1 = _hash_uniform(world.cfg.seed, users.ids[u], p, 1)
        u2 = _hash_uniform(world.cfg.seed, users.ids[u], p, 2)
        near = _inverse_cdf(world.near_core_cdf, users.core[u], u2)
        out.append(np.where(u1 < NEAR_CORE_FOCUS, near, _inverse_cdf(world.static_pop_cdf, 0, u2)))
    return out[0], out[1]


def _affinity(
    world: World,
    users: _Users,
    u: np.ndarray,
    topic: np.ndarray,
    domain: np.ndarray,
    focus: tuple[np.ndarray, np.ndarray],
) -> tuple[np.ndarray, np.ndarray]:
    """``(click_logit_part[n], cvr_logit_part[n])``: what the user's interests add for ``topic[n]``."""
    cfg, sim = world.cfg, world.topic_sim
    core = sim[users.core[u], topic]
    dormant = np.where(users.has_dormant[u], sim[users.dormant[u], topic], 0.0)
    recent = sim[focus[0], topic] + 0.5 * sim[focus[1], topic]
    click = (
        world.domain_core_w[domain] * cfg.core_weight * core
        + cfg.dormant_weight * dormant
        + world.domain_recent_w[domain] * cfg.recent_weight * recent
    )
    return click, CONV_CORE * core + CONV_DORMANT * dormant


def transition_affinity(world: World, offsets: np.ndarray, items: np.ndarray, candidate: np.ndarray) -> np.ndarray:
    """``[n]``: ``sum_a TRANSITION_DECAY**a * [candidate[r] is a successor of the a-th last event's item]``.

    ``a`` runs over the last ``TRANSITION_SPAN`` events of row ``r``'s history ``items[offsets[r]:offsets[r+1]]``
    (oldest first, as stored). It reads where each event sits, so a bag of the same items cannot express it.
    """
    lengths = np.diff(offsets)
    score = np.zeros(len(candidate))
    for back in range(TRANSITION_SPAN):
        rows = np.flatnonzero(lengths > back)
        successors = world.item_successors[items[offsets[rows + 1] - 1 - back]]
        score[rows] += TRANSITION_DECAY**back * (successors == candidate[rows, None]).any(axis=1)
    return score


def _follow_successors(
    rng: np.random.Generator, world: World, item: np.ndarray, t: np.ndarray, has_prev: np.ndarray
) -> np.ndarray:
    """``item[E]`` where ``transition_rate`` of the events with a previous one (``has_prev[E]``) become a
    successor of the previous event's (final) item, if that successor is launched by ``t[E]``.

    Runs of following events form chains; each pass settles one more link, so it takes the longest run's passes.
    """
    follow = np.flatnonzero(has_prev & (rng.random(len(item)) < world.cfg.transition_rate))
    pick = rng.integers(0, SUCCESSORS, len(follow))
    out = item.copy()
    while True:
        nxt = world.item_successors[out[follow - 1], pick]
        settled = np.where(world.item_launch[nxt] <= t[follow], nxt, item[follow])
        if np.array_equal(settled, out[follow]):
            return out
        out[follow] = settled


@dataclass
class _Events:
    """The materialised history events of a block, grouped by user, oldest first within a user."""

    offsets: np.ndarray  # [n+1]
    key: np.ndarray  # [E] (user << 40) + seconds since BASE_TIMESTAMP + 2**38, ascending
    timestamp: np.ndarray  # [E]
    topic: np.ndarray
    item: np.ndarray
    domain: np.ndarray
    action: np.ndarray
    skipped: np.ndarray  # [n] older events never materialised (they can never be in a stored history)


def _draw_events(
    rng: np.random.Generator,
    world: World,
    users: _Users,
    n_pre: np.ndarray,
    rate: np.ndarray,
    sequence_rng: np.random.Generator,
) -> _Events:
    cfg, n = world.cfg, len(users.ids)
    shown = np.minimum(n_pre, cfg.max_history)
    in_window = rng.poisson(rate * cfg.window_days)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(shown + in_window, out=offsets[1:])
    user = np.repeat(np.arange(n), shown + in_window)
    pos = np.arange(offsets[-1]) - offsets[user]
    is_pre = pos < shown[user]

    # Before the window: a Poisson process read backwards from day 0; back[j] = events after this one.
    gap_offsets, _ = _ranges(np.zeros(n, dtype=np.int64), shown)
    before = np.cumsum(rng.exponential(1.0, gap_offsets[-1]) / np.repeat(rate, shown))
    before -= np.repeat(np.concatenate([[0.0], before])[gap_offsets[:-1]], shown)
    back = shown[user] - 1 - pos
    t = np.empty(len(user))
    t[is_pre] = -before[(gap_offsets[user] + back)[is_pre]]
    win_user = np.repeat(np.arange(n), in_window)
    win_t = rng.uniform(0, cfg.window_days, len(win_user))
    t[~is_pre] = win_t[np.lexsort((win_t, win_user))]

    seconds = np.floor(t * DAY).astype(np.int64)
    t = seconds / DAY  # the day that matches the stored timestamp exactly
    focus = _focus(world, users, user, t)
    dormant_era = is_pre & users.has_dormant[user] & (back >= users.dormant_until[user])
    dormant_rate = np.where(
        dormant_era, cfg.dormant_rate, cfg.dormant_rate * DORMANT_RESIDUAL * users.has_dormant[user]
    )
    c = rng.random(len(user))
    topic = np.where(
        c < cfg.core_rate,
        users.core[user],
        np.where(
            c < cfg.core_rate + dormant_rate,
            users.dormant[user],
            np.where(
                c < cfg.core_rate + dormant_rate + cfg.focus_rate, focus[0], world.popular_topics(rng, t)
            ),
        ),
    )
    item = world.sample_items(rng, topic, t)
    if cfg.transition_rate > 0:
        item = _follow_successors(sequence_rng, world, item, t, pos > 0)
        topic = world.item_topic[item]  # sample_items keeps each item in its topic, so only successors change
    domain = _inverse_cdf(users.domain_cdf, user, rng.random(len(user)))
    click_part, cvr_part = _affinity(world, users, user, topic, domain, focus)
    noise = rng.normal(0, cfg.noise_std, (2, len(user)))
    p_click = _sigmoid(
        ORGANIC_CLICK_BIAS + click_part + users.clickiness[user] + world.item_quality[item] + noise[0]
    )
    p_cvr = _sigmoid(ORGANIC_CONV_BIAS + cvr_part + world.item_cvr[item] + noise[1])
    click = rng.random(len(user)) < p_click
    action = click.astype(np.int32) + (click & (rng.random(len(user)) < p_cvr))
    return _Events(
        offsets=offsets,
        key=(user << _KEY_SHIFT) + seconds + _KEY_BIAS,
        timestamp=BASE_TIMESTAMP + seconds,
        topic=topic,
        item=item,
        domain=domain.astype(np.int32),
        action=action,
        skipped=n_pre - shown,
    )


def _list_array(offsets: np.ndarray, values: np.ndarray, value_type: pa.DataType) -> pa.ListArray:
    if offsets[-1] > np.iinfo(np.int32).max:
        raise ValueError("a block holds more than 2**31 list values; lower SynthConfig.users_per_block")
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values, value_type))


def _one_hot_list(values: np.ndarray) -> pa.ListArray:
    return _list_array(np.arange(len(values) + 1), values, pa.int64())


def _next_item_candidates(
    rng: np.random.Generator, world: World, events: _Events, end: np.ndarray, start: np.ndarray, t: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``(item[n], launched[n])``: a successor of one of each row's last events (the a-th last with odds
    ``TRANSITION_DECAY**a``), and whether it is launched by ``t[n]``. ``end``/``start``: the history's range."""
    back = np.minimum(rng.geometric(1 - TRANSITION_DECAY, len(end)) - 1, end - start - 1)
    item = world.item_successors[events.item[end - 1 - back], rng.integers(0, SUCCESSORS, len(end))]
    return item, world.item_launch[item] <= t


def _draw_impressions(
    rng: np.random.Generator,
    world: World,
    users: _Users,
    events: _Events,
    rows: np.ndarray,
    first_id: int,
    sequence_rng: np.random.Generator,
) -> tuple[dict[str, np.ndarray], pa.Table]:
    """The block's impressions: ``(arrays for stats, table in schema order)``, rows grouped by user, then time."""
    cfg = world.cfg
    user = np.repeat(np.arange(len(users.ids)), rows)
    n = len(user)
    seconds = np.floor(rng.uniform(0, cfg.window_days, n) * DAY).astype(np.int64)
    order = np.lexsort((seconds, user))
    seconds = seconds[order]
    t = seconds / DAY

    # History: every materialised event strictly before the impression, the last max_history of them.
    first = events.offsets[user]
    end = np.searchsorted(events.key, (user << _KEY_SHIFT) + seconds + _KEY_BIAS, side="left")
    start = np.maximum(first, end - cfg.max_history)
    hist_offsets, hist_index = _ranges(start, end - start)

    # Candidate retrieval: recent history, audience targeting, the next items of the last events, or popularity.
    channel = rng.random(n)
    recent = events.topic[
        end - 1 - np.floor(rng.random(n) * np.minimum(RECENT_CHANNEL, end - first)).astype(np.int64)
    ]
    audience = np.where(
        users.has_dormant[user] & (rng.random(n) < 0.5), users.dormant[user], users.core[user]
    )
    topic = np.where(
        channel < cfg.recent_target_frac,
        recent,
        np.where(
            channel < cfg.recent_target_frac + cfg.audience_target_frac,
            audience,
            world.popular_topics(rng, t),
        ),
    )
    item = world.sample_items(rng, topic, t)
    hist_items = events.item[hist_index]
    if cfg.transition_target_frac > 0:
        next_item, launched = _next_item_candidates(sequence_rng, world, events, end, start, t)
        targeted = cfg.recent_target_frac + cfg.audience_target_frac
        use = launched & (channel >= targeted) & (channel < targeted + cfg.transition_target_frac)
        item, topic = np.where(use, next_item, item), np.where(use, world.item_topic[next_item], topic)
    domain = _inverse_cdf(users.domain_cdf, user, rng.random(n))
    slot = _inverse_cdf(_cdf(np.array(SLOT_PROBS))[None], 0, rng.random(n))
    log_bid = world.item_log_bid[item] + rng.normal(0, 0.2, n)
    item_age = np.minimum(t - world.item_launch[item], 365.0)
    gap_hours = (BASE_TIMESTAMP + seconds - events.timestamp[end - 1]) / 3600.0
    hour = (t % 1.0) * 24.0

    focus = _focus(world, users, user, t)
    click_part, cvr_part = _affinity(world, users, user, topic, domain, focus)
    price, fmt = world.item_price[item], world.item_format[item]
    age, gender = users.age[user], users.gender[user]
    cross = (
        world.cross_age_price[age, price]
        + world.cross_gender_topic[gender, topic]
        + world.cross_device_format[users.device[user], fmt]
        + world.cross_region_topic[users.region[user], topic]
    )
    noise = rng.normal(0, cfg.noise_std, (2, n))
    click_logit = (
        world.domain_click_bias[domain]
        + click_part
        + cross
        + world.item_quality[item]
        + users.clickiness[user]
        + world.domain_topic[domain, topic]
        + TREND_WEIGHT * world.trend(topic, t)
        + FRESH_WEIGHT * np.exp(-item_age / 5.0)
        - SLOT_WEIGHT * slot
        + HOUR_WEIGHT * np.cos(2 * np.pi * (hour - 20.0) / 24.0)
        + SESSION_WEIGHT * np.exp(-gap_hours / 6.0)
        + noise[0]
    )
    if cfg.transition_weight > 0:
        click_logit += cfg.transition_weight * transition_affinity(world, hist_offsets, hist_items, item)
    cvr_logit = (
        world.domain_cvr_bias[domain]
        + cvr_part
        + world.item_cvr[item]
        + world.cvr_age_price[age, price]
        + noise[1]
    )
    p_click, p_cvr = _sigmoid(click_logit), _sigmoid(cvr_logit)
    click = rng.random(n) < p_click
    conversion = click & (rng.random(n) < p_cvr)
    tracked = world.advertiser_tracked[world.item_advertiser[item]]

    dense = np.stack(
        [
            np.sin(2 * np.pi * hour / 24.0),
            np.cos(2 * np.pi * hour / 24.0),
            log_bid,
            slot / (len(SLOT_PROBS) - 1),
            np.log1p(item_age) / np.log1p(365.0),
            np.log1p(gap_hours) / np.log1p(24.0 * 365.0),
        ],
        axis=1,
    ).astype(np.float32)
    seg_offsets, seg_index = _ranges(users.seg_offsets[user], np.diff(users.seg_offsets)[user])
    columns = {
        "example_id": pa.array(first_id + np.arange(n), pa.int64()),
        "user_id": pa.array(users.ids[user], pa.int64()),
        "item_id": pa.array(item, pa.int64()),
        "domain": pa.array(domain, pa.int32()),
        "timestamp": pa.array(BASE_TIMESTAMP + seconds, pa.int64()),
        "age_bucket": _one_hot_list(age),
        "gender": _one_hot_list(gender),
        "region": _one_hot_list(users.region[user]),
        "device": _one_hot_list(users.device[user]),
        "interest_segments": _list_array(seg_offsets, users.seg_values[seg_index], pa.int64()),
        "item_topic": _one_hot_list(topic),
        "advertiser": _one_hot_list(world.item_advertiser[item]),
        "ad_format": _one_hot_list(fmt),
        "price_bucket": _one_hot_list(price),
        "dense": _list_array(np.arange(n + 1) * dense.shape[1], dense.ravel(), pa.float32()),
        "history_item_ids": _list_array(hist_offsets, hist_items, pa.int64()),
        "history_actions": _list_array(hist_offsets, events.action[hist_index], pa.int32()),
        "history_timestamps": _list_array(hist_offsets, events.timestamp[hist_index], pa.int64()),
        "history_domains": _list_array(hist_offsets, events.domain[hist_index], pa.int32()),
        "click": pa.array(click.astype(np.int8), pa.int8()),
        "conversion": pa.array(conversion.astype(np.int8), pa.int8(), mask=~tracked),
        "p_click": pa.array(p_click.astype(np.float32), pa.float32()),
        "p_conversion": pa.array((p_click * p_cvr).astype(np.float32), pa.float32()),
    }
    arrays = {
        "seconds": seconds,
        "domain": domain,
        "topic": topic,
        "click": click,
        "conversion": conversion,
        "tracked": tracked,
        "p_click": p_click,
        "p_conversion": p_click * p_cvr,
        "history_len": end - start,
        "true_history_len": events.skipped[user] + end - first,
    }
    return arrays, pa.Table.from_pydict(columns)


class _ShardWriter:
    """Buffers one split's rows and writes them as ``rows_per_shard``-row shards, in arrival order.

    Each shard is encoded and hashed on ``pool`` (Parquet's zstd and SHA-256 release the GIL), so the one process
    collecting the blocks does not encode them one after another; at most ``ahead`` shards are pending, which bounds
    memory. The shards and their boundaries are the same as when written in turn.
    """

    def __init__(self, out_dir: Path, split: str, rows_per_shard: int, arrow_schema: pa.Schema,
                 pool: Executor, ahead: int):
        self.out_dir, self.split, self.rows_per_shard, self.schema = out_dir, split, rows_per_shard, arrow_schema
        self.pool, self.ahead = pool, ahead
        self.pending: deque[Future] = deque()
        self.buffer: list[pa.Table] = []
        self.buffered = 0
        self.shards = 0

    def add(self, table: pa.Table) -> None:
        self.buffer.append(table)
        self.buffered += table.num_rows
        while self.buffered >= self.rows_per_shard:
            self._write(self.rows_per_shard)

    def close(self) -> None:
        """Write the last (short) shard and wait for every pending one; a failed write raises here."""
        # An empty split still gets one (empty) shard, so every split of the layout exists.
        if self.buffered or not self.shards:
            self._write(self.buffered)
        while self.pending:
            self.pending.popleft().result()

    def _write(self, rows: int) -> None:
        table = pa.concat_tables(self.buffer) if self.buffer else self.schema.empty_table()
        shard, rest = table.slice(0, rows), table.slice(rows)
        path = shard_path(self.out_dir, self.split, self.shards)
        self.pending.append(self.pool.submit(lambda: write_table(shard.cast(self.schema), path)))
        while len(self.pending) > self.ahead:
            self.pending.popleft().result()
        self.shards += 1
        self.buffer = [rest] if rest.num_rows else []
        self.buffered = rest.num_rows


def _oracle_metrics(labels: np.ndarray, probs: np.ndarray) -> dict[str, float]:
    """NE and AUC of the true probabilities ``probs[n]`` on ``labels[n]``."""
    metrics = binary_metrics(torch.from_numpy(probs), torch.from_numpy(labels.astype(np.float64)))
    return {"ne": metrics["ne"], "auc": metrics["auc"]}


def _percentiles(counts: np.ndarray) -> dict[str, float]:
    """Percentiles of a distribution given as ``counts[value]``."""
    cum = np.cumsum(counts)
    out = {f"p{q}": int(np.searchsorted(cum, q / 100 * cum[-1])) for q in (1, 10, 50, 90, 99)}
    out["max"] = int(np.flatnonzero(counts)[-1])
    out["mean"] = float((np.arange(len(counts)) * counts).sum() / cum[-1])
    return out


class _Stats:
    """Running totals over all rows, plus the test split's labels and oracle probabilities."""

    def __init__(self, cfg: SynthConfig):
        d = cfg.num_domains
        self.split_rows = np.zeros(3, dtype=np.int64)
        self.topic_counts = np.zeros((3, cfg.num_topics), dtype=np.int64)
        self.rows, self.clicks, self.tracked, self.tracked_clicks, self.conversions = (
            np.zeros(d, np.int64) for _ in range(5)
        )
        self.history_len = np.zeros(cfg.max_history + 1, dtype=np.int64)
        self.true_history_len = np.zeros(cfg.history_limit + 1, dtype=np.int64)
        self.test: list[dict[str, np.ndarray]] = []

    def add(self, a: dict[str, np.ndarray], split: np.ndarray) -> None:
        d = len(self.rows)
        self.split_rows += np.bincount(split, minlength=3)
        np.add.at(self.topic_counts, (split, a["topic"]), 1)
        self.rows += np.bincount(a["domain"], minlength=d)
        self.clicks += np.bincount(a["domain"], weights=a["click"], minlength=d).astype(np.int64)
        self.tracked += np.bincount(a["domain"], weights=a["tracked"], minlength=d).astype(np.int64)
        self.tracked_clicks += np.bincount(
            a["domain"], weights=a["click"] & a["tracked"], minlength=d
        ).astype(np.int64)
        self.conversions += np.bincount(
            a["domain"], weights=a["conversion"] & a["tracked"], minlength=d
        ).astype(np.int64)
        self.history_len += np.bincount(a["history_len"], minlength=len(self.history_len))
        true_len = np.bincount(a["true_history_len"])
        if len(true_len) > len(self.true_history_len):  # window events can push past history_limit
            self.true_history_len = np.pad(
                self.true_history_len, (0, len(true_len) - len(self.true_history_len))
            )
        self.true_history_len[: len(true_len)] += true_len
        test = split == 2
        self.test.append(
            {k: a[k][test] for k in ("click", "conversion", "tracked", "p_click", "p_conversion")}
        )

    def summary(self, cfg: SynthConfig, seconds: float) -> dict:
        names = list(cfg.domain_names)
        test = {k: np.concatenate([t[k] for t in self.test]) for k in self.test[0]}
        tracked = test["tracked"]
        mix = self.topic_counts / np.maximum(self.topic_counts.sum(axis=1, keepdims=True), 1)
        total = int(self.rows.sum())
        return {
            "rows": dict(zip(SPLITS, self.split_rows.tolist(), strict=True)),
            "total_rows": total,
            "seconds": round(seconds, 3),
            "rows_per_s": round(total / max(seconds, 1e-9), 1),
            "history_events_per_s": round(
                float((np.arange(len(self.history_len)) * self.history_len).sum()) / max(seconds, 1e-9), 1
            ),
            "domain_share": dict(zip(names, (self.rows / total).tolist(), strict=True)),
            "click_rate": float(self.clicks.sum() / total),
            "domain_click_rate": dict(
                zip(names, (self.clicks / np.maximum(self.rows, 1)).tolist(), strict=True)
            ),
            "conversion_rate": float(self.conversions.sum() / max(self.tracked.sum(), 1)),
            "conv_per_click": float(self.conversions.sum() / max(self.tracked_clicks.sum(), 1)),
            "domain_conv_per_click": dict(
                zip(names, (self.conversions / np.maximum(self.tracked_clicks, 1)).tolist(), strict=True)
            ),
            "conversion_label_coverage": float(self.tracked.sum() / total),
            "history_len": _percentiles(self.history_len),
            "true_history_len": _percentiles(self.true_history_len),
            "topic_drift_tv_train_test": float(0.5 * np.abs(mix[0] - mix[2]).sum()),
            "oracle_test": {
                "click": _oracle_metrics(test["click"], test["p_click"]),
                "conversion": _oracle_metrics(test["conversion"][tracked], test["p_conversion"][tracked]),
            },
        }


def _draw_block(
    cfg: SynthConfig,
    world: World,
    n_pre: np.ndarray,
    rate: np.ndarray,
    rows: np.ndarray,
    first_ids: np.ndarray,
    split_at: np.ndarray,
    block: int,
) -> tuple[dict[str, np.ndarray], np.ndarray, list[pa.Table]]:
    """The impressions of users block ``block``: their arrays, each row's split (0/1/2) and one table per split.

    The split happens here, in the worker, so that the process writing the shards only concatenates and slices."""
    lo = block * cfg.users_per_block
    ids = np.arange(lo, min(lo + cfg.users_per_block, cfg.num_users))
    rng = np.random.default_rng([cfg.seed, 2, block])
    # The order-dependent terms draw from their own stream, so switching them off changes no other draw.
    sequence_rng = np.random.default_rng([cfg.seed, 3, block])
    users = _draw_users(rng, world, ids)
    events = _draw_events(rng, world, users, n_pre[ids], rate[ids], sequence_rng)
    arrays, table = _draw_impressions(rng, world, users, events, rows[ids], int(first_ids[lo]), sequence_rng)
    split = np.searchsorted(split_at, arrays["seconds"], side="right")
    return arrays, split, [table.take(np.flatnonzero(split == s)) for s in range(len(SPLITS))]


_worker_draw: Callable[[int], object] | None = None


def _set_worker_draw(draw: Callable[[int], object]) -> None:
    """Pool initializer: the world and per-user arrays reach each worker once, not with every block."""
    global _worker_draw
    _worker_draw = draw


def _draw_in_worker(block: int) -> object:
    return _worker_draw(block)


def _in_order(draw: Callable[[int], T], count: int, workers: int) -> Iterator[T]:
    """``draw(0), ..., draw(count - 1)`` in order, computed by ``workers`` processes when it is above 1.

    At most ``2 * workers`` blocks are drawn ahead of the one being consumed, which bounds memory.
    """
    if workers <= 1:
        yield from map(draw, range(count))
        return
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_set_worker_draw, initargs=(draw,)) as pool:
        ahead: deque[Future] = deque()
        for block in range(count):
            ahead.append(pool.submit(_draw_in_worker, block))
            if len(ahead) >= 2 * workers:
                yield ahead.popleft().result()
        while ahead:
            yield ahead.popleft().result()


def generate_world(cfg: SynthConfig, out_dir: str | Path, *, progress: bool = True, workers: int = 1) -> dict:
    """Write the world ``cfg`` describes as a dataset under ``out_dir`` and return its statistics.

    ``workers`` processes draw user blocks in parallel (each block has its own random stream, so the
    dataset is the same for any number of workers); one process writes them in order.

    Layout: ``{train,valid,test}/part-NNNNN.parquet`` (rows ordered by user, then time), then
    ``synth.json`` (config and stats) and, last, ``schema.json``: a dataset without ``schema.json``
    is incomplete. A dataset already at ``out_dir`` is replaced (its ``part-*.parquet`` shards and their
    ``.sha256`` sidecars are deleted).

    Returns rows per split, rows/s, per-domain traffic share, click and conversion rates, conversion
    per click, history length percentiles (stored and uncapped), the train/test topic-mix total
    variation, and the oracle NE and AUC of ``p_click``/``p_conversion`` on the test split.
    """
    out_dir = Path(out_dir)
    # Replace a previous dataset here: unmark it first (no schema.json = incomplete), then drop its
    # shards so that none from a larger earlier run survives among the new ones.
    (out_dir / SCHEMA_FILE).unlink(missing_ok=True)
    for split in SPLITS:
        for pattern in ("part-*.parquet", ".part-*.parquet.sha256"):
            for stale in (out_dir / split).glob(pattern):
                stale.unlink()
    start_time = time.perf_counter()
    schema = build_schema(cfg)
    arrow_schema = schema.arrow_schema()
    world = make_world(cfg)
    n_pre, rate, rows = _user_activity(cfg)
    first_ids = np.concatenate([[0], np.cumsum(rows)])
    frac = np.cumsum(cfg.split_fractions)
    split_at = np.floor(frac[:2] * cfg.window_days * DAY).astype(np.int64)
    stats = _Stats(cfg)
    threads = max(1, min(workers, 8))
    pool = ThreadPoolExecutor(threads)
    writers = [_ShardWriter(out_dir, s, cfg.rows_per_shard, arrow_schema, pool, 2 * threads) for s in SPLITS]

    draw = functools.partial(_draw_block, cfg, world, n_pre, rate, rows, first_ids, split_at)
    num_blocks = -(-cfg.num_users // cfg.users_per_block)
    with pool, tqdm(total=cfg.num_examples, unit="row", desc="synthetic world", disable=not progress) as bar:
        for arrays, split, tables in _in_order(draw, num_blocks, workers):
            stats.add(arrays, split)
            for writer, table in zip(writers, tables, strict=True):
                if table.num_rows:
                    writer.add(table)
            bar.update(len(split))
        for writer in writers:
            writer.close()
    summary = stats.summary(cfg, time.perf_counter() - start_time)
    summary["shards"] = dict(zip(SPLITS, [w.shards for w in writers], strict=True))
    summary["bytes_on_disk"] = sum(p.stat().st_size for s in SPLITS for p in (out_dir / s).glob("*.parquet"))
    atomic_write_text(
        out_dir / STATS_FILE, json.dumps({"config": dataclasses.asdict(cfg), "stats": summary}, indent=2)
    )
    schema.save(out_dir)
    return summary
