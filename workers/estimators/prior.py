"""The ``prior`` estimator: target statistics mixed with the source ones (Schneider et al.
2020, "Improving robustness against common corruptions by covariate shift adaptation").

- :func:`prior_batchnorm` — estimates the target statistics with ``precise`` or ``cumulative``,
  then mixes them with the source ones by :func:`mix_with_source`;
- :func:`mix_statistics` — the mixing rule, also used by the merge of a sharded job.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import torch
from torch import nn

from workers.errors import AdaptError
from workers.estimators.base import AdaptStats, EstimatorTask, resolve_batchnorm
from workers.estimators.moving_averages import adapt_batchnorm
from workers.estimators.precise import precise_batchnorm, running_statistics

__all__ = ["PriorBase", "mix_statistics", "mix_with_source", "prior_batchnorm", "run"]

PriorBase = Literal["precise", "cumulative"]


def mix_statistics(
    source: torch.Tensor, target: torch.Tensor, *, strength: float, samples: int
) -> torch.Tensor:
    """``N / (N + n) * source + n / (N + n) * target`` in float64, ``N`` the prior strength and
    ``n`` the number of target samples; the result has ``target``'s dtype."""
    if strength < 0:
        raise AdaptError(f"prior strength must be >= 0, got {strength}")
    if samples < 1:
        raise AdaptError(
            f"prior mixing needs target samples, got {samples}; adapt on at least one sample"
        )
    total = strength + samples
    mixed = source.to(torch.float64) * (strength / total) + target.to(torch.float64) * (
        samples / total
    )
    return mixed.to(target.dtype)


def prior_batchnorm(
    model: nn.Module,
    batches: Iterable[torch.Tensor],
    *,
    layers: Sequence[str],
    strength: float,
    base: PriorBase,
    progress: Callable[[int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    forward: Callable[[torch.Tensor], Any] | None = None,
) -> AdaptStats:
    """Estimates the target statistics with ``base`` (``precise`` or ``cumulative``), then
    mixes them with the source ones by :func:`mix_with_source`."""
    if base not in ("precise", "cumulative"):
        raise AdaptError(f"unknown prior base {base!r}; use 'precise' or 'cumulative'")

    def estimate() -> AdaptStats:
        if base == "precise":
            return precise_batchnorm(
                model,
                batches,
                layers=layers,
                progress=progress,
                should_stop=should_stop,
                forward=forward,
            )
        return adapt_batchnorm(
            model,
            batches,
            estimator="cumulative",
            layers=layers,
            reset=True,
            progress=progress,
            should_stop=should_stop,
            forward=forward,
        )

    return mix_with_source(model, layers, strength, estimate)


def mix_with_source(
    model: nn.Module, layers: Sequence[str], strength: float, estimate: Callable[[], AdaptStats]
) -> AdaptStats:
    """Runs ``estimate()``, which writes target statistics into ``layers``, then mixes each
    layer's running mean and variance with its values from before the call (the source) by
    :func:`mix_statistics`, ``n`` the samples ``estimate`` saw. ``num_batches_tracked`` is the
    estimate's."""
    if strength < 0:
        raise AdaptError(f"prior strength must be >= 0, got {strength}")
    selected = resolve_batchnorm(model, layers)
    source = [tuple(t.clone() for t in running_statistics(bn)) for bn in selected]
    stats = estimate()
    with torch.no_grad():
        for bn, (mean, var) in zip(selected, source, strict=True):
            running_mean, running_var = running_statistics(bn)
            n = stats.samples
            running_mean.copy_(mix_statistics(mean, running_mean, strength=strength, samples=n))
            running_var.copy_(mix_statistics(var, running_var, strength=strength, samples=n))
    return stats


def run(task: EstimatorTask) -> AdaptStats:
    """The ``prior`` row of the estimator table."""
    task.start()
    return prior_batchnorm(
        task.model,
        task.batches(),
        layers=task.layers,
        strength=task.params.prior_strength,
        base=task.params.prior_base,
        progress=task.hooks.report,
        should_stop=task.hooks.should_stop,
        forward=task.forward,
    )
