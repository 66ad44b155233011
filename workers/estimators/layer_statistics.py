"""Per-channel sufficient statistics of a layer's input, mergeable in any order (Chan et al.)
and JSON-safe: what ``precise``, ``cumulative`` and the shards of a sharded job collect."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from workers.errors import AdaptError

__all__ = ["LayerStatistics", "Weighting"]

# How batches combine into running statistics: every element alike (`precise`), or every batch
# alike (`cumulative`, BatchNorm's momentum None).
Weighting = Literal["elements", "batches"]


@dataclass
class LayerStatistics:
    """Per-channel sufficient statistics of one layer's input: ``count`` elements per channel
    (N * H * W summed over batches), their ``mean`` (C,) and ``m2`` (C,), the sum of squared
    deviations from the mean, both float64; ``batches`` is how many batches contributed.

    ``mean_sum`` and ``var_sum`` (C,) float64 are the sums over those batches of each batch's
    mean and unbiased variance, what ``cumulative`` averages with equal weight per batch; None
    where unknown (statistics not collected batch by batch), zeros when there are no batches.
    """

    count: int
    mean: torch.Tensor  # (C,) float64
    m2: torch.Tensor  # (C,) float64
    batches: int = field(default=0)
    mean_sum: torch.Tensor | None = None  # (C,) float64
    var_sum: torch.Tensor | None = None  # (C,) float64

    def __post_init__(self) -> None:
        if self.count < 0 or self.batches < 0:
            raise ValueError(f"count {self.count} and batches {self.batches} must be >= 0")
        if self.mean.shape != self.m2.shape or self.mean.dim() != 1:
            raise ValueError(
                f"mean {tuple(self.mean.shape)} and m2 {tuple(self.m2.shape)} must both be (C,)"
            )
        self.mean = self.mean.to(torch.float64)
        self.m2 = self.m2.to(torch.float64)
        if self.batches == 0:
            self.mean_sum = torch.zeros_like(self.mean) if self.mean_sum is None else self.mean_sum
            self.var_sum = torch.zeros_like(self.mean) if self.var_sum is None else self.var_sum
        for name in ("mean_sum", "var_sum"):
            value = getattr(self, name)
            if value is not None:
                if value.shape != self.mean.shape:
                    raise ValueError(
                        f"{name} {tuple(value.shape)} must be (C,) like mean "
                        f"{tuple(self.mean.shape)}"
                    )
                setattr(self, name, value.to(torch.float64))

    @property
    def channels(self) -> int:
        return self.mean.shape[0]

    def variance(self, unbiased: bool = True) -> torch.Tensor:
        """(C,) float64; unbiased (divided by count - 1) as BatchNorm's running_var."""
        denominator = self.count - 1 if unbiased else self.count
        if denominator < 1:
            raise AdaptError(
                f"the variance needs at least {2 if unbiased else 1} values per channel, got "
                f"{self.count}; adapt on more samples"
            )
        return self.m2 / denominator

    def running(self, weighting: Weighting = "elements") -> tuple[torch.Tensor, torch.Tensor]:
        """``(running_mean, running_var)`` (C,) float64 as BatchNorm keeps them, the variance
        unbiased: ``elements`` pools every element (``precise``), ``batches`` averages the
        batch means and unbiased batch variances with equal weight (``cumulative``)."""
        if weighting == "elements":
            return self.mean, self.variance()
        if self.mean_sum is None or self.var_sum is None:
            raise AdaptError(
                "per-batch averages need statistics collected batch by batch "
                "(collect_statistics); these have only pooled ones: use weighting 'elements'"
            )
        if self.batches < 1:
            raise AdaptError("per-batch averages need at least one batch; adapt on more samples")
        return self.mean_sum / self.batches, self.var_sum / self.batches

    def merge(self, other: LayerStatistics) -> LayerStatistics:
        """The statistics of both data sets together (Chan et al.'s parallel combination)."""
        if other.channels != self.channels:
            raise ValueError(
                f"cannot merge statistics of {self.channels} and {other.channels} channels; "
                "merge shards of the same layer only"
            )
        batches = self.batches + other.batches
        mean_sum = _add(self.mean_sum, other.mean_sum)
        var_sum = _add(self.var_sum, other.var_sum)
        if other.count == 0:
            return LayerStatistics(self.count, self.mean, self.m2, batches, mean_sum, var_sum)
        if self.count == 0:
            return LayerStatistics(other.count, other.mean, other.m2, batches, mean_sum, var_sum)
        other_mean = other.mean.to(self.mean.device)
        count = self.count + other.count
        delta = other_mean - self.mean  # (C,)
        weight = other.count / count
        mean = self.mean + delta * weight
        m2 = self.m2 + other.m2.to(self.m2.device) + delta * delta * (self.count * weight)
        return LayerStatistics(count, mean, m2, batches, mean_sum, var_sum)


def _add(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    return None if a is None or b is None else a + b.to(a.device)
