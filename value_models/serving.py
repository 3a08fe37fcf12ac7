"""Value-model scoring at serving time: ``score(user_id, candidate_ids, context) -> scores per task``.

A trained :class:`value_models.student.StudentRanker` scores one user against ``N`` candidates. Its inputs
come from one version of the embedding store (:mod:`transfer.store`), the serving-time feature source:

- user side, from the user's latest row as of that version: multi-hot user features, the
  ``history_len`` most recent history items, dense features, and the teacher's ``user_repr``;
- item side, from each candidate's latest row: multi-hot item features and the teacher's ``item_repr``;
- request side, from ``context``: ``domain`` (required: the surface being ranked), optionally
  ``dense`` (``[D]`` or ``[N, D]``, request/candidate-level dense features that replace the user's
  stored ones) and ``now`` (request time in the data's timestamp unit, for user staleness).

The user side is computed once, the candidate side as one batched ``[N, ...]`` pass (no Python loop over
candidates) through :class:`ServingStudent`, which reuses the student's parameters and gives its serving
head's logits for the request's domain.

Fallbacks (each counted in :class:`FallbackCounters` and reported per response):

- ``unknown_users``: a user absent from the version is scored with no user features, an empty history,
  zero dense features (unless ``context["dense"]``) and the version's mean ``user_repr``;
- ``unknown_items``: a candidate absent from the version (but inside the model's item vocabulary) is
  scored with its id embedding, no item features and the version's mean ``item_repr``;
- ``stale_users``: with ``max_user_age`` and ``context["now"]``, a user whose stored row is older than
  that keeps its features but gets the mean ``user_repr`` (its teacher vector no longer describes it;
  a student without teacher vectors is scored as usual and the user only counted);
- ``stale_store``: a version older than ``max_store_age_s`` (wall clock, from its manifest) is still
  served, since it is the newest there is, but the response says ``stale_store`` and the count grows.

Bad requests (wrong types, unknown context fields, ids out of range, more candidates than the budget)
raise :class:`ScoringError` naming the field; the REST layer maps it to a 4xx.

Each model declares a :class:`LatencyBudget`: at most ``max_candidates`` per request, and a p99 on one CPU
thread at that size. :func:`check_budget` measures it and refuses a model over budget (used when
registering, :mod:`value_models.packaging`).

Store versions: a :class:`Scorer` that follows ``LATEST`` swaps its whole snapshot (store + derived
tensors) in one reference assignment; each request reads the reference once, so every response comes
from one whole version, which it names.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from foundation.checkpoint import read_training_checkpoint
from foundation.config import dataclass_from_dict
from foundation.data.io import CorruptFileError, atomic_path, atomic_write_text, sha256_file
from foundation.data.pipeline import gather_jagged
from foundation.data.schema import TASKS, EventSchema
from foundation.messages import shown
from transfer.distill import AuxiliaryHeads
from transfer.sharing import restore_shared_layout, sharing_config
from transfer.store import EmbeddingStore, StoreError, latest_version, open_store
from value_models.student import ITEM_TABLE, StudentConfig, StudentRanker

CONTEXT_FIELDS = ("domain", "dense", "now")
FORMS = ("eager", "inference_mode", "torchscript", "compile")
FALLBACKS = ("unknown_users", "unknown_items", "stale_users", "stale_store")
INT64_MAX = 2**63 - 1
STUDENT_WEIGHTS = "student.safetensors"
STUDENT_CONFIG = "student.json"


class ScoringError(ValueError):
    """A bad scoring request (the caller's fault): names the field; a 4xx at the REST layer."""


class BudgetError(ValueError):
    """A model that does not meet its declared latency budget, or cannot be served as configured."""


@dataclass(frozen=True)
class LatencyBudget:
    """At most ``max_candidates`` per request, scored with p99 ``<= p99_ms`` on one CPU thread."""

    max_candidates: int = 256
    p99_ms: float = 2.0


@dataclass
class ServingConfig:
    """How a :class:`Scorer` serves: budget, staleness limits, form, store following.

    ``max_store_age_s``: wall-clock age of a store version past which it counts as stale (None: never).
    ``max_user_age``: data-clock age (``context["now"] - user timestamp``) past which a user's teacher
    vector is replaced by the mean (None: never). ``form`` is one of :data:`FORMS`. ``follow_latest``
    re-reads the store's ``LATEST`` at most every ``refresh_interval_s``.
    """

    budget: LatencyBudget = field(default_factory=LatencyBudget)
    max_store_age_s: float | None = None
    max_user_age: int | None = None
    form: str = "inference_mode"
    follow_latest: bool = True
    refresh_interval_s: float = 1.0
    verify_store: bool = True

    def __post_init__(self) -> None:
        if self.form not in FORMS:
            raise ValueError(f"serving form must be one of {FORMS}, got {self.form!r}")
        if self.budget.max_candidates < 1 or self.budget.p99_ms <= 0:
            raise ValueError(f"a latency budget needs max_candidates >= 1 and p99_ms > 0, got {self.budget}")


class ServingStudent(nn.Module):
    """The student's serving path for one user and ``N`` candidates, from plain tensors.

    Shares the student's parameters. Inputs (``F_u``/``F_i`` user/item multi-hot features):
    ``user_values``: ``F_u`` tensors ``[k_f]`` (one bag each); ``history``: ``[h]`` item ids, ``h <= history_len``;
    ``dense``: ``[1, D]`` or ``[N, D]``; ``domain``: ``[1]``; ``item_values``/``item_offsets``: ``F_i`` jagged
    columns ``[M_f]``/``[N]`` (bag starts); ``candidates``: ``[N]``; ``user_repr``: ``[1, d_u]``; ``item_repr``:
    ``[N, d_i]`` (``d = 0`` when the student takes no teacher representations).
    Returns the serving head's logits ``[N, len(TASKS)]`` for the domain.
    """

    def __init__(self, student: StudentRanker) -> None:
        super().__init__()
        schema, cfg = student.schema, student.cfg
        self.user_tables = nn.ModuleList(
            [student.tables[f"t_{f.name}"] for f in schema.sparse if f.side == "user"]
        )
        self.item_tables = nn.ModuleList(
            [student.tables[f"t_{f.name}"] for f in schema.sparse if f.side == "item"]
        )
        self.item_table = student.tables[ITEM_TABLE]
        self.domain_emb = student.domain_emb
        self.trunk = student.trunk
        self.head = student.heads.serve if isinstance(student.heads, AuxiliaryHeads) else student.heads
        self.use_history = cfg.history_len > 0
        self.use_dense = schema.dense_dim > 0
        self.use_repr = cfg.teacher_repr
        self.num_domains = schema.num_domains
        self.num_tasks = len(TASKS)

    def forward(
        self,
        user_values: list[torch.Tensor],
        history: torch.Tensor,
        dense: torch.Tensor,
        domain: torch.Tensor,
        item_values: list[torch.Tensor],
        item_offsets: list[torch.Tensor],
        candidates: torch.Tensor,
        user_repr: torch.Tensor,
        item_repr: torch.Tensor,
    ) -> torch.Tensor:
        n = candidates.shape[0]
        one_bag = torch.zeros(1, dtype=torch.long)
        # Indexed loops over the (few) feature tables: TorchScript cannot zip a ModuleList.
        user: list[torch.Tensor] = []
        for i, table in enumerate(self.user_tables):
            user.append(table(user_values[i], one_bag))
        if self.use_history:
            user.append(self.item_table(history, one_bag))
        item: list[torch.Tensor] = []
        for i, table in enumerate(self.item_tables):
            item.append(table(item_values[i], item_offsets[i]))
        item.append(self.item_table(candidates.unsqueeze(1)))
        # The student's feature order: user bags, item bags, domain, dense, teacher user/item reprs.
        features = [
            torch.cat(user, dim=1).expand(n, -1),
            torch.cat(item, dim=1),
            self.domain_emb(domain).expand(n, -1),
        ]
        if self.use_dense:
            features.append(dense.expand(n, -1))
        if self.use_repr:
            features += [user_repr.expand(n, -1), item_repr]
        logits = self.head(self.trunk(torch.cat(features, dim=1)))
        return logits.view(n, self.num_domains, self.num_tasks)[:, domain[0]]


@dataclass
class StoreSnapshot:
    """One store version and what scoring derives from it once: mean teacher vectors, staleness."""

    store: EmbeddingStore
    mean_user_repr: torch.Tensor
    mean_item_repr: torch.Tensor
    stale: bool

    @property
    def version(self) -> int:
        return self.store.version


def build_snapshot(store: EmbeddingStore, max_store_age_s: float | None) -> StoreSnapshot:
    """Means of ``users``/``items`` (``[1, d]``, the unknown/stale fallback) and the version's staleness.

    The arrays stay memory-mapped but are viewed as plain ndarrays: indexing a ``np.memmap`` builds a memmap
    object per slice, which was a third of a request's lookup time.
    """
    store = EmbeddingStore(store.path, store.manifest, {k: np.asarray(v) for k, v in store.arrays.items()})

    def mean(side: str) -> torch.Tensor:
        vectors = store.side(side, "vectors")
        return (
            torch.from_numpy(np.asarray(vectors, np.float64).mean(0, keepdims=True).astype(np.float32))
            if len(vectors)
            else torch.zeros(1, vectors.shape[1])
        )

    created = datetime.fromisoformat(store.manifest["created_at"])
    age = (datetime.now(timezone.utc) - created).total_seconds()
    return StoreSnapshot(
        store, mean("user"), mean("item"), max_store_age_s is not None and age > max_store_age_s
    )


class FallbackCounters:
    """Thread-safe totals of requests, scored candidates, each fallback in :data:`FALLBACKS` and failed refreshes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(("requests", "candidates", *FALLBACKS, "refresh_failures"), 0)

    def add(self, counts: dict[str, int]) -> None:
        with self._lock:
            for k, v in counts.items():
                self._counts[k] += v

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


@dataclass
class ScoreResult:
    """``scores[task]``: ``[N]`` float32 probabilities; ``version``: the store version every input came from."""

    scores: dict[str, np.ndarray]
    version: int
    fallbacks: dict[str, int]
    stale_store: bool

    def to_json(self) -> dict:
        return {
            "version": self.version,
            "scores": {t: v.tolist() for t, v in self.scores.items()},
            "fallbacks": self.fallbacks,
            "stale_store": self.stale_store,
        }


def _is_int(value) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def _candidate_array(candidate_ids) -> np.ndarray:
    """``candidate_ids`` as a flat ``[N]`` integer array, or :class:`ScoringError` naming what is wrong with it."""
    try:
        ids = np.asarray(candidate_ids)
    except (ValueError, TypeError):
        raise ScoringError("candidate_ids must be a flat list of integers, got ragged nested lists") from None
    if ids.ndim != 1 or not len(ids):
        raise ScoringError(f"candidate_ids must be a non-empty list of integers, got shape {list(ids.shape)}")
    if ids.dtype.kind not in "iu":  # strings, floats, or Python ints past int64: name the first bad one
        sent = candidate_ids.tolist() if isinstance(candidate_ids, np.ndarray) else list(candidate_ids)
        for i, value in enumerate(sent):
            if not _is_int(value):
                raise ScoringError(f"candidate_ids must be integers, got candidate_ids[{i}] = {shown(value)}")
            if not 0 <= value <= INT64_MAX:
                raise ScoringError(f"candidate_ids[{i}] = {shown(value)} does not fit in int64")
    return ids


def _dense_array(dense, num_candidates: int, dense_dim: int) -> np.ndarray:
    """``context["dense"]`` as float32 ``[1 or N, D]``, or :class:`ScoringError` naming what is wrong with it."""
    expected = f"context.dense must be [{dense_dim}] or [{num_candidates}, {dense_dim}] numbers"
    try:
        array = np.asarray(dense)
    except (ValueError, TypeError):
        raise ScoringError(f"{expected}, got ragged nested lists") from None
    if array.dtype.kind not in "iuf" or array.shape not in ((dense_dim,), (num_candidates, dense_dim)):
        raise ScoringError(f"{expected}, got {array.dtype} {list(array.shape)}")
    if not np.isfinite(array).all():
        raise ScoringError("context.dense has NaN or infinite values")
    return array.astype(np.float32).reshape(-1, dense_dim)


def validate_request(
    user_id, candidate_ids, context, *, num_items: int, num_domains: int, dense_dim: int, max_candidates: int
) -> tuple[int, np.ndarray, dict]:
    """Check a request's types and ranges; returns ``(user_id, candidates[N] int64, context)`` or raises.

    Every message names the field and quotes at most a short prefix of the value sent.
    """
    if not _is_int(user_id) or not 0 <= user_id <= INT64_MAX:
        raise ScoringError(f"user_id must be a non-negative integer below 2**63, got {shown(user_id)}")
    ids = _candidate_array(candidate_ids)
    if len(ids) > max_candidates:
        raise ScoringError(
            f"too many candidates: {len(ids)} > the model's budget of {max_candidates} per request"
        )
    if (bad := np.flatnonzero((ids < 0) | (ids >= num_items))).size:
        raise ScoringError(
            f"candidate_ids[{bad[0]}] = {ids[bad[0]]} is outside the item vocabulary [0, {num_items})"
        )
    context = {} if context is None else context
    if not isinstance(context, dict):
        raise ScoringError(f"context must be an object, got {type(context).__name__}")
    if unknown := sorted(set(context) - set(CONTEXT_FIELDS)):
        raise ScoringError(f"unknown context fields {shown(unknown)}; allowed: {list(CONTEXT_FIELDS)}")
    domain = context.get("domain")
    if not _is_int(domain) or not 0 <= domain < num_domains:
        raise ScoringError(f"context.domain must be an integer in [0, {num_domains}), got {shown(domain)}")
    if "now" in context and not (_is_int(context["now"]) and abs(context["now"]) <= INT64_MAX):
        raise ScoringError(f"context.now must be an int64 timestamp, got {shown(context['now'])}")
    if "dense" in context:
        context = {**context, "dense": _dense_array(context["dense"], len(ids), dense_dim)}
    return int(user_id), ids.astype(np.int64), context


def _bag_inputs(
    store: EmbeddingStore, prefix: str, rows: np.ndarray, found: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor]:
    """Jagged column ``prefix`` of ``rows`` (empty bags where not ``found``): ``(values[M], starts[len(rows)])``."""
    offsets = store.arrays[f"{prefix}_offsets"]
    lengths = np.where(found, offsets[rows + 1] - offsets[rows], 0)
    _, values = gather_jagged(offsets, store.arrays[f"{prefix}_values"], rows[found], None)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
    return torch.from_numpy(np.asarray(values, np.int64)), torch.from_numpy(starts)


class Scorer:
    """Scores requests with a student and a store (module doc); thread-safe.

    ``student``: a :class:`StudentRanker`; ``store_root``: the store; ``version``: pin one version
    (else ``LATEST``, followed when ``cfg.follow_latest``).
    """

    def __init__(
        self,
        student: StudentRanker,
        store_root: str | Path,
        cfg: ServingConfig | None = None,
        *,
        version: int | None = None,
        model_name: str = "student",
    ) -> None:
        self.cfg = cfg or ServingConfig()
        self.student = student.eval()
        self.schema = student.schema
        self.model_name = model_name
        self.store_root = Path(store_root)
        self.pinned = version is not None
        self.counters = FallbackCounters()
        self.module = ServingStudent(self.student).eval()
        self._snapshot = self._open(version)
        self.runner = build_form(self.module, self.cfg.form, example_inputs(self))
        self._refresh_lock = threading.Lock()
        self._checked_at = time.monotonic()
        self.last_refresh_error: str | None = None
        self._refused_version: int | None = None

    def set_form(self, form: str) -> None:
        """Serve with ``form`` (:data:`FORMS`) from now on."""
        self.runner = build_form(self.module, form, example_inputs(self))
        self.cfg.form = form

    # -- store versions ---------------------------------------------------------------------------

    def _open(self, version: int | None) -> StoreSnapshot:
        store = open_store(self.store_root, version, verify=self.cfg.verify_store)
        check_compatible(self.student, store)
        return build_snapshot(store, self.cfg.max_store_age_s)

    @property
    def version(self) -> int:
        return self._snapshot.version

    @property
    def snapshot(self) -> StoreSnapshot:
        """The store version requests are served from now."""
        return self._snapshot

    def refresh(self) -> int:
        """Switch to the store's ``LATEST`` if it moved (one reference swap); returns the version served.

        A new version that fails verification (a corrupt or missing file) is not served: the current one
        stays, the failure is counted (``refresh_failures``) and kept in ``last_refresh_error``.
        """
        with self._refresh_lock:
            self._checked_at = time.monotonic()
            latest = latest_version(self.store_root)
            # A refused version is not re-verified at every check; a newer publish is tried again.
            if latest is not None and latest not in (self._snapshot.version, self._refused_version):
                try:
                    self._snapshot = self._open(latest)
                except StoreError as exc:
                    self._refused_version, self.last_refresh_error = latest, str(exc)
                    self.counters.add({"refresh_failures": 1})
        return self._snapshot.version

    def _maybe_refresh(self) -> None:
        if self.pinned or not self.cfg.follow_latest:
            return
        if (
            time.monotonic() - self._checked_at >= self.cfg.refresh_interval_s
            and not self._refresh_lock.locked()
        ):
            self.refresh()

    # -- scoring ----------------------------------------------------------------------------------

    def build_inputs(
        self, snap: StoreSnapshot, user_id: int, candidates: np.ndarray, context: dict
    ) -> tuple[tuple, dict]:
        """The :class:`ServingStudent` inputs for a validated request, and its fallback counts."""
        store, n = snap.store, len(candidates)
        counts = dict.fromkeys(FALLBACKS, 0)
        (user_row,), (user_found,) = store.rows("user", [user_id])
        rows, found = store.rows("item", candidates)
        counts["unknown_users"] = int(not user_found)
        counts["unknown_items"] = int(n - found.sum())
        user_rows, user_mask = np.array([user_row]), np.array([user_found])
        user_values = [
            _bag_inputs(store, f"user_feat_{f.name}", user_rows, user_mask)[0]
            for f in self.schema.sparse
            if f.side == "user"
        ]
        history, _ = _bag_inputs(store, "user_history", user_rows, user_mask)
        history = history[-self.student.cfg.history_len :] if self.student.cfg.history_len else history[:0]
        if "dense" in context:
            dense = torch.from_numpy(context["dense"])
        elif user_found and self.schema.dense_dim:
            dense = torch.from_numpy(np.array(store.arrays["user_dense"][user_row : user_row + 1]))
        else:
            dense = torch.zeros(1, self.schema.dense_dim)
        item_parts = [
            _bag_inputs(store, f"item_feat_{f.name}", rows, found)
            for f in self.schema.sparse
            if f.side == "item"
        ]
        stale_user = bool(
            user_found
            and self.cfg.max_user_age is not None
            and "now" in context
            and context["now"] - int(store.side("user", "timestamps")[user_row]) > self.cfg.max_user_age
        )
        counts["stale_users"] = int(stale_user)
        counts["stale_store"] = int(snap.stale)
        user_repr, item_repr = self._reprs(snap, user_row, user_found and not stale_user, rows, found)
        inputs = (
            user_values,
            history,
            dense,
            torch.tensor([context["domain"]]),
            [v for v, _ in item_parts],
            [o for _, o in item_parts],
            torch.from_numpy(candidates),
            user_repr,
            item_repr,
        )
        return inputs, counts

    def _reprs(
        self, snap: StoreSnapshot, user_row: int, use_user: bool, rows: np.ndarray, found: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(user_repr[1, d_u], item_repr[N, d_i])``, the mean vectors where not ``use_user``/``found``.

        Width 0 when the student takes no teacher representations.
        """
        if not self.student.cfg.teacher_repr:
            return torch.zeros(1, 0), torch.zeros(len(rows), 0)
        store = snap.store
        if use_user:
            user_repr = torch.from_numpy(np.array(store.side("user", "vectors")[user_row : user_row + 1]))
        else:
            user_repr = snap.mean_user_repr
        item_repr = torch.from_numpy(np.asarray(store.side("item", "vectors")[rows], np.float32))
        if not found.all():
            item_repr[torch.from_numpy(~found)] = snap.mean_item_repr
        return user_repr, item_repr

    def validate(self, user_id, candidate_ids, context: dict | None = None) -> tuple[int, np.ndarray, dict]:
        """:func:`validate_request` against this model's vocabulary, domains, dense width and budget."""
        return validate_request(
            user_id,
            candidate_ids,
            context,
            num_items=self.schema.num_items,
            num_domains=self.schema.num_domains,
            dense_dim=self.schema.dense_dim,
            max_candidates=self.cfg.budget.max_candidates,
        )

    def score(self, user_id, candidate_ids, context: dict | None = None) -> ScoreResult:
        """Scores per task (``[N]`` probabilities) for ``candidate_ids`` shown to ``user_id`` in ``context``."""
        self._maybe_refresh()
        snap = self._snapshot  # read once: the whole request uses this version
        user_id, candidates, context = self.validate(user_id, candidate_ids, context)
        inputs, counts = self.build_inputs(snap, user_id, candidates, context)
        logits = self.runner(*inputs)
        probs = torch.sigmoid(logits).detach().numpy()
        self.counters.add({"requests": 1, "candidates": len(candidates), **counts})
        return ScoreResult(
            {t: probs[:, i].copy() for i, t in enumerate(TASKS)}, snap.version, counts, snap.stale
        )


def check_compatible(student: StudentRanker, store: EmbeddingStore) -> None:
    """Refuse a store that cannot feed ``student``: missing features, short history, other teacher dims."""
    features = store.manifest.get("features")
    if features is None:
        raise StoreError(
            f"{store.path}: exported without serving features; re-export it with this version of gem"
        )
    if student.cfg.history_len > features["history_len"]:
        raise StoreError(
            f"{store.path}: keeps {features['history_len']} history items per user, the student needs "
            f"{student.cfg.history_len}"
        )
    for side in ("user", "item"):
        wanted = [f.name for f in student.schema.sparse if f.side == side]
        if features[side] != wanted:
            raise StoreError(
                f"{store.path}: {side} features {features[side]} differ from the student's {wanted}"
            )
    if student.cfg.teacher_repr:
        dims, want = (
            store.manifest["dims"],
            {"user": student.cfg.user_repr_dim, "item": student.cfg.item_repr_dim},
        )
        if dims != want:
            raise StoreError(
                f"{store.path}: teacher vectors have dims {dims}, the student was trained on {want}"
            )


def build_student(config: dict, schema: EventSchema, state: dict[str, torch.Tensor]) -> StudentRanker:
    """The :class:`StudentRanker` that ``config`` (a run's experiment config dict) describes, holding ``state``.

    A student that shares teacher tables gets its shared layout back from its config
    (:func:`transfer.sharing.restore_shared_layout`); the teacher itself is not needed.
    """
    student = StudentRanker(dataclass_from_dict(StudentConfig, config["model"]["student"]), schema)
    transfer = config.get("transfer", {})
    if transfer.get("share_from"):
        restore_shared_layout(student, transfer["shared_dims"], sharing_config(transfer))
    student.load_state_dict(state)
    return student.eval()


def load_student(ckpt_path: str | Path) -> StudentRanker:
    """The :class:`StudentRanker` of a ``gem train`` checkpoint (``model.arch=student``), in eval mode.

    Read without the training harness (``weights_only``), see :func:`build_student`.
    """
    ckpt = read_training_checkpoint(ckpt_path)
    if ckpt.arch != "student":
        raise BudgetError(f"{ckpt_path}: model.arch={ckpt.arch!r} is not a student value model")
    return build_student(ckpt.config, ckpt.schema, ckpt.state)


def save_student_files(ckpt_path: str | Path, directory: str | Path) -> dict[str, str]:
    """Write a student checkpoint as files that load without unpickling: ``student.safetensors`` (its tensors)
    and ``student.json`` (``{"config", "schema"}``). Returns ``{"weights_sha256", "config_sha256"}``."""
    ckpt = read_training_checkpoint(ckpt_path)
    if ckpt.arch != "student":
        raise BudgetError(f"{ckpt_path}: model.arch={ckpt.arch!r} is not a student value model")
    directory = Path(directory)
    with atomic_path(directory / STUDENT_WEIGHTS) as tmp:
        # Cloned: safetensors refuses tensors that share storage (a shared table is saved once per name).
        save_file({k: v.detach().cpu().contiguous().clone() for k, v in ckpt.state.items()}, str(tmp))
    config = {"config": ckpt.config, "schema": asdict(ckpt.schema)}
    atomic_write_text(directory / STUDENT_CONFIG, json.dumps(config, indent=2, sort_keys=True))
    return {"weights_sha256": sha256_file(directory / STUDENT_WEIGHTS), "config_sha256": sha256_file(directory / STUDENT_CONFIG)}


def load_student_files(directory: str | Path, *, weights_sha256: str, config_sha256: str) -> StudentRanker:
    """The student :func:`save_student_files` wrote, each file checked against its recorded sha256 first.

    Raises :class:`foundation.data.io.CorruptFileError` naming a file that is missing or does not match.
    """
    directory = Path(directory)
    for name, expected in ((STUDENT_WEIGHTS, weights_sha256), (STUDENT_CONFIG, config_sha256)):
        path = directory / name
        actual = sha256_file(path) if path.is_file() else "missing"
        if actual != expected:
            raise CorruptFileError(
                f"{path}: sha256 {actual[:12]}… does not match the recorded {expected[:12]}…; refusing to load the value model"
            )
    spec = json.loads((directory / STUDENT_CONFIG).read_text())
    return build_student(spec["config"], EventSchema(**spec["schema"]), load_file(str(directory / STUDENT_WEIGHTS)))


# -- forms, equivalence and latency ---------------------------------------------------------------


def example_inputs(scorer: Scorer, num_candidates: int | None = None, *, seed: int = 0) -> tuple:
    """Realistic inputs for ``num_candidates`` (default: the budget's) from the store's first user and random items."""
    n = num_candidates or scorer.cfg.budget.max_candidates
    snap = scorer.snapshot
    users = snap.store.side("user", "ids")
    user = int(users[0]) if len(users) else 0
    candidates = np.random.default_rng(seed).integers(0, scorer.schema.num_items, n)
    inputs, _ = scorer.build_inputs(snap, user, candidates, {"domain": 0})
    return inputs


def build_form(module: ServingStudent, form: str, example: tuple):
    """A callable with :class:`ServingStudent`'s signature running ``module`` in ``form`` (:data:`FORMS`).

    ``eager`` is plain autograd-recording eager mode; the others run under ``torch.inference_mode``;
    ``torchscript`` is scripted and frozen; ``compile`` is ``torch.compile(dynamic=True)`` (warmed on ``example``).
    """
    if form == "eager":
        return module
    if form == "inference_mode":
        compiled = module
    elif form == "torchscript":
        compiled = torch.jit.freeze(torch.jit.script(module.eval()))
    elif form == "compile":
        compiled = torch.compile(module, dynamic=True)
    else:
        raise ValueError(f"unknown serving form {form!r}; choose one of {FORMS}")

    def run(*inputs):
        with torch.inference_mode():
            return compiled(*inputs)

    if form == "compile":
        run(*example)
    return run


def check_equivalence(runner, reference, examples: list[tuple], *, atol: float = 1e-5) -> float:
    """Max abs logit difference between ``runner`` and ``reference`` over ``examples``; raises past ``atol``."""
    worst = 0.0
    for inputs in examples:
        with torch.no_grad():
            want = reference(*inputs)
        got = runner(*inputs)
        worst = max(worst, float((got.detach() - want).abs().max()))
    if worst > atol:
        raise BudgetError(f"serving form differs from eager by {worst:.3g} > {atol}")
    return worst


def measure_latency(
    scorer: Scorer, num_candidates: int, *, iters: int = 300, warmup: int = 50, seed: int = 0
) -> dict:
    """p50/p95/p99 ms of :meth:`Scorer.score` (lookups included) for ``num_candidates`` on the current thread setting.

    Requests cycle through the store's users with fresh random candidates each; ``warmup`` requests first.
    Wall-clock percentiles are what a caller sees; on a shared machine they include time the thread spent
    descheduled, so ``cpu_p50_ms``/``cpu_p95_ms``/``cpu_p99_ms`` give the thread's CPU time as well.
    """
    rng = np.random.default_rng(seed)
    users = np.asarray(scorer.snapshot.store.side("user", "ids"))
    requests = [
        (
            int(users[i % len(users)]) if len(users) else i,
            rng.integers(0, scorer.schema.num_items, num_candidates),
            {"domain": int(i % scorer.schema.num_domains)},
        )
        for i in range(warmup + iters)
    ]
    times, cpu_times = [], []
    for i, (user, candidates, context) in enumerate(requests):
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        scorer.score(user, candidates, context)
        if i >= warmup:
            times.append((time.perf_counter_ns() - t0) / 1e6)
            cpu_times.append((time.thread_time_ns() - c0) / 1e6)
    stats = {"candidates": num_candidates, "mean_ms": float(np.mean(times)), "iters": iters,
             "threads": torch.get_num_threads()}
    for prefix, values in (("", times), ("cpu_", cpu_times)):
        p50, p95, p99 = np.percentile(values, [50, 95, 99])
        stats.update({f"{prefix}p50_ms": float(p50), f"{prefix}p95_ms": float(p95), f"{prefix}p99_ms": float(p99)})
    return stats


def check_budget(scorer: Scorer, *, iters: int = 300, warmup: int = 50) -> dict:
    """Measure p99 at the budget's ``max_candidates`` on one thread; raise :class:`BudgetError` if over budget."""
    budget = scorer.cfg.budget
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        stats = measure_latency(scorer, budget.max_candidates, iters=iters, warmup=warmup)
    finally:
        torch.set_num_threads(threads)
    if stats["p99_ms"] > budget.p99_ms:
        raise BudgetError(
            f"model {scorer.model_name!r} is over its latency budget: p99 {stats['p99_ms']:.3f} ms for "
            f"{budget.max_candidates} candidates on one CPU thread, budget {budget.p99_ms} ms "
            f"(form {scorer.cfg.form!r}; CPU-time p99 {stats['cpu_p99_ms']:.3f} ms, load average "
            f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores); refusing to register it"
        )
    return {**stats, "budget": asdict(budget), "form": scorer.cfg.form}
