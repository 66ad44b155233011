"""A model's class predictions on target samples, without labels: which samples (the held-out
split, NOTE [ Held-out target samples ]), the predictions kept as sums (:func:`predict`, so no
(N, classes) array is held) and the report's diagnostics from two of them.

Below both the estimators and job running: the ``auto`` estimator scores its candidates with
them, and an adapt job's report measures its diagnostics with them
(workers/running/adaptation.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

import torch
from torch import nn

from api_schemas.jobs.adapt import holdout_sizes
from api_schemas.reports import PredictionDiagnostics, Predictions
from workers.errors import AdaptError, JobCanceled
from workers.models.modules import training_flags
from workers.passes.data import Data, iter_batches

__all__ = [
    "MAX_DIAGNOSTIC_SAMPLES",
    "PredictionSums",
    "TargetSplit",
    "diagnostics",
    "predict",
    "split_target",
]

# The diagnostics of a report look at no more target samples than this (the first ones of the
# held-out part, itself a random draw, or of the job's samples when nothing is held out).
MAX_DIAGNOSTIC_SAMPLES: Final = 10_000

# The least probability whose log the marginal entropy takes: a class no sample predicts has
# probability 0, and 0 * log(0) must stay 0, not nan (reports are JSON, which has no nan).
_TINY = float(torch.finfo(torch.float32).tiny)


# NOTE [ Held-out target samples ]
#
# An adapt job uses the first `used` samples of its dataset: all of them, or `max_batches`
# batches. With a holdout fraction f > 0, round(f * used) of them (at least 1, at most used - 1),
# drawn by a permutation seeded with the job's seed, are held out: the estimator never sees
# them, and the report's diagnostics and the auto estimator's scores are measured on them, so
# they say how the adapted model does on target samples it was not fitted to. Both parts keep
# the dataset's order; the estimation part is batched in the job's batch size as the dataset
# would be. With f = 0 nothing is held out: the estimator gets the dataset as before (its
# results are bitwise those of earlier releases) and the diagnostics use the samples it used.
# The auto estimator gets the whole dataset and calls split_target itself with the same
# arguments, so it holds out exactly the samples the report's diagnostics use. The shards of a
# sharded job call it too and split its estimation part (the sizes: holdout_sizes in
# api_schemas/jobs/adapt.py, which the API's check of shards against batches reads as well).


@dataclass(frozen=True)
class TargetSplit:
    """An adapt job's samples: ``estimation`` (N_e, ...) for the estimator, ``held_out``
    (N_h, ...) for the scores; ``is_held_out`` False when they are the estimation samples."""

    estimation: Data
    held_out: Data
    is_held_out: bool
    # The seeded permutation of the used samples that drew them (the first len(held_out) are
    # held out), None when nothing is held out: the auto estimator's folds come from it.
    order: torch.Tensor | None = None


def split_target(
    x: Data, batch_size: int, max_batches: int | None, fraction: float, seed: int
) -> TargetSplit:
    """See NOTE [ Held-out target samples ]; ``x`` (N, ...) on the CPU. Raises
    :class:`AdaptError` when ``fraction > 0`` leaves fewer than one sample on either side."""
    used, held = holdout_sizes(len(x), batch_size, max_batches, fraction)
    if fraction <= 0:
        return TargetSplit(x, x[:used], is_held_out=False)
    if held < 1:
        raise AdaptError(
            f"holdout {fraction:g} needs at least 2 samples (one to estimate on, one held out), "
            f"the job uses {used}; upload more samples, raise max_batches, or set holdout 0 "
            "with a fixed estimator"
        )
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(used, generator=generator)  # (used,)
    held_out = order[:held].sort().values
    estimation = order[held:].sort().values
    return TargetSplit(x[estimation], x[held_out], is_held_out=True, order=order)


@dataclass(frozen=True)
class PredictionSums:
    """What :func:`predict` keeps of a model's class predictions on N samples, in float64."""

    samples: int
    entropy_sum: float  # sum over samples of the entropy (nats) of the softmax
    max_probability_sum: float
    probability_sum: torch.Tensor  # (K,) sum over samples of the softmax
    predicted: torch.Tensor  # (N,) int64, the argmax per sample

    def predictions(self) -> Predictions:
        marginal = self.probability_sum / self.samples  # (K,)
        marginal_entropy = -(marginal * marginal.clamp_min(_TINY).log()).sum().item()
        return Predictions(
            mean_entropy=max(self.entropy_sum / self.samples, 0.0),
            mean_max_probability=min(self.max_probability_sum / self.samples, 1.0),
            marginal_entropy=max(marginal_entropy, 0.0),
        )

    def information(self) -> float:
        """Marginal entropy minus mean entropy (nats): high when each prediction is confident
        and the predictions spread over the classes (the auto estimator's score)."""
        found = self.predictions()
        return found.marginal_entropy - found.mean_entropy

    @staticmethod
    def pooled(parts: Sequence[PredictionSums]) -> PredictionSums:
        """The sums over the samples of all ``parts``, in their order (the predictions of
        several models on disjoint samples, as cross-fitting scores them)."""
        first = parts[0]
        return PredictionSums(
            sum(p.samples for p in parts),
            sum(p.entropy_sum for p in parts),
            sum(p.max_probability_sum for p in parts),
            sum((p.probability_sum for p in parts[1:]), first.probability_sum),
            torch.cat([p.predicted for p in parts]),
        )

    def changed_fraction(self, other: PredictionSums) -> float:
        """The fraction of samples whose predicted class differs in ``other`` (same samples)."""
        if other.samples != self.samples:
            raise ValueError(f"predictions on {self.samples} and {other.samples} samples differ")
        return (self.predicted != other.predicted).double().mean().item()


def predict(
    model: nn.Module,
    x: Data,
    *,
    batch_size: int,
    device: torch.device,
    should_stop: Callable[[], bool] | None = None,
) -> PredictionSums | None:
    """The model's predictions on ``x`` (N, ...) on the CPU, in eval mode under ``no_grad``,
    batch by batch on ``device``; None when its output is not class logits (B, K >= 2) or
    ``x`` is empty. The training flags are as before when it returns."""
    entropy_sum = max_probability_sum = 0.0
    probability_sum: torch.Tensor | None = None
    predicted: list[torch.Tensor] = []
    with training_flags(model), torch.no_grad():
        model.eval()
        for done, batch in enumerate(iter_batches(x, batch_size)):
            if should_stop is not None and should_stop():
                raise JobCanceled(f"predictions canceled after {done} batches")
            logits = model(batch.to(device))  # (B, K)
            if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[1] < 2:
                return None
            log_p = logits.detach().to("cpu", torch.float64).log_softmax(dim=1)  # (B, K)
            p = log_p.exp()
            # 0 * log 0 is 0, not the nan that 0 * -inf gives for a probability that underflows.
            entropy_sum += -torch.where(p > 0, p * log_p, 0.0).sum().item()
            max_probability_sum += p.max(dim=1).values.sum().item()
            probability_sum = (
                p.sum(dim=0) if probability_sum is None else probability_sum + p.sum(0)
            )
            predicted.append(p.argmax(dim=1))
    if probability_sum is None or not math.isfinite(entropy_sum):
        return None
    return PredictionSums(
        len(x), entropy_sum, max_probability_sum, probability_sum, torch.cat(predicted)
    )


def diagnostics(
    before: PredictionSums | None, after: PredictionSums | None, held_out: bool
) -> PredictionDiagnostics | None:
    """The report's diagnostics from predictions on the same samples before and after."""
    if before is None or after is None:
        return None
    return PredictionDiagnostics(
        samples=before.samples,
        held_out=held_out,
        before=before.predictions(),
        after=after.predictions(),
        changed_fraction=before.changed_fraction(after),
    )
