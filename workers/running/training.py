"""Supervised training on one labelled data set, deterministic given the seed.

The seed fixes the train/validation split and each epoch's shuffle (one ``torch.Generator``)
and the global RNG that Dropout and friends draw from, forked so the caller's RNG state is
left as it was. With a checkpoint wrapper applied, the resulting ``state_dict`` is bitwise
that of the unwrapped model, ``num_batches_tracked`` included (NOTE in workers/checkpoint.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from workers.errors import DataError, JobCanceled, TrainError
from workers.models.modules import training_flags
from workers.passes.data import Data, load_rows
from workers.passes.steps import Forward, StepClock
from workers.running.evaluation import (
    Loss,
    check_targets,
    compute_loss,
    evaluate_sums,
)

__all__ = [
    "EpochLog",
    "Optimizer",
    "RankSlice",
    "TrainStats",
    "batch_bounds",
    "split_indices",
    "train_model",
]

Optimizer = Literal["sgd", "adamw"]


@dataclass(frozen=True)
class EpochLog:
    epoch: int  # from 1
    train_loss: float  # mean over the epoch's samples, as measured during the epoch
    val_loss: float | None  # None without a validation split
    val_accuracy: float | None  # None without a validation split or for mse


@dataclass(frozen=True)
class TrainStats:
    epochs: list[EpochLog]
    steps: int  # optimizer steps, = forward passes in train mode
    samples: int  # training samples seen, all epochs together


def split_indices(
    num_samples: int, validation_fraction: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) indices of a random split; a positive fraction keeps at least one
    validation sample."""
    num_val = 0
    if validation_fraction > 0:
        num_val = max(1, int(num_samples * validation_fraction))
    perm = torch.randperm(num_samples, generator=generator)
    return perm[num_val:], perm[:num_val]


def batch_bounds(num_samples: int, batch_size: int) -> list[tuple[int, int]]:
    """[start, stop) of each batch of an epoch. A last batch of one sample is dropped when
    batches are larger: BatchNorm1d cannot train on one sample, and one sample would weigh as
    much as a whole batch in that step."""
    bounds = [(i, min(i + batch_size, num_samples)) for i in range(0, num_samples, batch_size)]
    if batch_size > 1 and len(bounds) > 1 and num_samples % batch_size == 1:
        bounds.pop()
    return bounds


@dataclass(frozen=True)
class RankSlice:
    """The part of each global batch this process trains on, one of ``world_size`` ranks of a
    data-parallel job (NOTE [ Ranks' batches ] in workers/running/ranks.py); the default is the
    whole batch."""

    rank: int = 0
    world_size: int = 1

    def take(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's indices of a global batch's (B,): every ``world_size``-th from the
        ``rank``-th, as DistributedSampler deals them, once a short last batch is cut to a
        multiple of ``world_size``."""
        usable = batch.numel() - batch.numel() % self.world_size
        return batch[:usable][self.rank :: self.world_size]  # (usable / world_size,)

    def keep(self, bounds: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """``bounds`` less a short last batch that leaves a rank fewer than 2 samples, which
        BatchNorm cannot train on (as :func:`batch_bounds` drops a one-sample batch)."""
        if self.world_size == 1:
            return bounds
        return [(a, b) for a, b in bounds if (b - a) // self.world_size >= 2]

    def average(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of ``value`` over the ranks (all ranks call it together)."""
        if self.world_size > 1:
            dist.all_reduce(value)
            value /= self.world_size
        return value


def _make_optimizer(
    model: nn.Module, name: Optimizer, lr: float, momentum: float, weight_decay: float
) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise TrainError("the model has no trainable parameters; there is nothing to train")
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adamw":  # momentum is AdamW's beta1 (both default to 0.9)
        return torch.optim.AdamW(params, lr=lr, betas=(momentum, 0.999), weight_decay=weight_decay)
    raise TrainError(f"unknown optimizer {name!r}; use 'sgd' or 'adamw'")


def train_model(
    model: nn.Module,
    x: Data,
    y: torch.Tensor,
    *,
    epochs: int,
    batch_size: int,
    optimizer: Optimizer,
    lr: float,
    momentum: float,
    weight_decay: float,
    loss: Loss,
    validation_fraction: float,
    seed: int,
    device: torch.device | str,
    progress: Callable[[int, int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    forward: Forward | None = None,
    clock: StepClock | None = None,
    ranks: RankSlice | None = None,
) -> TrainStats:
    """Train ``model`` in place on ``x`` (N, ...) and ``y`` (N,) class labels or (N, ...)
    targets; the model is moved to ``device``, the data goes there batch by batch.

    ``progress(steps_done, total_steps)`` after each step; ``should_stop()`` before each,
    raising :class:`JobCanceled` when it answers True. Every module's training flag is
    restored at the end.

    ``forward`` runs the train steps' forward passes (default ``model``; a compiled
    ``model``, workers/passes/steps.py); validation runs ``model`` itself. ``clock`` times
    each step, from reading its batch to the optimizer's update.

    ``ranks``: this process is one rank of a data-parallel job (workers/running/ranks.py):
    each step trains on its slice of the global batch, ``forward`` is the DDP model, and only
    rank 0 validates. The epochs' train loss is averaged over the ranks.
    """
    ranks = ranks or RankSlice()
    if epochs < 1 or batch_size < 1:
        raise ValueError(f"epochs and batch_size must be >= 1, got {epochs} and {batch_size}")
    if not 0 <= validation_fraction < 1:
        raise ValueError(f"validation_fraction must be in [0, 1), got {validation_fraction}")
    if loss not in ("cross_entropy", "mse"):
        raise TrainError(f"unknown loss {loss!r}; use 'cross_entropy' or 'mse'")
    if x.shape[0] != y.shape[0]:
        raise DataError(f"x has {x.shape[0]} samples but y has {y.shape[0]}; give one each")
    generator = torch.Generator().manual_seed(seed)
    train_idx, val_idx = split_indices(x.shape[0], validation_fraction, generator)
    if train_idx.numel() < 2:
        raise TrainError(
            f"{x.shape[0]} samples with validation_fraction={validation_fraction} leave "
            f"{train_idx.numel()} for training; BatchNorm needs at least 2: upload more data "
            "or lower validation_fraction"
        )
    bounds = ranks.keep(batch_bounds(train_idx.numel(), batch_size))
    if not bounds:
        raise TrainError(
            f"{train_idx.numel()} training samples over {ranks.world_size} processes leave "
            "no rank 2 samples a step; upload more data or use fewer processes"
        )
    total_steps = epochs * len(bounds)
    target = torch.device(device)
    model.to(target)
    opt = _make_optimizer(model, optimizer, lr, momentum, weight_decay)
    x_val, y_val = x[val_idx], y[val_idx]  # (V, ...): a view of x, read as it is evaluated

    logs: list[EpochLog] = []
    steps = samples = 0
    rng_devices = [target] if target.type == "cuda" else []
    with training_flags(model), torch.random.fork_rng(devices=rng_devices):
        torch.manual_seed(seed)
        for epoch in range(1, epochs + 1):
            model.train()
            order = train_idx[torch.randperm(train_idx.numel(), generator=generator)]
            loss_sum = torch.zeros((), dtype=torch.float64, device=target)
            epoch_samples = 0
            for start, stop in bounds:
                if should_stop is not None and should_stop():
                    raise JobCanceled(f"training canceled after {steps} of {total_steps} steps")
                if clock is not None:
                    clock.start()
                idx = ranks.take(order[start:stop])
                xb, yb = load_rows(x, idx).to(target), y[idx].to(target)  # (B, ...), (B, ...)
                outputs = (forward or model)(xb)  # (B, num_classes) or (B, ...)
                if steps == 0:
                    check_targets(outputs, y, loss)
                batch_loss = compute_loss(outputs, yb, loss, "mean")
                opt.zero_grad(set_to_none=True)
                torch.autograd.backward(batch_loss)
                opt.step()
                if clock is not None:
                    clock.stop(idx.numel())
                trained = idx.numel() * ranks.world_size  # the global batch's, all ranks
                loss_sum += batch_loss.detach().double() * trained
                epoch_samples += trained
                steps += 1
                if progress is not None:
                    progress(steps, total_steps)
            samples += epoch_samples
            train_loss = ranks.average(loss_sum).item() / epoch_samples  # one device sync per epoch
            if not math.isfinite(train_loss):
                raise TrainError(
                    f"the training loss became {train_loss} in epoch {epoch}; lower lr "
                    f"(now {lr}) or check the data for extreme values"
                )
            val = None
            if val_idx.numel() and ranks.rank == 0:
                val = evaluate_sums(
                    model, x_val, y_val, batch_size=batch_size, loss=loss, device=target
                ).metrics()
            logs.append(
                EpochLog(
                    epoch=epoch,
                    train_loss=train_loss,
                    val_loss=None if val is None else val.loss,
                    val_accuracy=None if val is None else val.accuracy,
                )
            )
    return TrainStats(epochs=logs, steps=steps, samples=samples)
