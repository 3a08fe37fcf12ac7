"""Less host work per teacher step with the same numbers: parameters cast once per step
(:mod:`foundation.model.precision`)."""

from __future__ import annotations

import pytest
import torch

from foundation.model.precision import CastOnce
from foundation.model.teacher import build_teacher
from tests.teacher_batches import CTR_SCHEMA, make_batch, tiny_config
from tests.test_ml1m_reference import ALL_SWITCHES

pytestmark = pytest.mark.usefixtures("one_thread")
LENGTHS = [0, 1, 5, 9, 3, 2]


def train_steps(
    cast_once: bool, steps: int = 3, **changes
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], CastOnce]:
    """``steps`` AdamW steps of a tiny teacher under CPU bf16 autocast, with or without :class:`CastOnce`."""
    torch.manual_seed(0)
    model = build_teacher(tiny_config(generative=True, dropout=0.0, **changes), CTR_SCHEMA)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    cast = CastOnce(model)
    losses = []
    for i in range(steps):
        batch = make_batch(CTR_SCHEMA, LENGTHS, seed=i)
        torch.manual_seed(100 + i)  # the generative loss's negatives
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if cast_once:
                loss = cast.run(lambda forward, batch=batch: model.loss(batch, forward(batch)))["loss"]
            else:
                loss = model.loss(batch, model(batch))["loss"]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if cast_once:
            cast.collect_grads()
        optimizer.step()
        losses.append(loss.detach())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, cast


def test_parameters_cast_once_per_step_train_exactly_as_autocast():
    plain_losses, plain_state, _ = train_steps(cast_once=False)
    losses, state, cast = train_steps(cast_once=True)
    assert all(torch.equal(a, b) for a, b in zip(plain_losses, losses, strict=True))
    assert all(torch.equal(plain_state[k], state[k]) for k in plain_state), "parameters moved apart"
    names = set(cast.names)
    # GEMM operands qualify; what a kernel or a float32 op reads does not (the uvqk bias's gate columns: the gated
    # norm adds them to the gate in float32).
    assert {"blocks.0.uvqk.weight", "blocks.0.output.weight", "pffns.1.down.weight", "user_tower.weight"} <= names
    assert not names & {"blocks.0.input_norm.weight", "blocks.0.pos_bias", "blocks.0.time_bias", "cls_tokens",
                        "blocks.0.uvqk.bias", "experts.second_bias", "items.collection.embeddings.t_item.weight"}
    assert all(c.dtype == torch.bfloat16 for c in cast.copies)


def test_cast_once_trains_exactly_as_autocast_with_the_reference_block():
    """The reference block's norms have no parameters, its uvqk no bias, its bias tables one row per layer."""
    plain_losses, plain_state, _ = train_steps(cast_once=False, **ALL_SWITCHES)
    losses, state, cast = train_steps(cast_once=True, **ALL_SWITCHES)
    assert all(torch.equal(a, b) for a, b in zip(plain_losses, losses, strict=True))
    assert all(torch.equal(plain_state[k], state[k]) for k in plain_state), "parameters moved apart"
    assert "blocks.0.uvqk.weight" in cast.names and "blocks.0.pos_bias" not in cast.names


def test_nothing_is_cast_once_without_autocast():
    torch.manual_seed(0)
    model = build_teacher(tiny_config(dropout=0.0), CTR_SCHEMA)
    batch = make_batch(CTR_SCHEMA, LENGTHS)
    cast = CastOnce(model)
    loss = cast.discover(lambda: model.loss(batch, model(batch))["loss"])
    assert cast.names == [] and torch.isfinite(loss)
    cast.refresh()
    torch.testing.assert_close(cast.forward(batch).logits["click"], model(batch).logits["click"], rtol=0, atol=0)
