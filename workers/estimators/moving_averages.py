"""Moving averages of batch statistics: BatchNorm adaptation with forward passes only.

Two estimators here, each equal bitwise to the loop users write by hand (``precise`` and
``prior`` are in workers/estimators/precise.py, ``entropy`` in workers/estimators/entropy.py):

- ``ema``: the selected layers in train mode with their own momentum, ``model(x)`` under
  ``no_grad`` per batch; running stats are reset first only when asked.
- ``cumulative``: as ``torch.optim.swa_utils.update_bn``: reset, momentum ``None`` (an equal-
  weight average of the batch statistics: torch divides by num_batches_tracked), momentum
  restored afterwards.

Unlike ``update_bn``, only the selected BatchNorm layers are in train mode during the pass:
Dropout and unselected BatchNorm stay in eval mode, so unselected statistics are kept bit for
bit and the pass is deterministic. Under ``no_grad`` a checkpoint wrapper just calls its
module, so wrapped models give the same result.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import torch
from torch import nn

from workers.errors import AdaptError
from workers.estimators.base import (
    AdaptStats,
    EstimatorTask,
    check_stop,
    nonempty,
    resolve_batchnorm,
)
from workers.models.modules import training_flags

__all__ = ["Estimator", "adapt_batchnorm", "run_cumulative", "run_ema"]

Estimator = Literal["ema", "cumulative"]


def adapt_batchnorm(
    model: nn.Module,
    batches: Iterable[torch.Tensor],
    *,
    estimator: Estimator,
    layers: Sequence[str],
    reset: bool,
    progress: Callable[[int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    forward: Callable[[torch.Tensor], Any] | None = None,
) -> AdaptStats:
    """Update the running statistics of ``layers`` from ``batches`` (inputs on the model's
    device, ``(B, ...)``); see the module docstring. ``reset`` applies to ``ema`` only:
    ``cumulative`` always resets. ``progress(batches_done)`` after each batch; ``should_stop()``
    before each, raising :class:`JobCanceled` when it answers True. ``forward`` runs each
    batch (default ``model``; a compiled job's ``torch.compile`` of it).
    """
    if estimator not in ("ema", "cumulative"):
        raise AdaptError(
            f"unknown estimator {estimator!r} for adapt_batchnorm; use 'ema' or 'cumulative' "
            "(precise and prior: workers/estimators/precise.py, entropy: "
            "workers/estimators/entropy.py)"
        )
    selected = resolve_batchnorm(model, layers)
    checked = nonempty(batches)
    momenta = [bn.momentum for bn in selected]
    done = samples = 0
    with training_flags(model), torch.no_grad():
        try:
            model.eval()
            for bn in selected:
                bn.train()
                if estimator == "cumulative" or reset:
                    bn.reset_running_stats()
                if estimator == "cumulative":
                    bn.momentum = None
            for batch in checked:  # (B, ...)
                check_stop(should_stop, done)
                (model if forward is None else forward)(batch)
                done += 1
                samples += batch.shape[0]
                if progress is not None:
                    progress(done)
        finally:
            for bn, momentum in zip(selected, momenta, strict=True):
                bn.momentum = momentum
    return AdaptStats(batches=done, samples=samples)


def run_ema(task: EstimatorTask) -> AdaptStats:
    """The ``ema`` row of the estimator table: the layers' own momentum."""
    return _run(task, "ema")


def run_cumulative(task: EstimatorTask) -> AdaptStats:
    """The ``cumulative`` row of the estimator table."""
    return _run(task, "cumulative")


def _run(task: EstimatorTask, estimator: Estimator) -> AdaptStats:
    task.start()
    return adapt_batchnorm(
        task.model,
        task.batches(),
        estimator=estimator,
        layers=task.layers,
        reset=task.reset,
        progress=task.hooks.report,
        should_stop=task.hooks.should_stop,
        forward=task.forward,
    )
