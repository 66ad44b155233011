"""Evaluate jobs: a model's accuracy (or MSE) and loss on a labelled dataset."""

from typing import Literal

from pydantic import Field

from api_schemas.common import RequestModel, ResourceId
from api_schemas.jobs.params import (
    DEFAULT_MAX_ATTEMPTS,
    BatchSize,
    Device,
    JobPreprocessing,
    JobPriority,
    JobTags,
    JobTimeout,
    MaxAttempts,
)

__all__ = ["EvaluateJobCreate", "EvaluateParams"]


class EvaluateParams(RequestModel):
    """Measure a model on a labelled dataset, changing nothing: eval mode, no gradients.
    ``loss=None`` picks cross-entropy (and accuracy) for class labels and MSE for float
    targets."""

    batch_size: BatchSize = 512
    loss: Literal["cross_entropy", "mse"] | None = None
    device: Device = "auto"
    # A spec for this job's images in place of the dataset's, or "model" (JobPreprocessing).
    preprocessing: JobPreprocessing = None


class EvaluateJobCreate(RequestModel):
    """Asks for the accuracy (or MSE) and loss of a model on a labelled dataset; no new model
    is registered."""

    kind: Literal["evaluate"]
    model_id: ResourceId
    dataset_id: ResourceId
    params: EvaluateParams = Field(default_factory=EvaluateParams)
    max_attempts: MaxAttempts = DEFAULT_MAX_ATTEMPTS
    tags: JobTags = Field(default_factory=dict)
    priority: JobPriority = 0
    timeout_s: JobTimeout = None
