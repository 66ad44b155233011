"""Train jobs: all parameters trained with a plain optimizer on a labelled dataset."""

from typing import Final, Literal, Self

from pydantic import Field, model_validator

from api_schemas.common import RequestModel, ResourceId
from api_schemas.jobs.params import (
    DEFAULT_MAX_ATTEMPTS,
    MAX_LR,
    BatchSize,
    CheckpointPolicy,
    CompileBackend,
    Device,
    JobPreprocessing,
    JobPriority,
    JobTags,
    JobTimeout,
    MaxAttempts,
    compile_backend_fits,
)
from api_schemas.models import Seed

__all__ = ["MAX_EPOCHS", "TrainJobCreate", "TrainParams"]

# NOTE [ Job bounds ] in api_schemas/jobs/params.py.
MAX_EPOCHS: Final = 1000
MAX_WEIGHT_DECAY: Final = 1.0


class TrainParams(RequestModel):
    """Train all parameters with a plain optimizer. ``loss=None`` picks cross-entropy for class
    labels and MSE for float targets.

    ``compile``: the training steps run through ``torch.compile`` with ``compile_backend``
    (NOTE [ Compiled jobs ] in api_schemas/jobs/params.py); the report's ``steps`` gives the
    compilation's cost and the steady-state throughput."""

    epochs: int = Field(
        default=1, ge=1, le=MAX_EPOCHS, description=f"Passes over the data, 1 to {MAX_EPOCHS}."
    )
    batch_size: BatchSize = 64
    optimizer: Literal["sgd", "adamw"] = "sgd"
    lr: float = Field(
        default=0.05,
        gt=0.0,
        le=MAX_LR,
        allow_inf_nan=False,
        description=f"Learning rate, above 0, at most {MAX_LR:g}.",
    )
    momentum: float = Field(
        default=0.9,
        ge=0.0,
        lt=1.0,
        allow_inf_nan=False,
        description="sgd: momentum; adamw: its beta1. 0 to below 1.",
    )
    weight_decay: float = Field(
        default=0.0,
        ge=0.0,
        le=MAX_WEIGHT_DECAY,
        allow_inf_nan=False,
        description=f"Weight decay, 0 to {MAX_WEIGHT_DECAY:g}.",
    )
    loss: Literal["cross_entropy", "mse"] | None = None
    validation_fraction: float = Field(
        default=0.1,
        ge=0.0,
        le=0.9,
        allow_inf_nan=False,
        description="Fraction of the samples kept out of training to validate on, 0 to 0.9.",
    )
    checkpoint: CheckpointPolicy = Field(default_factory=CheckpointPolicy)
    seed: Seed = 0
    device: Device = "auto"
    # A spec for this job's images in place of the dataset's, or "model" (JobPreprocessing).
    preprocessing: JobPreprocessing = None
    compile: bool = False
    compile_backend: CompileBackend = "inductor"

    @model_validator(mode="after")
    def _compile_backend_fits(self) -> Self:
        compile_backend_fits(self.compile, self.compile_backend)
        return self


class TrainJobCreate(RequestModel):
    """Asks for training of a model on a labelled dataset."""

    kind: Literal["train"]
    model_id: ResourceId
    dataset_id: ResourceId
    params: TrainParams = Field(default_factory=TrainParams)
    max_attempts: MaxAttempts = DEFAULT_MAX_ATTEMPTS
    tags: JobTags = Field(default_factory=dict)
    priority: JobPriority = 0
    timeout_s: JobTimeout = None
