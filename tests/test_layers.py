"""What each entry point drags in at import time, checked in a fresh interpreter.

import-linter (``make test``) checks the layer contracts on the source; these tests check the modules a
process really loads: a serving process loads no training harness and no MLflow, and the GPU scripts,
run where MLflow is not installed, never load it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("lightning", "lightning_fabric", "pytorch_lightning", "mlflow")


def loaded_packages(*modules: str) -> set[str]:
    """Top-level packages in ``sys.modules`` after a fresh interpreter imports ``modules``."""
    code = (
        "import importlib, json, sys\n"
        f"for name in {list(modules)!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return set(json.loads(out.stdout.splitlines()[-1]))


def test_serving_imports_neither_lightning_nor_mlflow():
    loaded = loaded_packages("value_models.serving")
    assert {"torch", "value_models", "transfer"} <= loaded, "the probe must see what serving imports"
    assert not loaded & {*HEAVY, "gem", "faiss"}


def test_gpu_scripts_import_no_mlflow():
    scripts = ["gem.loop", "experiments.bench_teacher", "experiments.ml1m_hstu", "experiments.teacher_vs_baseline",
               "experiments.compute_scaling"]
    # matplotlib too: the GPU machine has none (compute_scaling imports it only to plot, on the CPU machine).
    assert not loaded_packages(*scripts) & {*HEAVY, "matplotlib"}
