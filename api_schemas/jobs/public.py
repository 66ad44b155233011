"""Jobs as the API shows them and as a worker receives them."""

from enum import StrEnum
from typing import Any, Literal, Self

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator

from api_schemas.architectures import ArchitectureKwargs, ArchitectureName
from api_schemas.common import RequestModel, ResourceId, Sha256Hex, UtcDatetime
from api_schemas.datasets import ArrayFormat, LabelKind, Preprocessing, SampleDtype
from api_schemas.jobs.kinds import JobKind, JobParams, params_for_kind
from api_schemas.jobs.params import JobPriority, JobTags, MaxAttempts
from api_schemas.models import ActivationFootprint

__all__ = [
    "JobAttempt",
    "JobLogEntry",
    "JobLogPage",
    "JobPayload",
    "JobPayloadDataset",
    "JobPayloadModel",
    "JobPublic",
    "JobResultLinks",
    "JobStatus",
    "Progress",
]


class JobStatus(StrEnum):
    """Life cycle: queued -> running -> one of succeeded, failed, canceled."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELED = "canceled"

    @property
    def is_terminal(self) -> bool:
        """Whether the job has ended and will not change again."""
        return self not in (JobStatus.QUEUED, JobStatus.RUNNING)


class Progress(BaseModel):
    """How far a running job is; written by the worker, best effort."""

    done: int = Field(ge=0)
    total: int = Field(ge=0)
    unit: Literal["batches", "steps"]
    samples_per_second: float = Field(ge=0.0)
    eta_seconds: float | None = Field(default=None, ge=0.0)
    phase: str
    updated_at: UtcDatetime


class EpochEvent(BaseModel):
    """One epoch of a train job, validated: the data of the ``epoch`` event of
    ``GET /v1/jobs/{id}/events``, sent once an epoch in epoch order; the same numbers as the
    report's ``epochs`` entry."""

    epoch: int = Field(ge=1, description="The epoch, from 1.")
    epochs: int = Field(ge=1, description="The job's epochs in all.")
    train_loss: float = Field(description="Mean training loss over the epoch's samples.")
    val_loss: float | None = Field(description="Validation loss; null without validation.")
    val_accuracy: float | None = Field(
        ge=0.0, le=1.0, description="Validation accuracy; null without validation or for mse."
    )
    lr: float | None = Field(description="The learning rate of the epoch's last step.")
    best: bool = Field(
        description="The lowest validation loss so far (the epoch keep_best would keep); "
        "false without validation."
    )


class JobResultLinks(BaseModel):
    """Where a succeeded job's output lives. ``adapt`` and ``train`` jobs register a new model:
    ``model_id`` and ``weights_url`` name it. ``evaluate`` jobs register none: both are
    ``null`` (always present, never omitted) and the report holds the result."""

    model_id: ResourceId | None
    weights_url: str | None
    report_url: str

    @model_validator(mode="after")
    def _model_fields_together(self) -> Self:
        if (self.model_id is None) != (self.weights_url is None):
            raise ValueError(
                f"model_id ({self.model_id!r}) and weights_url ({self.weights_url!r}) are "
                "either both set (a new model) or both null (an evaluate job)"
            )
        return self


class JobAttempt(BaseModel):
    """A run of a job that was interrupted (its process died, its heartbeat was lost); the job
    ran again after it unless it was the last of ``max_attempts``."""

    attempt: int = Field(ge=1)
    worker: str | None = None
    ended_at: UtcDatetime
    reason: str


class JobPublic(BaseModel):
    """A job as the API shows it. ``attempts`` lists the interrupted runs, oldest first."""

    id: ResourceId
    kind: JobKind
    status: JobStatus
    model_id: ResourceId
    dataset_id: ResourceId
    params: JobParams
    created_at: UtcDatetime
    started_at: UtcDatetime | None = None
    finished_at: UtcDatetime | None = None
    progress: Progress | None = None
    error: str | None = None
    result: JobResultLinks | None = None
    max_attempts: MaxAttempts = 1
    attempts: list[JobAttempt] = Field(default_factory=list)
    tags: JobTags = Field(default_factory=dict)
    priority: JobPriority = 0
    timeout_s: int | None = Field(
        default=None,
        ge=1,
        description="The seconds each run of the job may take: its own timeout_s, or the "
        "service's default when it was submitted (null for jobs of releases before).",
    )

    @field_validator("params", mode="before")
    @classmethod
    def _params_match_kind(cls, value: Any, info: ValidationInfo) -> Any:
        return params_for_kind(value, info)


class JobPayloadModel(RequestModel):
    """The input model as a worker needs it: enough to rebuild it and fetch its weights."""

    id: ResourceId
    architecture: ArchitectureName
    kwargs: ArchitectureKwargs
    weights_sha256: Sha256Hex
    # Copied to the model a job registers (the same architecture and kwargs).
    activations: ActivationFootprint | None = None


class JobPayloadDataset(RequestModel):
    """The dataset as a worker needs it, with the facts the API found when it was uploaded,
    so that no worker reads a whole dataset to plan. The facts are null in payloads enqueued
    by releases that did not send them; a worker then reads them from the file."""

    id: ResourceId
    sha256: Sha256Hex
    format: ArrayFormat
    num_samples: int | None = Field(default=None, ge=1)
    sample_shape: list[int] | None = None
    dtype: SampleDtype | None = None
    has_labels: bool | None = None
    label_kind: LabelKind | None = None
    num_classes: int | None = Field(default=None, ge=1)
    preprocessing: Preprocessing | None = None


class JobPayload(RequestModel):
    """What the service enqueues for a worker (as JSON). Strict like a request: a field the
    worker does not know means the two sides disagree on the contract."""

    job_id: ResourceId
    tenant_id: ResourceId
    kind: JobKind
    model: JobPayloadModel
    dataset: JobPayloadDataset
    params: JobParams
    # Which of the tenant's queues its retries and children wait in (0 in payloads of
    # releases without priorities).
    priority: JobPriority = 0
    # The seconds each attempt may run (JobPublic.timeout_s); null in payloads of releases
    # before: the service's default.
    timeout_s: int | None = Field(default=None, ge=1)
    # A train job with `resume_from`: the training checkpoint it starts from, the latest of
    # that job when this one was submitted (NOTE [ Train checkpoint records ]).
    resume_sha256: Sha256Hex | None = None

    @field_validator("params", mode="before")
    @classmethod
    def _params_match_kind(cls, value: Any, info: ValidationInfo) -> Any:
        return params_for_kind(value, info)


class JobLogEntry(BaseModel):
    """One line a job's process logged (a warning, the traceback of a failure, a phase).
    ``seq`` counts the job's entries from 1 over its whole life; only the latest few hundred
    are kept. ``part``: which part of a sharded adapt job logged it (``shard-0``, ``merge``,
    ``eval-0``, ``finish``...; NOTE [ Sharded adaptation ]); null for the job's own process."""

    seq: int = Field(ge=1)
    at: UtcDatetime
    level: str
    logger: str
    message: str
    part: str | None = None


class JobLogPage(BaseModel):
    """The kept log entries after ``after``; pass ``last_seq`` as ``after`` to read on."""

    items: list[JobLogEntry]
    last_seq: int = Field(ge=0)
