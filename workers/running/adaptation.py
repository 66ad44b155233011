"""An adapt job's change to the model: the selected BatchNorm layers re-estimated by the job's
estimator, and the report's prediction diagnostics on held-out target samples around it.

:class:`Adaptation` is the adapt kind's :class:`~workers.running.compute.ModelChange`. It lives
here, below the kinds, because the merge of a sharded job runs it too, with the shards'
statistics applied in place of the estimator's pass (an ``estimate``,
workers/sharding/compute.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from api_schemas import AdaptParams
from api_schemas.reports import PredictionDiagnostics
from workers.errors import AdaptError
from workers.estimators.auto import AutoStats
from workers.estimators.base import (
    Estimate,
    EstimatorTask,
    select_affine_norms,
    select_batchnorm,
)
from workers.estimators.dispatch import run_task
from workers.models.modules import named_modules
from workers.passes.data import Data
from workers.passes.precision import adaptation_numerics
from workers.passes.predictions import (
    MAX_DIAGNOSTIC_SAMPLES,
    PredictionSums,
    TargetSplit,
    diagnostics,
    predict,
    split_target,
)
from workers.running.compute import (
    ChangeResult,
    ChangeTask,
    ModelChange,
    one_sample_batch_explained,
)
from workers.running.loading import LoadedJob

__all__ = ["Adaptation"]


class Adaptation(ModelChange):
    """The job's estimator on its selected layers; ``estimate`` replaces the estimator (see
    :data:`~workers.estimators.base.Estimate`). It keeps the input model's predictions from
    :meth:`before` to :meth:`diagnostics`, so one instance serves one computation."""

    def __init__(self, params: AdaptParams, estimate: Estimate | None = None) -> None:
        self.params = params
        self.estimate = estimate or run_task
        self._target: _Target | None = None

    @property
    def timed(self) -> bool:
        return self.params.spec.backward

    def measured_samples(self, num_samples: int) -> int:
        # The first samples, bounded by measure_batches: a short adaptation of a large dataset
        # is not dominated by measuring it.
        return self.params.measured_samples(num_samples)

    def before(self, job: LoadedJob) -> None:
        self._target = _target_before(job.model, job.x, self.params, job.device)

    def run(self, task: ChangeTask) -> ChangeResult:
        params, job, target = self.params, task.job, self._target
        assert target is not None, "compute measures before it changes the model"
        # Estimators that train affine parameters only (entropy) may have no BatchNorm layer to
        # run: a model of LayerNorm or GroupNorm layers adapts by their affine parameters.
        statistics_free = not params.spec.needs_running_stats
        adapted = select_batchnorm(
            job.model, params.include, params.exclude, required=not statistics_free
        )
        norms = []
        if statistics_free and params.affine_norms == "all":
            norms = select_affine_norms(job.model, params.include, params.exclude)
        if statistics_free and not adapted and not norms:
            raise AdaptError(
                f"no normalization layer to adapt: include {list(params.include)} and exclude "
                f"{list(params.exclude)} select no BatchNorm layer with running statistics"
                + (
                    " and no LayerNorm or GroupNorm layer with affine parameters"
                    if params.affine_norms == "all"
                    else " (affine_norms 'all' would add LayerNorm and GroupNorm layers)"
                )
                + "; widen `include` or narrow `exclude`"
            )
        reset = params.effective_reset()
        given = job.x if params.spec.holds_out else target.split.estimation
        estimation = EstimatorTask(
            model=job.model,
            params=params,
            layers=adapted,
            hooks=task.hooks,
            x=given,
            reset=reset,
            device=job.device,
            forward=task.forward,
            clock=task.clock,
            affine_layers=norms,
        )
        with (
            one_sample_batch_explained(len(given), params.batch_size, params.max_batches),
            adaptation_numerics(job.model, job.device, params.precision, params.channels_last),
        ):
            stats = self.estimate(estimation)
        auto = None
        if isinstance(stats, AutoStats):  # whether statistics started anew depends on its choice
            reset, auto = stats.reset, stats.choice
        return ChangeResult(
            batches=stats.batches,
            samples=stats.samples,
            changed=adapted,
            estimator=params.estimator,
            reset=reset,
            auto=auto,
            chosen_layers=True,
            affine=_trained_affine(job.model, adapted, norms) if statistics_free else [],
        )

    def diagnostics(self, job: LoadedJob) -> PredictionDiagnostics | None:
        assert self._target is not None, "compute measures before it changes the model"
        return _target_after(job.model, self._target, job.device)


def _trained_affine(model: nn.Module, batchnorm: list[str], norms: list[str]) -> list[str]:
    """The layers whose affine parameters entropy trained, in module order."""
    trained = set(norms) | {
        name
        for name, module in named_modules(model)
        if name in batchnorm
        and any(isinstance(getattr(module, p, None), nn.Parameter) for p in ("weight", "bias"))
    }
    return [name for name, _ in named_modules(model) if name in trained]


@dataclass(frozen=True)
class _Target:
    """An adapt job's samples split by its holdout, and the input model's predictions on the
    diagnostics' samples."""

    split: TargetSplit
    batch_size: int
    samples: int  # how many of the held-out samples the diagnostics cover
    before: PredictionSums | None  # None: the model's output is not class logits


def _target_before(model: nn.Module, x: Data, params: AdaptParams, device: torch.device) -> _Target:
    """NOTE [ Held-out target samples ] (workers/passes/predictions.py): the split, and the
    predictions before estimation."""
    split = split_target(
        x, params.batch_size, params.max_batches, params.effective_holdout(), params.seed
    )
    # Bounded like the labelled measurement (measure_batches) and by MAX_DIAGNOSTIC_SAMPLES.
    samples = min(len(split.held_out), MAX_DIAGNOSTIC_SAMPLES)
    if params.measure_batches is not None:
        samples = min(samples, params.measure_batches * params.batch_size)
    before = predict(model, split.held_out[:samples], batch_size=params.batch_size, device=device)
    return _Target(split, params.batch_size, samples, before)


def _target_after(
    model: nn.Module, target: _Target, device: torch.device
) -> PredictionDiagnostics | None:
    """The report's diagnostics: the output model's predictions on the same samples."""
    sample = target.split.held_out[: target.samples]
    after = predict(model, sample, batch_size=target.batch_size, device=device)
    return diagnostics(target.before, after, target.split.is_held_out)
