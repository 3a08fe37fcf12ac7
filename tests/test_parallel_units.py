"""Block discovery for FSDP units, activation checkpointing and TP pairs, in one process (no process group)."""

from __future__ import annotations

import torch

from foundation.model.teacher import build_teacher
from foundation.parallel.activation import apply_activation_checkpointing
from foundation.parallel.compile import apply_compile
from foundation.parallel.fsdp import find_unit_paths
from foundation.parallel.tensor import find_linear_pairs
from tests.teacher_batches import CTR_SCHEMA, make_batch, tiny_config


def build():
    torch.manual_seed(0)
    return build_teacher(tiny_config(dropout=0.0), CTR_SCHEMA)


def test_teacher_blocks_are_the_elements_of_its_module_lists():
    paths = find_unit_paths(build())
    assert {p.split(".")[0] for p in paths} == {"blocks", "summaries", "pffns", "user_interactions"}
    assert "blocks.0" in paths and "blocks.1" in paths


def test_named_units_override_the_default():
    assert find_unit_paths(build(), ("blocks", "experts")) == ["blocks.0", "blocks.1", "experts"]


def test_activation_checkpointing_keeps_names_values_and_gradients():
    torch.set_num_threads(1)
    batch = make_batch(CTR_SCHEMA, [0, 3, 5, 1])
    plain, checkpointed = build(), build()
    wrapped = apply_activation_checkpointing(checkpointed, ("blocks",))
    assert wrapped == ["blocks.0", "blocks.1"]
    assert checkpointed.state_dict().keys() == plain.state_dict().keys()
    for model in (plain, checkpointed):
        model.loss(batch, model(batch))["loss"].backward()
    # named_parameters keeps the wrapper's prefix (state_dict does not); strip it to pair them up.
    twins = {n.replace("._checkpoint_wrapped_module", ""): p for n, p in checkpointed.named_parameters()}
    for name, p in plain.named_parameters():
        torch.testing.assert_close(twins[name].grad, p.grad, atol=1e-6, rtol=0)


def test_tensor_parallel_pairs_linears_separated_by_elementwise_modules_only():
    mlp = torch.nn.Sequential(
        torch.nn.Linear(4, 8),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.0),
        torch.nn.Linear(8, 4),
        torch.nn.LayerNorm(4),  # not elementwise over a sharded width: breaks a pair
        torch.nn.Linear(4, 8),
        torch.nn.LayerNorm(8),
        torch.nn.Linear(8, 2),
        torch.nn.Linear(2, 2),
    )
    assert find_linear_pairs(torch.nn.ModuleDict({"mlp": mlp})) == [("mlp.0", "mlp.3"), ("mlp.7", "mlp.8")]


def test_compiled_blocks_keep_names_values_and_gradients():
    torch.set_num_threads(1)
    batch = make_batch(CTR_SCHEMA, [0, 3, 5, 1])
    plain, compiled = build(), build()
    assert apply_compile(compiled, ("blocks",)) == ["blocks.0", "blocks.1"]
    assert compiled.state_dict().keys() == plain.state_dict().keys()
    torch._dynamo.utils.counters.clear()
    losses = []
    for model in (plain, compiled):
        loss = model.loss(batch, model(batch))["loss"]
        loss.backward()
        losses.append(loss.detach())
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0, "the blocks ran eagerly"
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    twins = dict(compiled.named_parameters())
    for name, p in plain.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(twins[name].grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
