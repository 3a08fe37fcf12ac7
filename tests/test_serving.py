"""Value-model scoring: serving equals the student's forward, fallbacks, bad requests, forms, budget, versions.

The world (a tiny teacher, its store, two students) is built once here and reused by ``test_serving_rest``.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch

from foundation.data.io import list_shards
from foundation.data.pipeline import DataConfig, build_batch, table_to_block
from foundation.data.schema import TASKS, EventSchema
from foundation.model.baseline import DLRMConfig
from gem.cli import main
from gem.config import ExperimentConfig, ModelConfig, TrainConfig
from gem.module import RecModule, load_module, load_trained
from gem.packaging import choose_form, register_value_model
from gem.train import train
from tests.events import write_dataset
from transfer.export import export_embeddings
from transfer.store import StoreError, open_store
from value_models.serving import (
    FALLBACKS,
    BudgetError,
    LatencyBudget,
    Scorer,
    ScoringError,
    ServingConfig,
    check_budget,
    load_student,
)
from value_models.student import StudentConfig

SPLITS = ("train", "valid")
REPR_DIM = 6


def build_world(root: Path, *, train_student: bool = True) -> dict:
    """``{"data", "store", "uri", "teacher", "student", "repr_student"}``: checkpoints trained for 2 steps.

    ``train_student=False`` skips the plain student (``"student"`` is then None) for tests that need only
    the teacher's store and the representation student.
    """
    data = write_dataset(root / "data", rows={"train": 320, "valid": 80}, row_group_size=16)
    uri = f"sqlite:///{root}/mlflow.db"

    def config(name: str, model: ModelConfig) -> ExperimentConfig:
        return ExperimentConfig(
            name=name,
            data=DataConfig(path=str(data), max_len=8, batch_size=32),
            model=model,
            train=TrainConfig(
                max_steps=2,
                accelerator="cpu",
                out_dir=str(root / "runs"),
                tracking_uri=uri,
                progress_bar=False,
            ),
        )

    teacher = train(
        config(
            "teacher",
            ModelConfig(
                dlrm=DLRMConfig(embedding_dim=8, bottom_mlp=(8,), top_mlp=(16, 8), repr_dim=REPR_DIM)
            ),
        )
    )["checkpoint"]
    student_model = ModelConfig(arch="student", student=StudentConfig(hidden=(16,), history_len=4))
    student = train(config("student", student_model))["checkpoint"] if train_student else None
    export_embeddings(load_trained(teacher), data, root / "store", splits=SPLITS, device="cpu")
    # A student reading the teacher's vectors. Its initial weights suffice: the tests compare serving with its
    # own forward, and training one needs teacher outputs, which test_transfer_pipeline covers.
    repr_cfg = config(
        "repr",
        ModelConfig(
            arch="student",
            student=StudentConfig(
                hidden=(16,), history_len=4, teacher_repr=True, user_repr_dim=REPR_DIM, item_repr_dim=REPR_DIM
            ),
        ),
    )
    module = RecModule(repr_cfg.to_dict(), json.loads(EventSchema.load(data).to_json()))
    repr_ckpt = root / "repr_student.ckpt"
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, repr_ckpt)
    return {
        "data": data,
        "store": root / "store",
        "uri": uri,
        "teacher": Path(teacher),
        "student": Path(student) if student else None,
        "repr_student": repr_ckpt,
    }


def latest_rows(data: Path, key: str) -> pa.Table:
    """Each ``key``'s latest row (max timestamp, then example id), independent of the exporter's code."""
    table = pa.concat_tables(pq.read_table(p) for s in SPLITS for p in list_shards(data, s))
    frame = table.select([key, "timestamp", "example_id"]).to_pandas().reset_index()
    picked = frame.sort_values(["timestamp", "example_id"]).groupby(key).tail(1)
    return table.take(pa.array(picked["index"].to_numpy()))


def reference_scores(
    student, data: Path, store, user: int, candidates: np.ndarray, domain: int
) -> dict[str, np.ndarray]:
    """The student's training-time ``forward`` on hand-built rows: the user's latest row with each candidate's
    item features, id and the request's domain; teacher vectors from the store. ``{task: [N] probabilities}``."""
    schema = student.schema
    users, items = latest_rows(data, "user_id"), latest_rows(data, "item_id")
    user_row = users.filter(pc.equal(users["user_id"], user))
    item_pos = {int(v): i for i, v in enumerate(items["item_id"].to_pylist())}
    rows = user_row.take(pa.array(np.zeros(len(candidates), np.int64)))
    item_rows = items.take(pa.array([item_pos[int(c)] for c in candidates]))
    for name in ["item_id", *(f.name for f in schema.sparse if f.side == "item")]:
        i = rows.schema.get_field_index(name)
        rows = rows.set_column(i, rows.schema.field(i), item_rows[name])
    i = rows.schema.get_field_index("domain")
    rows = rows.set_column(i, rows.schema.field(i), pa.array(np.full(len(candidates), domain), pa.int32()))
    block = table_to_block(rows, EventSchema.load(data))
    batch = build_batch([(block, np.arange(len(candidates)))], schema, student.cfg.history_len, None)
    teacher = None
    if student.cfg.teacher_repr:
        teacher = {
            "user_repr": torch.from_numpy(store.lookup_users(np.full(len(candidates), user))[0]),
            "item_repr": torch.from_numpy(store.lookup_items(candidates)[0]),
        }
    with torch.no_grad():
        logits = student(batch, teacher).logits
    return {t: torch.sigmoid(logits[t]).numpy() for t in TASKS}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return build_world(tmp_path_factory.mktemp("serving"))


@pytest.mark.parametrize("which", ["student", "repr_student"])
def test_scores_equal_the_students_forward_on_the_same_rows(world, which):
    student = load_student(world[which])
    scorer = Scorer(student, world["store"])
    store = open_store(world["store"])
    users = store.arrays["user_ids"][:3]
    rng = np.random.default_rng(0)
    for domain, user in enumerate(users):
        candidates = rng.choice(store.arrays["item_ids"], 7)
        result = scorer.score(int(user), candidates.tolist(), {"domain": domain})
        want = reference_scores(student, world["data"], store, int(user), candidates, domain)
        assert result.version == 1 and result.fallbacks == dict.fromkeys(FALLBACKS, 0)
        for task in TASKS:
            np.testing.assert_allclose(result.scores[task], want[task], rtol=1e-5, atol=1e-6)
    assert scorer.counters.snapshot()["requests"] == 3


def test_fallbacks_are_defined_and_counted(world, tmp_path):
    student = load_student(world["repr_student"])
    store = open_store(world["store"])
    user, items = int(store.arrays["user_ids"][0]), store.arrays["item_ids"][:5].tolist()
    scorer = Scorer(student, world["store"])
    known = scorer.score(user, items, {"domain": 0})

    unknown = scorer.score(10_000, items, {"domain": 0})
    assert unknown.fallbacks["unknown_users"] == 1 and not np.allclose(
        unknown.scores["click"], known.scores["click"]
    )
    # An unknown user is the empty user with the mean teacher vector: the same as a user with no stored row.
    empty = scorer.module(*scorer.build_inputs(scorer.snapshot, 10_001, np.array(items), {"domain": 0})[0])
    np.testing.assert_allclose(
        unknown.scores["click"], torch.sigmoid(empty[:, 0]).detach().numpy(), rtol=1e-5
    )

    # A store exported from the valid split only lacks some items that are still in the vocabulary.
    small = tmp_path / "small"
    export_embeddings(
        load_trained(world["teacher"]), world["data"], small, splits=("valid",), device="cpu", build_retrieval_index=False
    )
    absent = np.setdiff1d(np.arange(student.schema.num_items), open_store(small).arrays["item_ids"])[:3]
    assert len(absent), "the valid split should miss some items"
    small_scorer = Scorer(student, small)
    present = int(open_store(small).arrays["user_ids"][0])
    result = small_scorer.score(
        present, [*absent.tolist(), int(open_store(small).arrays["item_ids"][0])], {"domain": 1}
    )
    assert result.fallbacks["unknown_items"] == len(absent) and np.isfinite(result.scores["click"]).all()

    ts = int(store.arrays["user_timestamps"][0])
    stale = Scorer(student, world["store"], ServingConfig(max_user_age=10, max_store_age_s=0.0))
    fresh = stale.score(user, items, {"domain": 0, "now": ts + 10})
    old = stale.score(user, items, {"domain": 0, "now": ts + 11})
    assert fresh.fallbacks["stale_users"] == 0 and old.fallbacks["stale_users"] == 1
    np.testing.assert_allclose(fresh.scores["click"], known.scores["click"], rtol=1e-6)
    assert not np.allclose(old.scores["click"], known.scores["click"])
    assert old.stale_store and stale.counters.snapshot() == {
        "requests": 2,
        "candidates": 10,
        "unknown_users": 0,
        "unknown_items": 0,
        "stale_users": 1,
        "stale_store": 2,
        "refresh_failures": 0,
    }


@pytest.mark.parametrize(
    ("user", "candidates", "context", "match"),
    [
        ("7", [1, 2], {"domain": 0}, "user_id must be a non-negative integer"),
        (3, ["a", "b"], {"domain": 0}, "candidate_ids must be integers"),
        (3, [], {"domain": 0}, "non-empty list"),
        (3, [1, 40], {"domain": 0}, r"candidate_ids\[1\] = 40 is outside the item vocabulary"),
        (3, list(range(9)), {"domain": 0}, "too many candidates: 9 > the model's budget of 8"),
        (3, [1], {"domain": 0, "colour": 1}, r"unknown context fields \['colour'\]"),
        (3, [1], {}, "context.domain must be an integer"),
        (3, [1], {"domain": 0, "dense": [1.0]}, r"context.dense must be \[2\] or \[1, 2\]"),
        (3, [1], {"domain": 0, "dense": [1.0, float("nan")]}, "NaN"),
    ],
)
def test_bad_requests_are_refused_with_the_field_named(world, user, candidates, context, match):
    scorer = Scorer(
        load_student(world["student"]), world["store"], ServingConfig(budget=LatencyBudget(max_candidates=8))
    )
    with pytest.raises(ScoringError, match=match):
        scorer.score(user, candidates, context)
    assert scorer.counters.snapshot()["requests"] == 0


def test_compiled_forms_match_eager_and_an_over_budget_model_is_refused(world):
    scorer = Scorer(
        load_student(world["repr_student"]), world["store"], ServingConfig(budget=LatencyBudget(64, 1e-4))
    )
    choice = choose_form(scorer, ("inference_mode", "torchscript"), iters=20)
    assert choice["form"] in ("inference_mode", "torchscript") and scorer.cfg.form == choice["form"]
    assert all(row["max_abs_diff"] <= 1e-5 and row["p99_ms"] > 0 for row in choice["forms"].values())
    with pytest.raises(
        BudgetError,
        match=r"over its latency budget: p99 .* ms for 64 candidates on one CPU thread.*load average [0-9.]+ on \d+ cores",
    ):
        check_budget(scorer, iters=20, warmup=5)
    with pytest.raises(BudgetError, match="over its latency budget"):
        register_value_model(
            world["repr_student"], world["store"], "too-slow", cfg=scorer.cfg, tracking_uri=world["uri"]
        )
    with pytest.raises(StoreError, match="teacher vectors have dims"):
        student = load_student(world["repr_student"])
        student.cfg.user_repr_dim = 5
        Scorer(student, world["store"])


def test_every_response_comes_from_one_whole_version_while_a_new_one_publishes(world, tmp_path):
    store = tmp_path / "store"
    shutil.copytree(world["store"], store)
    student = load_student(world["repr_student"])
    scorer = Scorer(student, store, ServingConfig(refresh_interval_s=0.0))
    users = open_store(store).arrays["user_ids"][:8].tolist()
    items = open_store(store).arrays["item_ids"][:16].tolist()
    responses, errors, stop = [], [], threading.Event()
    deadline = time.monotonic() + 60  # bounds the load even if the publish hangs

    def client(seed: int) -> None:
        rng = np.random.default_rng(seed)
        while not stop.is_set() and time.monotonic() < deadline:
            user = int(rng.choice(users))
            try:
                responses.append((user, scorer.score(user, items, {"domain": 0})))
            except Exception as exc:  # every error fails the test; recorded for the assertion
                errors.append(exc)

    threads = [threading.Thread(target=client, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    # The new version is a different teacher's: every user's vectors change, so a mix would show.
    time.sleep(0.2)
    other = tmp_path / "teacher2.ckpt"
    module = load_module(world["teacher"])
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.05)
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, other)
    export_embeddings(load_trained(other), world["data"], store, splits=SPLITS, device="cpu", build_retrieval_index=False)
    time.sleep(0.3)
    stop.set()
    for t in threads:
        t.join(timeout=30)
    assert not errors and {v for _, r in responses for v in [r.version]} == {1, 2}
    pinned = {v: Scorer(student, store, version=v) for v in (1, 2)}
    for user, result in responses[:: max(1, len(responses) // 200)] + responses[-20:]:
        want = pinned[result.version].score(user, items, {"domain": 0})
        np.testing.assert_array_equal(result.scores["click"], want.scores["click"])
    assert (
        pinned[1].score(users[0], items, {"domain": 0}).scores["click"].tolist()
        != pinned[2].score(users[0], items, {"domain": 0}).scores["click"].tolist()
    )


def test_gem_retrieve_and_bench_serving(world, tmp_path, capsys):
    store = open_store(world["store"])
    user = int(store.arrays["user_ids"][4])
    assert (
        main(
            [
                "retrieve",
                str(user),
                "--store",
                str(world["store"]),
                "--k",
                "3",
                "--json",
                str(tmp_path / "r.json"),
            ]
        )
        == 0
    )
    got = json.loads((tmp_path / "r.json").read_text())
    items = np.asarray(store.arrays["items"]) / np.linalg.norm(store.arrays["items"], axis=1, keepdims=True)
    query = store.lookup_users([user])[0][0]
    want = store.arrays["item_ids"][np.argsort(-(items @ (query / np.linalg.norm(query))))[:3]]
    assert got["version"] == 1 and got["items"] == want.tolist()
    assert main(["retrieve", "10000", "--store", str(world["store"])]) == 2
    assert "user 10000 is not in" in capsys.readouterr().err

    out = tmp_path / "bench.json"
    args = [
        "bench-serving",
        "--ckpt",
        str(world["student"]),
        "--store",
        str(world["store"]),
        "--candidates",
        "8,256",
        "--forms",
        "eager,inference_mode,torchscript",
        "--iters",
        "10",
        "--warmup",
        "2",
        "--json",
        str(out),
    ]
    assert main(args) == 0
    table = json.loads(out.read_text())
    assert {(r["form"], r["candidates"]) for r in table["rows"]} == {
        (f, n) for f in ("eager", "inference_mode", "torchscript") for n in (8, 256)
    }
    assert all(e["passed"] for e in table["equivalence"].values()) and table["serve"] in table["equivalence"]
    assert all(0 < r["p50_ms"] <= r["p99_ms"] for r in table["rows"])
    assert main([*args[:-6], "--forms", "jit"]) == 2
    assert "unknown serving forms ['jit']" in capsys.readouterr().err
    package = [
        "package",
        "--ckpt",
        str(world["student"]),
        "--store",
        str(world["store"]),
        "--name",
        "n",
        "--max-candidates",
        "8",
        "--p99-ms",
        "0.00001",
    ]
    assert main(package) == 2
    assert "is over its latency budget: p99" in capsys.readouterr().err


def test_a_corrupt_version_is_refused_at_open_and_never_served(world, tmp_path):
    store = tmp_path / "store"
    shutil.copytree(world["store"], store)
    student = load_student(world["student"])
    scorer = Scorer(student, store, ServingConfig(refresh_interval_s=0.0))
    export_embeddings(
        load_trained(world["teacher"]), world["data"], store, splits=SPLITS, device="cpu", build_retrieval_index=False
    )
    # Serving features are store files like the vectors: a flipped byte in one names that file.
    target = store / "v000002" / "item_feat_item_category_values.npy"
    data = bytearray(target.read_bytes())
    data[-1] ^= 0xFF
    target.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=r"item_feat_item_category_values\.npy: checksum mismatch"):
        Scorer(student, store)
    user = int(open_store(store, 1).arrays["user_ids"][0])
    assert [scorer.score(user, [1, 2], {"domain": 0}).version for _ in range(3)] == [1, 1, 1]
    assert scorer.counters.snapshot()["refresh_failures"] == 1
    assert "item_feat_item_category_values.npy" in scorer.last_refresh_error
