"""An adapt job's estimation step: the job's estimator, found in the estimator table.

:func:`run_task` is the step :func:`workers.running.compute.compute` runs for an adapt job
by default; the merge of a sharded job passes another :data:`Estimate` instead
(workers/sharding/compute.py). Which function runs is the ``runner`` of the estimator's row in
``api_schemas.jobs.adapt.ESTIMATORS`` (NOTE [ The estimator table ]): it takes an
:class:`EstimatorTask` and returns the :class:`~workers.estimators.running.AdaptStats`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from api_schemas import AdaptParams
from workers import import_path
from workers.estimators.layer_statistics import LayerStatistics
from workers.estimators.running import AdaptStats
from workers.running.data import Batches, Data, iter_batches, num_batches
from workers.running.hooks import JobHooks
from workers.running.steps import Forward, StepClock

__all__ = [
    "Estimate",
    "EstimatorTask",
    "MergedRunner",
    "load_merged_runner",
    "load_runner",
    "run_estimator",
    "run_task",
]


@dataclass(frozen=True)
class EstimatorTask:
    """What an estimator's runner gets: the model, the job's params, the selected layers, the
    job's hooks (progress, cancel) and its data."""

    model: nn.Module
    params: AdaptParams
    layers: list[str]
    hooks: JobHooks
    x: Data  # (N, ...) read a batch at a time, on the CPU
    reset: bool
    device: torch.device
    # Estimators with backward passes (the row's `backward`): what runs their steps' forward
    # passes (None: the model; a compiled job's torch.compile of it) and what times the steps.
    forward: Forward | None = None
    clock: StepClock | None = None

    @property
    def total(self) -> int:
        """The batches one pass runs: whole batches in order, at most ``max_batches``."""
        return num_batches(len(self.x), self.params.batch_size, self.params.max_batches)

    def batches(self) -> Iterator[torch.Tensor]:
        """A fresh pass over the job's batches, each moved to the device as it comes."""
        return (b.to(self.device) for b in self.views())

    def views(self) -> Iterator[torch.Tensor]:
        """The job's batches on the CPU, each read as it comes."""
        return iter_batches(self.x, self.params.batch_size, self.params.max_batches)

    def sequence(self) -> Batches:
        """The job's batches on the CPU as a sequence that reads a batch when it is indexed
        (an estimator that cycles over them holds none)."""
        return Batches(self.x, self.params.batch_size, self.params.max_batches)

    def start(
        self, total: int | None = None, unit: Literal["batches", "steps"] = "batches"
    ) -> None:
        """Starts the job's `adapt` phase: ``total`` (default :attr:`total`) units."""
        self.hooks.start_phase(
            "adapt", self.total if total is None else total, unit, float(self.params.batch_size)
        )


# An adapt job's estimation step on the task's loaded model and selected layers. By default the
# job's estimator runs over the dataset (`run_task`); the merge of a sharded job applies the
# statistics its shards collected instead (workers/sharding/compute.py).
Estimate = Callable[[EstimatorTask], AdaptStats]
Runner = Estimate
# The row's `merged_runner`: the merge's step with the shards' merged statistics per layer
# and what the shards ran (batches and samples, all shards together).
MergedRunner = Callable[[EstimatorTask, Mapping[str, LayerStatistics], AdaptStats], AdaptStats]


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
