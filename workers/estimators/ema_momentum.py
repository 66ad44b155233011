"""The ``ema_momentum`` estimator: the train-mode running-average loop with the job's own
``momentum`` instead of each layer's (torch's default 0.1 keeps about 1e-5 of the source
statistics after 100 batches; a smaller momentum blends the target in more slowly)."""

from __future__ import annotations

from workers.estimators.base import AdaptStats, EstimatorTask, resolve_batchnorm
from workers.estimators.moving_averages import run_ema

__all__ = ["run"]


def run(task: EstimatorTask) -> AdaptStats:
    """The ``ema_momentum`` row of the estimator table: ``ema`` with the selected layers'
    momentum set to the job's for the pass, and put back after it."""
    selected = resolve_batchnorm(task.model, task.layers)
    momenta = [bn.momentum for bn in selected]
    try:
        for bn in selected:
            bn.momentum = task.params.momentum
        return run_ema(task)
    finally:
        for bn, momentum in zip(selected, momenta, strict=True):
            bn.momentum = momentum
