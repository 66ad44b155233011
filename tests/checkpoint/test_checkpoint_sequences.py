"""Random sequences of calls, for NOTE [ Buffers and the recomputation ]'s "after any sequence of
calls": forwards kept for a later backward in train and in eval mode, blocks switched between
modes in between, no-grad passes, functional calls with other parameter values, backward of
the oldest or the newest pending loss, backward with retain_graph and again later, SGD steps;
the wrapped model stays bitwise equal to the unwrapped one (outputs, input and parameter
gradients, the functional values' gradients, the whole state_dict and every training flag).

One order is left out, as in test_eval_call_then_train_calls_then_backward: a BatchNorm that
ran in eval mode in a forward whose backward is pending is not run in train mode until then.
The unwrapped model's backward would read the statistics that train-mode run updated (torch
updates them inside the kernel, which no version counter sees), not the ones its forward used;
the wrapper recomputes with the latter, so the two differ by design there."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call

from tests.checkpoint.checkpoint_harness import check_equivalent, unwrapped_name
from tests.checkpoint.test_checkpoint import (
    EMA,
    Block,
    fresh_net,
    images,
    wrap_blocks,
    wrap_whole,
)

ACTIONS = (
    "train_forward",
    "eval_forward",
    "switch_block",
    "no_grad_pass",
    "functional_forward",
    "backward_oldest",
    "backward_newest",
    "backward_retained",
    "sgd_step",
)
SEQUENCE_LENGTH = 16
SEEDS = range(12)


def wrap_both(model: nn.Module) -> nn.Module:
    """Blocks wrapped, and the whole model around them."""
    return wrap_whole(wrap_blocks(model))


def with_ema(model: nn.Module) -> nn.Module:
    """An EMA of its own (buffers recorded and copied, not BatchNorm's scratch) before the
    head, inside the whole-model wrapper's region."""
    model.head = nn.Sequential(EMA(), model.head)
    return model


MODELS = [
    pytest.param(lambda model: model, id="batchnorm"),
    pytest.param(with_ema, id="batchnorm_ema"),
]


def sequence(seed: int) -> list[tuple[str, int]]:
    """``SEQUENCE_LENGTH`` actions, each with a number that picks its input, block or scale."""
    rng = random.Random(seed)
    return [(rng.choice(ACTIONS), rng.randrange(1000)) for _ in range(SEQUENCE_LENGTH)]


def replayer(
    steps: Sequence[tuple[str, int]], names: Sequence[str], done: list[str] | None = None
) -> Callable[[nn.Module, Sequence[torch.Tensor]], Any]:
    """A scenario that runs ``steps`` on a model; ``names``: its parameters' (unwrapped) names,
    for the functional calls; ``done``, if given, gets each action that ran (one whose
    condition held)."""

    def replay(model: nn.Module, xs: Sequence[torch.Tensor]) -> Any:
        blocks = [m for m in model.modules() if isinstance(m, Block)]
        norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
        parameters = {unwrapped_name(n): p for n, p in model.named_parameters()}
        # Per pending loss: the indices of the BatchNorms its forward ran in eval mode.
        pending: list[tuple[torch.Tensor, frozenset[int]]] = []
        outputs: list[torch.Tensor] = []
        functional_values: list[dict[str, torch.Tensor]] = []

        def may_run() -> bool:
            """False where a BatchNorm would update statistics a pending eval run saved."""
            held = frozenset().union(*(evals for _, evals in pending))
            return not any(norms[i].training for i in held)

        def forward(function: Callable[..., torch.Tensor], *args: Any) -> None:
            evals = frozenset(i for i, norm in enumerate(norms) if not norm.training)
            out = function(*args)
            outputs.append(out.detach())
            pending.append((out.square().mean(), evals))

        for action, number in steps:
            x = xs[number % len(xs)]
            produced = len(outputs)
            ran = True
            if action in ("train_forward", "eval_forward"):
                model.train(action == "train_forward")
                if may_run():
                    forward(model, x)
            elif action == "switch_block":
                block = blocks[number % len(blocks)]
                block.train(not block.training)
            elif action == "no_grad_pass" and may_run():
                with torch.no_grad():
                    outputs.append(model(x))
            elif action == "functional_forward" and may_run():
                scale = 1 + number / 1000
                values = {
                    name: (parameters[name].detach() * scale).requires_grad_() for name in names
                }
                functional_values.append(values)
                forward(functional_call, model, values, (x,))
            elif action == "backward_oldest" and pending:
                pending.pop(0)[0].backward()
            elif action == "backward_newest" and pending:
                pending.pop()[0].backward()
            elif action == "backward_retained" and pending:
                pending[number % len(pending)][0].backward(retain_graph=True)
            elif action == "sgd_step" and not pending:
                with torch.no_grad():
                    for param in model.parameters():
                        if param.grad is not None:
                            param.sub_(0.05 * param.grad)
                            param.grad = None
            else:
                ran = False
            if action in ("train_forward", "eval_forward", "no_grad_pass", "functional_forward"):
                ran = len(outputs) > produced
            if done is not None and ran:
                done.append(action)
        for loss, _ in pending:
            loss.backward()
        grads = [[value.grad for value in values.values()] for values in functional_values]
        return outputs, grads

    return replay


@pytest.mark.parametrize(
    "wrap",
    [
        pytest.param(wrap_blocks, id="blocks"),
        pytest.param(wrap_whole, id="whole"),
        pytest.param(wrap_both, id="both"),
    ],
)
@pytest.mark.parametrize("build", MODELS)
@pytest.mark.parametrize("seed", SEEDS)
def test_random_call_sequences_match_unwrapped(
    seed: int, build: Callable[[nn.Module], nn.Module], wrap: Callable[[nn.Module], nn.Module]
) -> None:
    steps = sequence(seed)
    model = build(fresh_net(depth=2, dropout=0.2))
    names = [name for name, _ in model.named_parameters()]
    check_equivalent(model, wrap, replayer(steps, names), images(4, grad=True), seed=seed)


def test_the_sequences_run_every_action() -> None:
    """Not vacuous: across the seeds, every action runs (its condition held) several times,
    and most sequences run a backward after switching a block's mode."""
    model = fresh_net(depth=2, dropout=0.2)
    names = [name for name, _ in model.named_parameters()]
    runs = []
    for seed in SEEDS:
        done: list[str] = []
        replayer(sequence(seed), names, done)(model, images(4, grad=True))
        runs.append(done)
    counts = {action: sum(done.count(action) for done in runs) for action in ACTIONS}
    assert min(counts.values()) >= 3, counts
    switched_then_backward = sum(
        any(
            action == "switch_block" and any(a.startswith("backward") for a in done[i:])
            for i, action in enumerate(done)
        )
        for done in runs
    )
    assert switched_then_backward >= len(runs) // 2
