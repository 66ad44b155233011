"""Metrics of a model on labelled data, and the loss functions training shares with it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Literal

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812 - torch's own convention

from api_schemas.reports import Metrics as ReportMetrics
from workers.errors import DataError, JobCanceled
from workers.models.modules import model_device, training_flags
from workers.passes.data import Data, iter_batches

__all__ = [
    "Loss",
    "MetricSums",
    "Metrics",
    "check_targets",
    "compute_loss",
    "contract_metrics",
    "evaluate_sums",
    "loss_for",
]

Loss = Literal["cross_entropy", "mse"]


@dataclass(frozen=True)
class Metrics:
    """The contract's ``Metrics``: ``accuracy`` for classification, ``mse`` for regression."""

    num_samples: int
    loss: float
    accuracy: float | None
    mse: float | None


@dataclass(frozen=True)
class MetricSums:
    """What :class:`Metrics` are computed from. Sums over disjoint parts of a dataset add up
    to those over the whole (the parts of a sharded job: workers/sharding/compute.py)."""

    loss: Loss
    num_samples: int
    values_per_sample: int  # target elements per sample: mse averages over all of them
    loss_sum: float  # accumulated in float64
    correct: int  # cross_entropy: samples whose largest output is the label

    def __add__(self, other: MetricSums) -> MetricSums:
        if (self.loss, self.values_per_sample) != (other.loss, other.values_per_sample):
            raise ValueError(
                f"cannot add metric sums of {self.loss} over {self.values_per_sample} values "
                f"per sample to those of {other.loss} over {other.values_per_sample}"
            )
        return MetricSums(
            self.loss,
            self.num_samples + other.num_samples,
            self.values_per_sample,
            self.loss_sum + other.loss_sum,
            self.correct + other.correct,
        )

    def metrics(self) -> Metrics:
        if self.loss == "cross_entropy":
            mean = self.loss_sum / self.num_samples
            return Metrics(self.num_samples, mean, self.correct / self.num_samples, None)
        mean = self.loss_sum / (self.num_samples * self.values_per_sample)
        return Metrics(self.num_samples, mean, None, mean)


def contract_metrics(found: Metrics | None) -> ReportMetrics | None:
    """The contract's form of evaluation metrics."""
    return None if found is None else ReportMetrics(**asdict(found))


def loss_for(y: torch.Tensor) -> Loss:
    """The loss the labels call for: class labels (int64) -> cross-entropy, floats -> MSE."""
    return "mse" if y.is_floating_point() else "cross_entropy"


def check_targets(outputs: torch.Tensor, y: torch.Tensor, loss: Loss) -> None:
    """Raise :class:`DataError` unless all of ``y`` (N, ...) fits model ``outputs`` (B, ...).

    Checked once, on the first batch's outputs: on a GPU an out-of-range class label would
    otherwise end in a device-side assert that poisons the CUDA context.
    """
    if loss == "cross_entropy":
        if y.dtype != torch.int64 or y.dim() != 1:
            raise DataError(
                f"cross_entropy needs int64 class labels of shape (N,), got {y.dtype} of shape "
                f"{tuple(y.shape)}; upload integer labels, or use loss 'mse' for float targets"
            )
        if outputs.dim() != 2:
            raise DataError(
                f"cross_entropy needs model outputs of shape (B, num_classes), the model gives "
                f"{tuple(outputs.shape)}; use loss 'mse' or a classification architecture"
            )
        num_classes = outputs.shape[1]
        low, high = int(y.min()), int(y.max())
        if low < 0 or high >= num_classes:
            raise DataError(
                f"class labels span [{low}, {high}] but the model has {num_classes} classes "
                f"(labels must be in [0, {num_classes - 1}]); build the model with "
                f"num_classes={high + 1} or fix the labels"
            )
    elif loss == "mse":
        if not y.is_floating_point():
            raise DataError(
                f"mse needs float targets, got {y.dtype} labels; use loss 'cross_entropy' for "
                "class labels"
            )
        if y[0].numel() != outputs[0].numel():
            raise DataError(
                f"targets have shape {tuple(y.shape[1:])} per sample but the model outputs "
                f"{tuple(outputs.shape[1:])}; make them match"
            )
    else:
        raise DataError(f"unknown loss {loss!r}; use 'cross_entropy' or 'mse'")


def compute_loss(
    outputs: torch.Tensor, targets: torch.Tensor, loss: Loss, reduction: Literal["mean", "sum"]
) -> torch.Tensor:
    """Cross-entropy over samples, or squared error over elements (targets reshaped to the
    outputs' shape, so (B,) targets meet (B, 1) outputs without broadcasting to (B, B))."""
    if loss == "cross_entropy":
        return F.cross_entropy(outputs, targets, reduction=reduction)
    return F.mse_loss(outputs, targets.reshape(outputs.shape), reduction=reduction)


def evaluate_sums(
    model: nn.Module,
    x: Data,
    y: torch.Tensor,
    *,
    batch_size: int,
    loss: Loss,
    device: torch.device | str | None = None,
    progress: Callable[[int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> MetricSums:
    """The sums :class:`Metrics` of ``model`` on ``x`` (N, ...) and ``y`` (N, ...) are made of
    (``.metrics()``), measured in eval mode under ``no_grad``; every module's training flag is
    restored. Batches go to ``device`` (default: the model's). ``progress`` sees the number of
    batches done; ``should_stop`` is asked before each batch."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    num_samples = x.shape[0]
    if num_samples == 0 or y.shape[0] != num_samples:
        raise DataError(
            f"evaluation needs at least one sample and one label per sample, got {num_samples} "
            f"samples and {y.shape[0]} labels"
        )
    target = model_device(model) if device is None else torch.device(device)
    total = torch.zeros((), dtype=torch.float64, device=target)
    correct = torch.zeros((), dtype=torch.int64, device=target)
    with training_flags(model), torch.no_grad():
        model.eval()
        for done, batch in enumerate(iter_batches(x, batch_size)):
            start = done * batch_size
            if should_stop is not None and should_stop():
                raise JobCanceled(f"evaluation canceled after {done} batches")
            xb = batch.to(target)  # (B, ...)
            yb = y[start : start + batch_size].to(target)
            outputs = model(xb)  # (B, ...)
            if start == 0:
                check_targets(outputs, y, loss)
            total += compute_loss(outputs, yb, loss, "sum").double()
            if loss == "cross_entropy":
                correct += (outputs.argmax(dim=1) == yb).sum()
            if progress is not None:
                progress(done + 1)
    return MetricSums(loss, num_samples, y[0].numel(), total.item(), int(correct.item()))
