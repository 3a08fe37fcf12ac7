"""The host-work counter of ``bench_teacher --count-ops`` (:mod:`experiments.op_count`).

Here rather than beside the other experiment tests because it needs Triton's interpreter, which
``tests/kernels/conftest.py`` turns on before triton is imported.
"""

from __future__ import annotations

import pytest
import torch

from experiments.op_count import LaunchTimer, OpCounter, PhaseClock, count_steps, op_kind
from kernels import layer_norm

pytestmark = pytest.mark.usefixtures("one_thread")


def make_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, sync: bool = False):
    def step(phase, x):
        with phase("forward"):
            h = layer_norm(model[0](x), model[1].weight, model[1].bias, model[1].eps, backend="triton")
            loss = model[2](h).square().mean()
            if sync:
                float(loss)
        with phase("backward"):
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
        with phase("optimizer"):
            optimizer.step()

    return step


def tiny_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)


def test_operator_kinds():
    aten = torch.ops.aten
    assert op_kind(aten._to_copy.default) == "copy_cast"
    assert op_kind(aten.addmm.default) == "gemm"
    assert op_kind(aten.view.default) == op_kind(aten.t.default) == "view"
    assert op_kind(aten.empty.memory_format) == "alloc"
    assert op_kind(aten.zeros.default) == "fill"
    assert op_kind(aten.index_select.default) == "index"
    assert op_kind(aten._local_scalar_dense.default) == "sync"
    assert op_kind(aten._fused_adamw_.default) == "optimizer"
    assert op_kind(aten.mul.Tensor) == "elementwise"


def test_counts_by_phase_kind_and_site():
    model, optimizer = tiny_model()
    batches = [torch.randn(5, 8) for _ in range(5)]
    counts = count_steps(make_step(model, optimizer), batches, 2)
    assert counts["steps_counted"] == counts["steps_timed"] == 2
    forward, backward, opt = (counts["kinds"][p] for p in ("forward", "backward", "optimizer"))
    assert forward["gemm"] == 2 and backward["gemm"] >= 3  # two linears; their input and weight gradients
    assert opt["optimizer"] >= 1 and "gemm" not in opt
    assert counts["triton_launches"]["forward"] == {"_ln_fwd_kernel": 1.0}
    assert counts["triton_launches"]["backward"] == {"_ln_bwd_kernel": 1.0}
    # Views are dispatched but launch nothing.
    assert counts["launching_ops"]["forward"] == counts["ops"]["forward"] - forward.get("view", 0) - forward.get("alloc", 0)
    assert any(site.startswith("addmm at tests/kernels/test_op_count.py:") for site in counts["top_sites"]["forward"])
    assert counts["sync_sites"] == {}
    assert all(v >= 0 for v in counts["host_ms"].values())


def test_a_host_read_inside_the_step_is_reported_as_a_sync():
    model, optimizer = tiny_model()
    counts = count_steps(make_step(model, optimizer, sync=True), [torch.randn(5, 8) for _ in range(3)], 1)
    ((site, n),) = counts["sync_sites"].items()
    assert site.startswith("_local_scalar_dense at tests/kernels/test_op_count.py:") and n == 1


def test_counting_without_interpreting_the_kernels_dispatches_the_same_operators():
    """The default skips the interpreter's runs (module doc); the operators it counts are those of a real run."""
    counted = []
    for interpret in (True, False):
        model, optimizer = tiny_model()
        timer, counter = LaunchTimer(interpret=interpret), OpCounter()
        timer.counter = counter
        with timer.installed(), counter:
            make_step(model, optimizer)(PhaseClock(timer, counter).phase, torch.randn(5, 8))
        counted.append((counter.ops, timer.launches))
    assert counted[0] == counted[1]
    assert sum(counted[0][1].values()) == 2


def test_counting_needs_enough_batches():
    model, optimizer = tiny_model()
    with pytest.raises(ValueError, match="needs 5 batches"):
        count_steps(make_step(model, optimizer), [torch.randn(5, 8)] * 3, 2)


def test_the_launch_timer_restores_triton():
    from triton.runtime import interpreter, jit

    before = (jit.JITFunction.run, interpreter.InterpretedFunction.run)
    with LaunchTimer().installed():
        assert interpreter.InterpretedFunction.run is not before[1]
    assert (jit.JITFunction.run, interpreter.InterpretedFunction.run) == before
