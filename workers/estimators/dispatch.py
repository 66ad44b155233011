"""An adapt job's estimation step: the job's estimator, found in the estimator table.

:func:`run_task` is the step an adapt job runs by default (workers/running/adaptation.py); the
merge of a sharded job passes another :data:`~workers.estimators.base.Estimate` instead
(workers/sharding/compute.py). Which function runs is the ``runner`` of the estimator's row in
``api_schemas.jobs.adapt.ESTIMATORS`` (NOTE [ The estimator table ]): it takes an
:class:`~workers.estimators.base.EstimatorTask` and returns the
:class:`~workers.estimators.base.AdaptStats` (the contract: workers/estimators/base.py).
"""

from __future__ import annotations

import torch
from torch import nn

from api_schemas import AdaptParams
from workers import import_path
from workers.estimators.base import AdaptStats, EstimatorTask, MergedRunner, Runner
from workers.passes.data import Data
from workers.passes.hooks import JobHooks
from workers.passes.steps import Forward, StepClock

__all__ = [
    "load_merged_runner",
    "load_runner",
    "run_estimator",
    "run_task",
]


def load_runner(path: str) -> Runner:
    """The function a ``module:function`` path names."""
    runner: Runner = import_path(path)
    return runner


def load_merged_runner(path: str) -> MergedRunner:
    """The function a row's ``merged_runner`` path names."""
    runner: MergedRunner = import_path(path)
    return runner


def run_task(task: EstimatorTask) -> AdaptStats:
    """Runs the task's estimator: the ``runner`` of its row."""
    return load_runner(task.params.spec.runner)(task)


def run_estimator(
    model: nn.Module,
    params: AdaptParams,
    layers: list[str],
    hooks: JobHooks,
    *,
    x: Data,
    reset: bool,
    device: torch.device,
    forward: Forward | None = None,
    clock: StepClock | None = None,
) -> AdaptStats:
    """Runs the job's estimator on ``x`` (N, ...) on the CPU, batch by batch on ``device``."""
    return run_task(EstimatorTask(model, params, layers, hooks, x, reset, device, forward, clock))
