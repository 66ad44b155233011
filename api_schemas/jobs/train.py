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

__all__ = ["MAX_EPOCHS", "MAX_PROCESSES", "TrainJobCreate", "TrainParams"]

# NOTE [ Job bounds ] in api_schemas/jobs/params.py.
MAX_EPOCHS: Final = 1000
MAX_WEIGHT_DECAY: Final = 1.0
# Ranks of one train job on one worker (docs/distributed.md): on CUDA one a GPU, so a worker
# runs at most as many as it serves GPUs (the job fails saying so beyond); on the CPU one a
# share of the worker's cores. 8 is the GPUs of one large machine.
MAX_PROCESSES: Final = 8


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
    # Data parallelism (docs/distributed.md): kept together, checked by _ranks_fit.
    processes: int = Field(
        default=1,
        ge=1,
        le=MAX_PROCESSES,
        description=f"Ranks of the job on one worker, 1 to {MAX_PROCESSES}: one a GPU on CUDA "
        "(at most the worker's GPUs), gloo processes on the CPU. Each global batch of "
        "batch_size is split into processes slices of batch_size / processes (it must divide); "
        "gradients are averaged over the ranks (DDP), BatchNorm statistics are rank 0's.",
    )
    sync_batchnorm: bool = Field(
        default=False,
        description="Convert BatchNorm to SyncBatchNorm: statistics over the whole global "
        "batch, all ranks together. Needs device 'cuda' (torch's SyncBatchNorm runs on GPUs "
        "only); with processes 1 it changes nothing.",
    )

    @model_validator(mode="after")
    def _compile_backend_fits(self) -> Self:
        compile_backend_fits(self.compile, self.compile_backend)
        return self

    @model_validator(mode="after")
    def _ranks_fit(self) -> Self:
        if self.batch_size % self.processes:
            raise ValueError(
                f"batch_size {self.batch_size} does not split into processes={self.processes} "
                "equal slices; use a batch_size that is a multiple of processes (e.g. "
                f"{self.batch_size - self.batch_size % self.processes or self.processes})"
            )
        if self.processes > 1 and self.batch_size // self.processes < 2:
            raise ValueError(
                f"batch_size {self.batch_size} over processes={self.processes} leaves "
                f"{self.batch_size // self.processes} sample per rank, and BatchNorm in train "
                f"mode needs at least 2; use batch_size >= {2 * self.processes}"
            )
        if self.processes > 1 and self.device.startswith("cuda:"):
            raise ValueError(
                f"device {self.device!r} names one GPU, but processes={self.processes} runs "
                "one rank a GPU; use device 'cuda' or 'auto'"
            )
        if self.processes > 1 and self.compile:
            raise ValueError(
                "compile is not offered with processes > 1 yet; submit with compile: false "
                "or processes: 1"
            )
        if self.sync_batchnorm and not self.device.startswith("cuda"):
            raise ValueError(
                f"sync_batchnorm needs device 'cuda', got {self.device!r}: torch's "
                "SyncBatchNorm runs on GPUs only, and 'auto' may run on a CPU worker; submit "
                "with device 'cuda', or without sync_batchnorm"
            )
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
