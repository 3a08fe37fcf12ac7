"""``experiments/bench_glue.py --launches``: every launch shape it times computes the committed shape's gradients,
and the kernel modules' constants are back as committed afterwards (Triton interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from experiments import bench_glue


@pytest.fixture
def interpreted(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_every_launch_shape_gives_the_committed_gradients_and_the_constants_come_back(interpreted):
    before = {kernel: {name: getattr(module, name) for name in shapes[0]}
              for kernel, (module, shapes) in bench_glue.LAUNCH_SHAPES.items()}
    assert before == {kernel: shapes[0] for kernel, (_, shapes) in bench_glue.LAUNCH_SHAPES.items()}, (
        "the first launch shape of each kernel is the committed one"
    )
    rows = bench_glue.measure_launches(37, 48, torch.device("cpu"), rows_count=3, repeats=1)
    timed = [r for r in rows if r["kernel"] != "copy_"]
    assert len(timed) == sum(len(shapes) * (2 if kernel == "layer_norm" else 1)
                             for kernel, (_, shapes) in bench_glue.LAUNCH_SHAPES.items())
    for row in timed:
        assert row["rel_error_vs_committed"] < 1e-5, row
    after = {kernel: {name: getattr(module, name) for name in shapes[0]}
             for kernel, (module, shapes) in bench_glue.LAUNCH_SHAPES.items()}
    assert after == before
