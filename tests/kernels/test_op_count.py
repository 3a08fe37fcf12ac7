"""The host-work counter of ``bench_teacher --count-ops`` (:mod:`experiments.op_count`).

Here rather than beside the other experiment tests because it needs Triton's interpreter, which
``tests/kernels/conftest.py`` turns on before triton is imported.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from experiments.op_count import LaunchTimer, OpCounter, PhaseClock, count_steps, op_kind
from kernels import layer_norm

pytestmark = pytest.mark.usefixtures("one_thread")
REPO = Path(__file__).resolve().parents[2]


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


def test_backward_operators_are_named_by_their_node_and_forward_line():
    """The engine's operators for a built-in backward (a linear's input, weight and bias gradients) name the
    node and the line of the forward that made it; a custom function's backward keeps its own line; the
    anomaly mode that records the forward lines is off again after counting."""
    model, optimizer = tiny_model()
    counts = count_steps(make_step(model, optimizer), [torch.randn(5, 8) for _ in range(5)], 1)
    sites = counts["top_sites"]["backward"]
    first, second = (s.split(" at ")[1] for s in counts["top_sites"]["forward"] if s.startswith("addmm at "))
    assert sites[f"mm at AddmmBackward0 of {first}"] == 1  # weight gradient only: x needs none
    assert sites[f"mm at AddmmBackward0 of {second}"] == 2
    assert sites[f"sum at AddmmBackward0 of {first}"] == sites[f"sum at AddmmBackward0 of {second}"] == 1
    source = (REPO / "kernels" / "triton" / "group_sums.py").read_text().splitlines()
    line = next(i for i, text in enumerate(source, 1) if "zeroed = torch.zeros(" in text)
    assert sites[f"zeros at kernels/triton/group_sums.py:{line}"] == 1, sites
    assert not any(s.endswith(" at ?") or " of ?" in s for s in sites), sites
    assert not torch.is_anomaly_enabled()


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


def test_modelled_bytes_count_each_tensor_once_and_broadcasts_by_their_storage():
    from experiments.op_count import tensor_bytes, traffic_bytes

    x, row = torch.randn(5, 8), torch.randn(1, 8)
    assert tensor_bytes(row.expand(5, 8)) == 8 * 4  # a broadcast view spans one row
    assert tensor_bytes(x[:, :3]) == 5 * 3 * 4
    assert traffic_bytes("elementwise", ((x, x), {}), x + x) == 2 * 40 * 4  # x once, the output once
    assert traffic_bytes("elementwise", ((x, row.expand(5, 8)), {}), x + row) == (40 + 8 + 40) * 4
    table, ids = torch.randn(1000, 8), torch.tensor([3, 5])
    assert traffic_bytes("index", ((table, 0, ids), {}), table.index_select(0, ids)) == 2 * 2 * 8 * 4


def test_counts_report_bytes_per_site_and_kernel():
    model, optimizer = tiny_model()
    counts = count_steps(make_step(model, optimizer), [torch.randn(5, 8) for _ in range(3)], 1)
    forward = counts["bytes_by_site"]["forward"]
    # The first linear: addmm reads bias [16], x [5, 8] and weight [16, 8], writes [5, 16] (float32).
    (addmm,) = [n for site, n in forward.items() if site.startswith("gemm addmm at") and n == (16 + 40 + 128 + 80) * 4]
    assert addmm
    # The LayerNorm launch: x and its output [5, 16], weight, bias, mean and rstd [5] (placeholders counted once).
    assert counts["triton_bytes"]["forward"]["_ln_fwd_kernel"] == (80 + 16 + 16 + 80 + 5 + 5) * 4
    assert counts["bytes_total"] >= sum(forward.values())


def test_counts_report_matrix_product_flops_by_shape_and_site():
    from experiments.op_count import gemm_flops

    a, b, batch = torch.randn(5, 8), torch.randn(8, 3), torch.randn(4, 5, 8)
    assert gemm_flops("mm", (a, b), a @ b) == 2 * 5 * 8 * 3
    assert gemm_flops("addmm", (torch.randn(3), a, b), a @ b) == 2 * 5 * 8 * 3
    assert gemm_flops("bmm", (batch, torch.randn(4, 8, 3)), batch @ torch.randn(4, 8, 3)) == 2 * 4 * 5 * 8 * 3
    assert gemm_flops("addbmm", (torch.randn(5, 3), batch, torch.randn(4, 8, 3)), torch.randn(5, 3)) == 2 * 4 * 5 * 8 * 3
    model, optimizer = tiny_model()
    counts = count_steps(make_step(model, optimizer), [torch.randn(5, 8) for _ in range(3)], 1)
    forward = counts["gemm_flops_by_site"]["forward"]
    # The two linears: x [5, 8] by the first weight (transposed [8, 16]), then [5, 16] by the second's [16, 1].
    assert sorted(forward.values()) == [2 * 5 * 16 * 1, 2 * 5 * 8 * 16]
    assert any(site.startswith("addmm [5, 8] @ [8, 16] at tests/kernels/test_op_count.py:") for site in forward)
    # The backward's input and weight gradients: twice the forward's products, less the first input's gradient.
    assert counts["gemm_flops_total"] == pytest.approx(sum(forward.values()) + 2 * 5 * 16 * 1 * 2 + 2 * 5 * 8 * 16)
