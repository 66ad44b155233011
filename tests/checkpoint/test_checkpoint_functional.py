"""torch.func.functional_call through the wrapper: the recomputation uses the parameters and
buffers the forward used (NOTE [ Parameters in the recomputation ]), so gradients, outputs and
buffers are bitwise those of the unwrapped model called the same way."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.func import functional_call

from bnadapt.checkpoint import apply_checkpointing, checkpoint_wrapper
from tests.checkpoint.checkpoint_harness import assert_same
from tests.checkpoint.test_checkpoint import Block, fresh_net, images


def test_issue_reproduction() -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    ck = checkpoint_wrapper(copy.deepcopy(ref))
    x = torch.randn(4, 3)
    grads = []
    for m in (ref, ck):
        params = {k: (p.detach() * 2).requires_grad_() for k, p in ref.named_parameters()}
        functional_call(m, params, (x,)).pow(2).sum().backward()
        grads.append(params["0.weight"].grad)
    assert_same(grads[0], grads[1])


def doubled(model: nn.Module, with_buffers: bool) -> dict[str, torch.Tensor]:
    """Other values for every parameter (leaves that require grad) and, if asked, buffer."""
    values = {n: (p.detach() * 2).requires_grad_() for n, p in model.named_parameters()}
    if with_buffers:
        for name, buf in model.named_buffers():
            values[name] = buf.clone() + (1 if buf.is_floating_point() else 3)
    return values


def wrap_blocks(model: nn.Module) -> nn.Module:
    return apply_checkpointing(model, check_fn=lambda m: isinstance(m, Block))


@pytest.mark.parametrize("with_buffers", [False, True], ids=["params", "params_and_buffers"])
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("wrap", [wrap_blocks, checkpoint_wrapper], ids=["blocks", "whole"])
def test_functional_call_matches_unwrapped(
    with_buffers: bool, mode: str, wrap: Callable[[nn.Module], nn.Module]
) -> None:
    plain = fresh_net(dropout=0.3)
    wrapped = wrap(copy.deepcopy(plain))
    results = []
    for model in (plain, wrapped):
        model.train(mode == "train")
        values = doubled(plain, with_buffers)
        torch.manual_seed(5)
        outs = []
        for x in images(3, grad=True):
            out = functional_call(model, values, (x,))
            out.square().mean().backward()
            outs.append((out.detach(), x.grad))
        grads = {n: v.grad for n, v in values.items()}
        buffers = {n: v for n, v in values.items() if not v.requires_grad}
        results.append((outs, grads, buffers, dict(model.state_dict())))
    assert_same(results[0], results[1])
    # The functional values got the gradients and updates; the module's own did not.
    assert all(p.grad is None for p in wrapped.parameters())
    assert int(plain.state_dict()["blocks.0.bn1.num_batches_tracked"]) == (
        0 if with_buffers or mode == "eval" else 3
    )


def test_functional_call_between_forward_and_backward_calls() -> None:
    # Two forwards with different parameter values, one backward: each recomputation uses its
    # own forward's values.
    plain = fresh_net()
    wrapped = wrap_blocks(copy.deepcopy(plain))
    results = []
    for model in (plain, wrapped):
        first, second = doubled(plain, False), doubled(plain, False)
        with torch.no_grad():
            for value in second.values():
                value.mul_(-0.5)
        xs = images(2, grad=True)
        loss = functional_call(model, first, (xs[0],)).square().mean()
        loss = loss + functional_call(model, second, (xs[1],)).square().mean()
        loss.backward()
        results.append(([v.grad for v in first.values()], [v.grad for v in second.values()]))
    assert_same(results[0], results[1])
