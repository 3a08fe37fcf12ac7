"""The quickstart's recipe tells the mission's story at every seed (issue 18, item 1).

On the `debug` recipe's world, for training seeds 0, 1 and 2 (DLRM, teacher and student all seeded): the
GEM teacher beats the DLRM baseline, which beats the student alone, in test click NE, and the distilled
student (the recipe's ``distilled`` method) beats the student alone. The models are the quickstart's, trained
as it trains them; of the students only the two compared are trained (one student seed per training seed).
The seeds train side by side in their own processes, one thread each: the debug models are too small to keep two
threads busy, and the module is among the suite's longest (docs/benchmarks.md, "Test suite time").
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import torch

from gem.flavors import mission_recipe
from gem.pipeline import ensure_world
from gem.quickstart import train_models

pytestmark = pytest.mark.slow
SEEDS = (0, 1, 2)


def distilled_recipe():
    """The debug recipe with the distilled method as its only transfer method."""
    recipe = mission_recipe("debug")
    return dataclasses.replace(recipe, methods=(recipe.distilled,))


def train_seed(work: Path, seed: int) -> dict:
    """One training seed's stages 1-4 in ``work`` (a spawned process: its own thread count and MLflow store)."""
    torch.set_num_threads(1)
    os.chdir(work)
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{work}/mlflow-seed{seed}.db"
    return train_models(distilled_recipe(), work / f"seed{seed}", seed=seed, seeds=1)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    work = tmp_path_factory.mktemp("recipe")
    recipe = distilled_recipe()
    ensure_world(recipe.preset, str(work / recipe.dataset), recipe.synth_overrides)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(len(SEEDS), mp_context=context) as pool:
        states = pool.map(train_seed, [work] * len(SEEDS), SEEDS)
        return recipe, dict(zip(SEEDS, states, strict=True))


@pytest.mark.parametrize("seed", SEEDS)
def test_teacher_beats_baseline_beats_student_alone(results, seed):
    _, state = results
    teacher = state[seed]["teacher"]["metrics"]["click_ne"]
    baseline = state[seed]["baseline"]["metrics"]["click_ne"]
    alone = state[seed]["students"]["methods"]["alone"]["ne"]["click"]["mean"]
    assert teacher < baseline < alone, f"seed {seed}: teacher {teacher:.4f}, DLRM {baseline:.4f}, alone {alone:.4f}"


@pytest.mark.parametrize("seed", SEEDS)
def test_distilled_student_beats_student_alone(results, seed):
    recipe, state = results
    methods = state[seed]["students"]["methods"]
    alone, distilled = methods["alone"]["ne"]["click"]["mean"], methods[recipe.distilled]["ne"]["click"]["mean"]
    assert distilled < alone, f"seed {seed}: {recipe.distilled} {distilled:.4f}, alone {alone:.4f}"
