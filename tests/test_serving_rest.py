"""The packaged value model over REST: ``mlflow models serve -m models:/NAME@ALIAS`` for real, on loopback."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pytest
import yaml

from foundation.data.io import sha256_file
from gem.packaging import SERVING_FILE, register_value_model
from tests.test_serving import build_world
from transfer.store import open_store
from value_models.serving import (
    STUDENT_CONFIG,
    STUDENT_WEIGHTS,
    LatencyBudget,
    Scorer,
    ServingConfig,
    load_student,
)

NAME, ALIAS = "gem-student", "champion"
MAX_CANDIDATES = 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, payload, timeout: float = 30.0) -> tuple[int, dict]:
    """POST ``payload`` as JSON to ``/invocations``: ``(status, parsed body)``."""
    return post_body(port, json.dumps(payload).encode(), timeout)


def post_body(port: int, body: bytes, timeout: float = 30.0) -> tuple[int, dict]:
    """POST the raw bytes ``body`` as ``application/json`` to ``/invocations``: ``(status, parsed body)``."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/invocations",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def wait_until_up(port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mlflow models serve exited with {proc.returncode}: {proc.stdout.read()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=1):
                return
        except OSError:
            time.sleep(0.25)
    raise TimeoutError(f"mlflow models serve did not answer /ping within {timeout} s")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A registered model served by ``mlflow models serve`` on a free port: ``(port, world, registration)``."""
    root = tmp_path_factory.mktemp("rest")
    world = build_world(root, train_student=False)
    mlflow.set_tracking_uri(world["uri"])
    mlflow.create_experiment("serving", artifact_location=(root / "artifacts").as_uri())
    cfg = ServingConfig(budget=LatencyBudget(max_candidates=MAX_CANDIDATES, p99_ms=1_000.0))
    reg = register_value_model(
        world["repr_student"],
        world["store"],
        NAME,
        alias=ALIAS,
        cfg=cfg,
        tracking_uri=world["uri"],
        experiment="serving",
    )
    port = free_port()
    # ``models serve`` execs ``uvicorn`` by name: the venv's bin must be on PATH, as in an activated venv.
    # Pickle deserialisation is switched off: the packaged model must load without it.
    env = {
        **os.environ,
        "MLFLOW_ALLOW_PICKLE_DESERIALIZATION": "false",
        "MLFLOW_TRACKING_URI": world["uri"],
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "models",
            "serve",
            "-m",
            f"models:/{NAME}@{ALIAS}",
            "--env-manager",
            "local",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_until_up(port, proc, timeout=90)
        yield port, world, reg
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_registered_with_alias_store_bundled_and_lineage(served):
    _, world, reg = served
    client = mlflow.MlflowClient(world["uri"])
    version = client.get_model_version_by_alias(NAME, ALIAS)
    assert int(version.version) == reg["version"] and reg["bundled"] and reg["store_version"] == 1
    tags = client.get_run(reg["run_id"]).data.tags
    assert tags["gem.export_version"] == "1"
    assert (
        tags["gem.checkpoint_sha256"] == open_store(world["store"]).manifest["teacher"]["checkpoint_sha256"]
    )


def test_rest_scores_equal_in_process_scores(served):
    port, world, _ = served
    store = open_store(world["store"])
    user, items = int(store.arrays["user_ids"][2]), store.arrays["item_ids"][:5].tolist()
    status, body = post(
        port,
        {
            "dataframe_records": [
                {"user_id": user, "candidate_ids": items, "domain": 1},
                {"user_id": 10_000, "candidate_ids": items[:2], "domain": 0},
            ]
        },
    )
    assert status == 200, body
    first, second = body["predictions"]
    want = Scorer(load_student(world["repr_student"]), world["store"]).score(user, items, {"domain": 1})
    assert first["version"] == 1 and set(first["scores"]) == {"click", "conversion"}
    np.testing.assert_allclose(first["scores"]["click"], want.scores["click"], rtol=1e-5)
    assert second["fallbacks"]["unknown_users"] == 1 and len(second["scores"]["click"]) == 2
    status, body = post(port, {"inputs": {"user_id": user, "candidate_ids": items, "domain": 1}})
    assert status == 200 and np.allclose(
        body["predictions"][0]["scores"]["click"], want.scores["click"], rtol=1e-5
    )


@pytest.mark.parametrize(
    ("record", "match"),
    [
        ({"user_id": "x", "candidate_ids": [1], "domain": 0}, "user_id must be a non-negative integer"),
        ({"user_id": 1, "candidate_ids": ["a"], "domain": 0}, "candidate_ids must be integers"),
        ({"user_id": 1, "candidate_ids": [1], "domain": 0, "colour": "red"}, r"unknown fields \['colour'\]"),
        (
            {"user_id": 1, "candidate_ids": list(range(MAX_CANDIDATES + 1)), "domain": 0},
            "too many candidates: 33 > ",
        ),
        ({"user_id": 1, "candidate_ids": [1]}, r"missing fields \['domain'\]"),
    ],
)
def test_bad_requests_get_a_400_naming_the_field(served, record, match):
    port, _, _ = served
    status, body = post(port, {"dataframe_records": [record]})
    assert status == 400, body
    assert body["error_code"] == "INVALID_PARAMETER_VALUE" and re.search(match, body["message"]), body
    assert post(port, {"dataframe_records": [{"user_id": 1, "candidate_ids": [1], "domain": 0}]})[0] == 200


def test_concurrent_clients_on_loopback_get_no_errors(served, record_property):
    port, world, _ = served
    store = open_store(world["store"])
    users, items = store.arrays["user_ids"].tolist(), store.arrays["item_ids"].tolist()
    rng = np.random.default_rng(0)
    payloads = [
        {
            "dataframe_records": [
                {
                    "user_id": int(rng.choice(users)),
                    "domain": int(rng.integers(0, 3)),
                    "candidate_ids": rng.choice(items, MAX_CANDIDATES).tolist(),
                }
            ]
        }
        for _ in range(60)
    ]

    def timed(payload) -> tuple[int, float]:
        t0 = time.perf_counter()
        status, _ = post(port, payload)
        return status, (time.perf_counter() - t0) * 1e3

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(timed, payloads))
    assert time.monotonic() - t0 < 60
    statuses, latencies = zip(*results, strict=True)
    assert set(statuses) == {200}
    p50, p99 = np.percentile(latencies, [50, 99])
    record_property(
        "rest_latency_ms",
        {
            "clients": 4,
            "requests": len(payloads),
            "candidates": MAX_CANDIDATES,
            "p50": round(float(p50), 2),
            "p99": round(float(p99), 2),
        },
    )
    assert 0 < p50 <= p99


def test_bundled_store_holds_one_version_and_a_large_store_is_a_pointer(served):
    _, world, _ = served
    bundled = Path(mlflow.artifacts.download_artifacts(f"models:/{NAME}@{ALIAS}")) / "artifacts"
    assert sorted(p.name for p in (bundled / "store").iterdir()) == ["LATEST", "v000001"]
    reg = register_value_model(
        world["repr_student"],
        world["store"],
        "gem-pointer",
        alias="staging",
        cfg=ServingConfig(budget=LatencyBudget(8, 1_000.0)),
        tracking_uri=world["uri"],
        experiment="serving",
        bundle_store_max_bytes=0,
    )
    assert not reg["bundled"]
    model = mlflow.pyfunc.load_model("models:/gem-pointer@staging")
    spec = json.loads(
        Path(
            mlflow.artifacts.download_artifacts("models:/gem-pointer@staging"), "artifacts", "serving.json"
        ).read_text()
    )
    assert spec["store"] == {
        **spec["store"],
        "path": str(world["store"].resolve()),
        "version": 1,
        "bundled": False,
    }
    user = int(open_store(world["store"]).arrays["user_ids"][0])
    (answer,) = model.predict(pd.DataFrame([{"user_id": user, "candidate_ids": [1, 2, 3], "domain": 2}]))
    want = Scorer(load_student(world["repr_student"]), world["store"]).score(user, [1, 2, 3], {"domain": 2})
    assert answer["version"] == 1 and np.allclose(answer["scores"]["click"], want.scores["click"], rtol=1e-5)


GOOD = {"user_id": 1, "candidate_ids": [1, 2], "domain": 0}
DEEP = 100_000
BAD_BODIES = {
    "100,000-deep JSON in a field": (
        b'{"dataframe_records": [{"user_id": 1, "domain": 0, "candidate_ids": ' + b"[" * DEEP + b"1" + b"]" * DEEP + b"}]}",
        r"nests deeper than 32 levels \(under dataframe_records\[0\]\.candidate_ids\[0\]",
    ),
    "100,000-deep JSON at the top": (b"[" * DEEP + b"]" * DEEP, "nests deeper than 32 levels"),
    "user_id 10**30 in a record": (
        json.dumps({"dataframe_records": [{**GOOD, "user_id": 10**30}]}).encode(),
        r"request 0: user_id must be a non-negative integer below 2\*\*63, got 10{30}",
    ),
    "user_id 10**30 in inputs": (
        json.dumps({"inputs": {**GOOD, "user_id": 10**30}}).encode(),
        r"request 0: user_id must be a non-negative integer below 2\*\*63",
    ),
    "ragged candidate_ids in a record": (
        json.dumps({"dataframe_records": [GOOD, {**GOOD, "candidate_ids": [[1, 2], [3]]}]}).encode(),
        "request 1: candidate_ids must be a flat list of integers, got ragged nested lists",
    ),
    "ragged candidate_ids in inputs": (
        json.dumps({"inputs": {**GOOD, "candidate_ids": [[1, 2], [3]]}}).encode(),
        "request 0: candidate_ids must be a flat list of integers, got ragged nested lists",
    ),
    "ragged dense in a record": (
        json.dumps({"dataframe_records": [{**GOOD, "dense": [[0.5], [0.1, 0.2]]}]}).encode(),
        r"request 0: context.dense must be \[\d+\] or \[2, \d+\] numbers, got ragged nested lists",
    ),
    "ragged dense in inputs": (
        json.dumps({"inputs": {**GOOD, "dense": [[0.5], [0.1, 0.2]]}}).encode(),
        r"request 0: context.dense must be .* got ragged nested lists",
    ),
    "candidate id past int64": (
        json.dumps({"dataframe_records": [{**GOOD, "candidate_ids": [1, 10**30]}]}).encode(),
        r"request 0: candidate_ids\[1\] = 10{30} does not fit in int64",
    ),
    "10 MB of invalid JSON": (b'{"dataframe_records": [' + b"x" * 10_000_000, "request body is not valid JSON"),
}


@pytest.mark.parametrize("case", list(BAD_BODIES))
def test_hostile_bodies_get_a_400_naming_the_field_and_the_server_keeps_serving(served, case):
    port, _, _ = served
    body, match = BAD_BODIES[case]
    status, answer = post_body(port, body, timeout=120)
    assert status == 400, answer
    message = answer["message"]
    assert answer["error_code"] == "INVALID_PARAMETER_VALUE" and re.search(match, message), message
    assert len(message) <= 500 and "\n" not in message
    assert post(port, {"dataframe_records": [GOOD]})[0] == 200


def test_the_packaged_model_is_code_safetensors_and_json_with_no_pickle(served, tmp_path):
    _, world, _ = served
    model_dir = Path(mlflow.artifacts.download_artifacts(f"models:/{NAME}@{ALIAS}", dst_path=str(tmp_path / "m")))
    pyfunc = yaml.safe_load((model_dir / "MLmodel").read_text())["flavors"]["python_function"]
    assert pyfunc["model_code_path"].endswith("value_model_code.py") and "python_model" not in pyfunc
    assert not list(model_dir.rglob("*.pkl")) and not list(model_dir.rglob("*.ckpt"))
    student = model_dir / "artifacts" / "student"
    assert sorted(p.name for p in student.iterdir()) == sorted([STUDENT_WEIGHTS, STUDENT_CONFIG])
    spec = json.loads((model_dir / "artifacts" / SERVING_FILE).read_text())
    assert spec["student"]["weights_sha256"] == sha256_file(student / STUDENT_WEIGHTS)

    model = mlflow.pyfunc.load_model(str(model_dir))
    user = int(open_store(world["store"]).arrays["user_ids"][0])
    (answer,) = model.predict(pd.DataFrame([{"user_id": user, "candidate_ids": [1, 2, 3], "domain": 2}]))
    want = Scorer(load_student(world["repr_student"]), world["store"]).score(user, [1, 2, 3], {"domain": 2})
    np.testing.assert_allclose(answer["scores"]["click"], want.scores["click"], rtol=1e-5)

    weights = bytearray((student / STUDENT_WEIGHTS).read_bytes())
    weights[-5] ^= 0x10  # one flipped bit in a tensor
    (student / STUDENT_WEIGHTS).write_bytes(bytes(weights))
    with pytest.raises(Exception, match=f"{student / STUDENT_WEIGHTS}: sha256 .* does not match the recorded"):
        mlflow.pyfunc.load_model(str(model_dir))
