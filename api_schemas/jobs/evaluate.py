"""Evaluate jobs: a model's accuracy (or MSE) and loss on a labelled dataset."""

from typing import Literal

from pydantic import Field

from api_schemas.jobs.params import BaseJobCreate, BaseJobParams, BatchSize

__all__ = ["EvaluateJobCreate", "EvaluateParams"]


class EvaluateParams(BaseJobParams):
    """Measure a model on a labelled dataset, changing nothing: eval mode, no gradients.
    ``loss=None`` picks cross-entropy (and accuracy) for class labels and MSE for float
    targets."""

    # Larger than the other kinds' default: no gradients and no activations kept for them.
    batch_size: BatchSize = 512
    loss: Literal["cross_entropy", "mse"] | None = None


class EvaluateJobCreate(BaseJobCreate):
    """Asks for the accuracy (or MSE) and loss of a model on a labelled dataset; no new model
    is registered."""

    kind: Literal["evaluate"]
    params: EvaluateParams = Field(default_factory=EvaluateParams)
