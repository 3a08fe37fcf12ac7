"""The quickstart's recipe tells the mission's story at every seed (issue 18, item 1).

On the `debug` recipe's world, for training seeds 0, 1 and 2 (DLRM, teacher and student all seeded): the
GEM teacher beats the DLRM baseline, which beats the student alone, in test click NE, and the distilled
student (the recipe's ``distilled`` method) beats the student alone. The models are the quickstart's, trained
as it trains them; of the students only the two compared are trained (one student seed per training seed).
"""

from __future__ import annotations

import dataclasses

import pytest

from gem.flavors import mission_recipe
from gem.quickstart import train_models

pytestmark = pytest.mark.slow
SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    work = tmp_path_factory.mktemp("recipe")
    patch = pytest.MonkeyPatch()
    patch.chdir(work)
    patch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{work}/mlflow.db")
    recipe = mission_recipe("debug")
    recipe = dataclasses.replace(recipe, methods=(recipe.distilled,))
    try:
        yield recipe, {seed: train_models(recipe, work / f"seed{seed}", seed=seed, seeds=1) for seed in SEEDS}
    finally:
        patch.undo()


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
