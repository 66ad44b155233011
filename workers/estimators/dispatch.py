"""An adapt job's estimation step: which estimator runs over the dataset, and how.

:func:`run_estimator` is the step :func:`workers.running.compute.compute` runs by default; the
merge of a sharded job passes another :data:`Estimate` instead (workers/sharding/compute.py). The
estimators themselves are in workers/estimators/running.py (``ema``, ``cumulative``),
workers/estimators/precise.py (``precise``, ``prior``) and workers/estimators/entropy.py
(``entropy``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import assert_never

import torch
from torch import nn

from api_schemas import AdaptParams
from workers.estimators.entropy import entropy_adapt
from workers.estimators.precise import (
    layerwise_precise_batchnorm,
    precise_batchnorm,
)
from workers.estimators.prior import prior_batchnorm
from workers.estimators.running import AdaptStats, adapt_batchnorm
from workers.running.data import iter_batches, num_batches
from workers.running.hooks import JobHooks

__all__ = ["Estimate", "run_estimator"]

# An adapt job's estimation step on the loaded model and its selected `layers`. By default the
# job's estimator runs over the dataset (`run_estimator`); the merge of a sharded job applies
# the statistics its shards collected instead (workers/sharding/compute.py).
Estimate = Callable[[nn.Module, AdaptParams, list[str], JobHooks], AdaptStats]


def run_estimator(
    model: nn.Module,
    params: AdaptParams,
    layers: list[str],
    hooks: JobHooks,
    *,
    x: torch.Tensor,
    reset: bool,
    device: torch.device,
) -> AdaptStats:
    """Runs the job's estimator on ``x`` (N, ...) on the CPU, batch by batch on ``device``."""
    total = num_batches(len(x), params.batch_size, params.max_batches)

    def fresh_data() -> Iterator[torch.Tensor]:  # (B, ...) on the device, batch by batch
        return (b.to(device) for b in iter_batches(x, params.batch_size, params.max_batches))

    data = fresh_data()
    progress, should_stop = hooks.report, hooks.should_stop
    estimator = params.estimator
    match estimator:
        case "ema" | "cumulative":
            hooks.start_phase("adapt", total, "batches", float(params.batch_size))
            return adapt_batchnorm(
                model,
                data,
                estimator=estimator,
                layers=layers,
                reset=reset,
                progress=progress,
                should_stop=should_stop,
            )
        case "precise" if params.layerwise:
            hooks.start_phase("adapt", total * len(layers), "batches", float(params.batch_size))
            return layerwise_precise_batchnorm(
                model,
                fresh_data,
                layers=layers,
                progress=progress,
                should_stop=should_stop,
            )
        case "precise":
            hooks.start_phase("adapt", total, "batches", float(params.batch_size))
            return precise_batchnorm(
                model, data, layers=layers, progress=progress, should_stop=should_stop
            )
        case "prior":
            hooks.start_phase("adapt", total, "batches", float(params.batch_size))
            return prior_batchnorm(
                model,
                data,
                layers=layers,
                strength=params.prior_strength,
                base=params.prior_base,
                progress=progress,
                should_stop=should_stop,
            )
        case "entropy":
            steps = params.steps or total
            hooks.start_phase("adapt", steps, "steps", float(params.batch_size))
            # Views of the CPU tensor: each step moves its batch to `device`.
            views = list(iter_batches(x, params.batch_size, params.max_batches))
            return entropy_adapt(
                model,
                views,
                layers=layers,
                lr=params.lr,
                steps=steps,
                optimizer=params.optimizer,
                reset=reset,
                progress=progress,
                should_stop=should_stop,
            )
        case _:
            assert_never(estimator)
