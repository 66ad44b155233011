"""The ``entropy`` estimator: test-time entropy minimisation (TENT, Wang et al. 2021).

Only the affine parameters (weight and bias) of the selected normalization layers are
optimised, to lower the mean entropy of the model's softmax predictions on the target data.
The selected BatchNorm layers run in train mode, so they normalise with batch statistics and
their running statistics follow the target data with their own momentum, as in ``ema``. With
``affine_norms="all"`` (the default, as SAR, Niu et al. 2023) the affine parameters of the
selected LayerNorm and GroupNorm layers are trained too (TENT trains BatchNorm's only:
``affine_norms="batchnorm"``); those layers keep no statistics, so a ViT or a ConvNeXt adapts
by them alone. Dropout and the other modules stay in eval mode, and every other parameter and
buffer keeps its value bit for bit.

Unlike the other estimators this one needs gradients: it runs under ``enable_grad`` whatever
the caller's mode, and a model wrapped by bnadapt/checkpoint.py gives bitwise the same
parameters, statistics and outputs as without wrapping (NOTE [ Buffers and the recomputation ]
there): each step updates the running statistics once, not once more in the recomputation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Final, Literal

import torch
from torch import nn

from workers.errors import AdaptError, JobCanceled
from workers.estimators.base import (
    NO_BATCHES,
    AdaptStats,
    EstimatorTask,
    resolve_affine_norms,
    resolve_batchnorm,
)
from workers.models.modules import model_device, training_flags

if TYPE_CHECKING:
    from workers.passes.steps import Forward, StepClock

__all__ = ["SGD_MOMENTUM", "Optimizer", "entropy_adapt", "entropy_loss", "run"]

Optimizer = Literal["sgd", "adam"]
SGD_MOMENTUM: Final = 0.9  # TENT's setting for SGD


def entropy_loss(logits: torch.Tensor) -> torch.Tensor:
    """Mean over samples of the entropy (nats) of ``softmax(logits)``; logits (B, K)."""
    # As TENT's reference code writes it, so results match it bitwise.
    return -(logits.softmax(dim=1) * logits.log_softmax(dim=1)).sum(dim=1).mean()


def entropy_adapt(
    model: nn.Module,
    batches: Sequence[torch.Tensor],
    *,
    layers: Sequence[str],
    lr: float,
    steps: int | None = None,
    optimizer: Optimizer = "adam",
    reset: bool = False,
    progress: Callable[[int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    forward: Forward | None = None,
    clock: StepClock | None = None,
    affine_layers: Sequence[str] = (),
) -> AdaptStats:
    """``steps`` optimiser steps (``None``: one per batch), each on the next of ``batches``
    ``(B, ...)``, cycling; batches are moved to the model's device. ``optimizer`` is Adam, or
    SGD with momentum :data:`SGD_MOMENTUM`. ``reset`` clears the selected layers' running
    statistics first. The returned ``batches`` is the number of steps: each is one train-mode
    forward, so each selected layer's ``num_batches_tracked`` grows by exactly that.

    ``requires_grad`` and ``.grad`` of every parameter and all training flags are as before
    when it returns or raises. ``forward`` runs the steps' forward passes (default ``model``;
    a compiled ``model``, workers/passes/steps.py); ``clock`` times each step.
    ``affine_layers`` (LayerNorm, GroupNorm) have their affine parameters trained too; with
    them, ``layers`` may be empty.
    """
    if not lr > 0:
        raise AdaptError(f"the learning rate must be > 0, got {lr}")
    if steps is not None and steps < 1:
        raise AdaptError(f"steps must be >= 1 or None (one pass over the data), got {steps}")
    selected = resolve_batchnorm(model, layers) if layers or not affine_layers else []
    norms = resolve_affine_norms(model, affine_layers)
    if not batches:
        raise AdaptError(NO_BATCHES)
    params = _affine_parameters([*selected, *norms], [*layers, *affine_layers])
    total = len(batches) if steps is None else steps
    flags = [(p, p.requires_grad, p.grad) for p in model.parameters()]
    with training_flags(model), torch.enable_grad():
        try:
            for p, _, _ in flags:
                p.requires_grad_(False)
                p.grad = None
            for p in params:
                p.requires_grad_(True)
            opt = _optimizer(optimizer, params, lr)
            model.eval()
            for bn in selected:
                bn.train()
                if reset:
                    bn.reset_running_stats()
            samples = _entropy_steps(
                model, batches, total, opt, progress, should_stop, forward, clock
            )
        finally:
            for p, requires_grad, grad in flags:
                p.requires_grad_(requires_grad)
                p.grad = grad
    return AdaptStats(batches=total, samples=samples)


def _affine_parameters(layers: list[nn.Module], names: list[str]) -> list[nn.Parameter]:
    """The weights and biases of ``layers`` (named ``names``) that are parameters."""
    params = [
        p for layer in layers for p in (layer.weight, layer.bias) if isinstance(p, nn.Parameter)
    ]
    if not params:
        raise AdaptError(
            f"none of the layers {names} has affine parameters "
            "(affine=False) for the entropy estimator to optimise; select layers with "
            "affine=True or use 'precise'"
        )
    return params


def _optimizer(name: Optimizer, params: list[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """Adam, or SGD with momentum :data:`SGD_MOMENTUM`, over ``params``."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=SGD_MOMENTUM)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    raise AdaptError(f"unknown optimizer {name!r}; use 'sgd' or 'adam'")


def _entropy_steps(
    model: nn.Module,
    batches: Sequence[torch.Tensor],
    total: int,
    opt: torch.optim.Optimizer,
    progress: Callable[[int], None] | None,
    should_stop: Callable[[], bool] | None,
    forward: Forward | None,
    clock: StepClock | None,
) -> int:
    """``total`` steps of ``opt`` on the mean entropy, each on the next of ``batches``
    (cycling); the samples they saw."""
    device = model_device(model)
    samples = 0
    for step in range(total):
        if should_stop is not None and should_stop():
            raise JobCanceled(f"entropy adaptation canceled after {step} steps")
        if clock is not None:
            clock.start()
        batch = batches[step % len(batches)].to(device)  # (B, ...)
        logits = (forward or model)(batch)  # (B, K)
        loss = entropy_loss(_checked_logits(logits))
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        if clock is not None:
            clock.stop(batch.shape[0])
        samples += batch.shape[0]
        if progress is not None:
            progress(step + 1)
    return samples


def _checked_logits(logits: object) -> torch.Tensor:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[1] < 2:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits)
        raise AdaptError(
            f"the entropy estimator needs class logits of shape (B, num_classes >= 2), the "
            f"model gives {shape}; use 'precise' or 'ema' for other models"
        )
    if not logits.requires_grad:
        raise AdaptError(
            "the model's output does not depend on the selected layers' affine parameters; "
            "select layers the forward uses"
        )
    return logits


def run(task: EstimatorTask) -> AdaptStats:
    """The ``entropy`` row of the estimator table: ``steps`` steps (default one pass)."""
    params = task.params
    steps = params.steps or task.total
    task.start(steps, "steps")
    # Read when a step needs it: each step moves its batch to the model's device.
    return entropy_adapt(
        task.model,
        task.sequence(),
        layers=task.layers,
        lr=params.lr,
        steps=steps,
        optimizer=params.optimizer,
        reset=task.reset,
        progress=task.hooks.report,
        should_stop=task.hooks.should_stop,
        forward=task.forward,
        clock=task.clock,
        affine_layers=task.affine_layers,
    )
