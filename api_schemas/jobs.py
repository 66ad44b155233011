"""Jobs: what a client asks for, what it sees, and what a worker receives."""

from enum import StrEnum
from typing import Annotated, Any, Final, Literal, Self, assert_never, get_args

from pydantic import (
    BaseModel,
    Field,
    StringConstraints,
    TypeAdapter,
    ValidationInfo,
    field_validator,
    model_validator,
)

from api_schemas.architectures import ArchitectureKwargs, ArchitectureName
from api_schemas.common import RequestModel, ResourceId, Sha256Hex, UtcDatetime
from api_schemas.datasets import ArrayFormat
from api_schemas.models import Seed

__all__ = [
    "DEFAULT_MAX_ATTEMPTS",
    "DEVICE_PATTERN",
    "ESTIMATOR_NAMES",
    "MAX_BATCH_SIZE",
    "MAX_SHARDS",
    "AdaptJobCreate",
    "AdaptParams",
    "CheckpointPolicy",
    "EstimatorName",
    "EvaluateJobCreate",
    "EvaluateParams",
    "JobAttempt",
    "JobCreate",
    "JobKind",
    "JobParams",
    "JobPayload",
    "JobPayloadDataset",
    "JobPayloadModel",
    "JobPublic",
    "JobResultLinks",
    "JobStatus",
    "ModulePattern",
    "Progress",
    "TrainJobCreate",
    "TrainParams",
    "num_batches",
    "parse_job_create",
]

JobKind = Literal["adapt", "train", "evaluate"]

# The one place estimator names live; AdaptParams.effective_reset must then say whether a new
# one starts from fresh statistics (mypy flags the missing case).
EstimatorName = Literal["ema", "cumulative", "precise", "prior", "entropy"]
ESTIMATOR_NAMES: Final[tuple[EstimatorName, ...]] = get_args(EstimatorName)

MAX_BATCH_SIZE: Final = 65536
# Shards of one adapt job; each is an RQ job with its statistics in Redis (see workers/shards.py).
MAX_SHARDS: Final = 256
# How many times a job runs when its runs are interrupted (its process killed, its heartbeat
# lost); a job that fails for its own reasons (bad data, NaN) runs once.
DEFAULT_MAX_ATTEMPTS: Final = 3
MAX_ATTEMPTS: Final = 10
MaxAttempts = Annotated[int, Field(ge=1, le=MAX_ATTEMPTS)]


def num_batches(num_samples: int, batch_size: int, max_batches: int | None = None) -> int:
    """How many batches a job runs over ``num_samples``: whole batches of ``batch_size`` in
    order, the last one possibly short, at most ``max_batches``."""
    count = -(-num_samples // batch_size)
    return count if max_batches is None else min(count, max_batches)


BatchSize = Annotated[int, Field(ge=1, le=MAX_BATCH_SIZE)]

DEVICE_PATTERN: Final = r"^(auto|cpu|mps|cuda(:[0-9]{1,2})?)$"
Device = Annotated[str, StringConstraints(pattern=DEVICE_PATTERN)]

# An fnmatch pattern on qualified module names (`layer1.*`) or a module class name.
ModulePattern = Annotated[str, StringConstraints(min_length=1, max_length=256)]
PatternList = Annotated[list[ModulePattern], Field(max_length=256)]


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


class CheckpointPolicy(RequestModel):
    """Which modules run under activation checkpointing. ``blocks`` wraps the blocks the
    architecture names; ``modules`` and ``types`` add modules by qualified name pattern or by
    class name."""

    preset: Literal["none", "blocks"] = "blocks"
    modules: PatternList = Field(default_factory=list)
    types: PatternList = Field(default_factory=list)
    offload_to_cpu: bool = False


class AdaptParams(RequestModel):
    """Re-estimate normalization statistics on a dataset.

    Estimators: ``ema`` (the layers' own momentum), ``cumulative`` (equal-weight average of
    batch statistics, as ``update_bn``), ``precise`` (mean and variance of all activations,
    whatever the batch split), ``prior`` (``prior_base`` target statistics mixed with the
    source ones: weight ``prior_strength / (prior_strength + n)`` on the source, ``n`` the
    number of target samples) and ``entropy`` (TENT: ``steps`` optimizer steps with ``lr`` on
    the layers' affine parameters, minimising prediction entropy; ``steps=None`` is one pass).
    All but ``entropy`` use forward passes only.

    ``reset=None`` means the estimator's default, see :meth:`effective_reset`. ``include`` and
    ``exclude`` select normalization layers by qualified name (fnmatch).

    ``shards=K`` splits the batches into K contiguous runs of whole batches, collected by K
    jobs that may run on different workers and then merged: the same result as one worker
    (up to float rounding). Only for ``precise``, ``cumulative`` and ``prior``, whose result
    is a function of pooled per-batch statistics.

    ``layerwise`` (``precise`` only) estimates one layer at a time in forward order, the layers
    before it already adapted and in eval mode: every layer's statistics then do not depend on
    how the data is split into batches (one pass estimates all layers at once, each normalizing
    with its batch statistics, so a layer's input depends a little on the batch size), at the
    cost of one pass over the data per layer."""

    batch_size: BatchSize = 64
    max_batches: int | None = Field(default=None, ge=1)
    estimator: EstimatorName = "cumulative"
    reset: bool | None = None
    include: Annotated[list[ModulePattern], Field(min_length=1, max_length=256)] = Field(
        default_factory=lambda: ["*"]
    )
    exclude: PatternList = Field(default_factory=list)
    prior_strength: float = Field(default=16.0, ge=0.0, allow_inf_nan=False)
    prior_base: Literal["precise", "cumulative"] = "precise"
    lr: float = Field(default=1e-3, gt=0.0, allow_inf_nan=False)
    steps: int | None = Field(default=None, ge=1)
    optimizer: Literal["sgd", "adam"] = "adam"
    checkpoint: CheckpointPolicy = Field(default_factory=CheckpointPolicy)
    seed: Seed = 0
    device: Device = "auto"
    shards: int = Field(default=1, ge=1, le=MAX_SHARDS)
    layerwise: bool = False

    @model_validator(mode="after")
    def _layerwise_fits(self) -> Self:
        if self.layerwise and self.estimator != "precise":
            raise ValueError(
                f"layerwise is an option of the precise estimator, not of {self.estimator}; "
                "use estimator 'precise', or drop layerwise"
            )
        if self.layerwise and self.shards > 1:
            raise ValueError(
                "layerwise estimates one layer after another, each pass starting from the "
                "layers before it, so it cannot be split into shards; use shards=1, or drop "
                "layerwise (one pass, which shards can split)"
            )
        return self

    @model_validator(mode="after")
    def _shards_fit_estimator(self) -> Self:
        if self.shards > 1 and self.estimator in ("ema", "entropy"):
            how = (
                "each batch updates the statistics the next batch starts from"
                if self.estimator == "ema"
                else "each optimizer step starts from the parameters the previous one made"
            )
            raise ValueError(
                f"the {self.estimator} estimator is sequential ({how}), so its batches cannot "
                f"be split across {self.shards} workers; use shards=1, or estimator 'precise', "
                "'cumulative' or 'prior', whose statistics shards can collect apart"
            )
        return self

    @model_validator(mode="after")
    def _reset_fits_estimator(self) -> Self:
        if self.estimator in ("cumulative", "precise", "prior") and self.reset is False:
            raise ValueError(
                f"the {self.estimator} estimator replaces the statistics with ones computed "
                "from the target data; drop reset, or use estimator 'ema' to blend into the "
                "current statistics"
            )
        return self

    def effective_reset(self) -> bool:
        """Whether the running statistics are cleared before the first batch."""
        if self.reset is not None:
            return self.reset
        estimator = self.estimator
        match estimator:
            case "cumulative" | "precise" | "prior":
                # Statistics computed from the target data replace the source ones (prior
                # mixes the source ones back in afterwards, from a copy taken before).
                return True
            case "ema" | "entropy":
                # Both blend target batches, with the layers' momentum, into the source
                # statistics they start from.
                return False
            case _:
                assert_never(estimator)


class TrainParams(RequestModel):
    """Train all parameters with a plain optimizer. ``loss=None`` picks cross-entropy for class
    labels and MSE for float targets."""

    epochs: int = Field(default=1, ge=1, le=1000)
    batch_size: BatchSize = 64
    optimizer: Literal["sgd", "adamw"] = "sgd"
    lr: float = Field(default=0.05, gt=0.0)
    momentum: float = Field(default=0.9, ge=0.0, lt=1.0)
    weight_decay: float = Field(default=0.0, ge=0.0)
    loss: Literal["cross_entropy", "mse"] | None = None
    validation_fraction: float = Field(default=0.1, ge=0.0, le=0.9)
    checkpoint: CheckpointPolicy = Field(default_factory=CheckpointPolicy)
    seed: Seed = 0
    device: Device = "auto"


class EvaluateParams(RequestModel):
    """Measure a model on a labelled dataset, changing nothing: eval mode, no gradients.
    ``loss=None`` picks cross-entropy (and accuracy) for class labels and MSE for float
    targets."""

    batch_size: BatchSize = 512
    loss: Literal["cross_entropy", "mse"] | None = None
    device: Device = "auto"


JobParams = AdaptParams | TrainParams | EvaluateParams
_PARAMS_BY_KIND: Final[dict[str, type[JobParams]]] = {
    "adapt": AdaptParams,
    "train": TrainParams,
    "evaluate": EvaluateParams,
}


def _params_for_kind(value: Any, info: ValidationInfo) -> Any:
    """Validates ``params`` as the class that ``kind`` names.

    Left to a plain union, params that only use shared fields (``{"batch_size": 8}``) would
    validate as either class, and errors would be reported twice, once per class.
    """
    expected = _PARAMS_BY_KIND.get(info.data.get("kind", ""))
    if expected is None:
        return value  # `kind` itself failed; its error is already reported
    if isinstance(value, AdaptParams | TrainParams | EvaluateParams):
        if not isinstance(value, expected):
            raise ValueError(
                f"params are {type(value).__name__} but kind is {info.data['kind']!r}; "
                f"pass {expected.__name__}"
            )
        return value
    return expected.model_validate(value)


class AdaptJobCreate(RequestModel):
    """Asks for BatchNorm adaptation of a model on a dataset."""

    kind: Literal["adapt"]
    model_id: ResourceId
    dataset_id: ResourceId
    params: AdaptParams = Field(default_factory=AdaptParams)
    max_attempts: MaxAttempts = DEFAULT_MAX_ATTEMPTS


class TrainJobCreate(RequestModel):
    """Asks for training of a model on a labelled dataset."""

    kind: Literal["train"]
    model_id: ResourceId
    dataset_id: ResourceId
    params: TrainParams = Field(default_factory=TrainParams)
    max_attempts: MaxAttempts = DEFAULT_MAX_ATTEMPTS


class EvaluateJobCreate(RequestModel):
    """Asks for the accuracy (or MSE) and loss of a model on a labelled dataset; no new model
    is registered."""

    kind: Literal["evaluate"]
    model_id: ResourceId
    dataset_id: ResourceId
    params: EvaluateParams = Field(default_factory=EvaluateParams)
    max_attempts: MaxAttempts = DEFAULT_MAX_ATTEMPTS


_AnyJobCreate = AdaptJobCreate | TrainJobCreate | EvaluateJobCreate
JobCreate = Annotated[_AnyJobCreate, Field(discriminator="kind")]
_JOB_CREATE: Final[TypeAdapter[_AnyJobCreate]] = TypeAdapter(JobCreate)


def parse_job_create(data: object) -> _AnyJobCreate:
    """Validates a decoded JSON body as one of the job requests, chosen by its ``kind``.

    Strict: a JSON string is never coerced into a number or a boolean (``"batch_size": "64"``
    is an error, not 64), so what runs is what the client sent. Raises pydantic's
    ``ValidationError``.
    """
    return _JOB_CREATE.validate_python(data, strict=True)


class Progress(BaseModel):
    """How far a running job is; written by the worker, best effort."""

    done: int = Field(ge=0)
    total: int = Field(ge=0)
    unit: Literal["batches", "steps"]
    samples_per_second: float = Field(ge=0.0)
    eta_seconds: float | None = Field(default=None, ge=0.0)
    phase: str
    updated_at: UtcDatetime


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

    @field_validator("params", mode="before")
    @classmethod
    def _params_match_kind(cls, value: Any, info: ValidationInfo) -> Any:
        return _params_for_kind(value, info)


class JobPayloadModel(RequestModel):
    """The input model as a worker needs it: enough to rebuild it and fetch its weights."""

    id: ResourceId
    architecture: ArchitectureName
    kwargs: ArchitectureKwargs
    weights_sha256: Sha256Hex


class JobPayloadDataset(RequestModel):
    """The dataset as a worker needs it."""

    id: ResourceId
    sha256: Sha256Hex
    format: ArrayFormat


class JobPayload(RequestModel):
    """What the service enqueues for a worker (as JSON). Strict like a request: a field the
    worker does not know means the two sides disagree on the contract."""

    job_id: ResourceId
    tenant_id: ResourceId
    kind: JobKind
    model: JobPayloadModel
    dataset: JobPayloadDataset
    params: JobParams

    @field_validator("params", mode="before")
    @classmethod
    def _params_match_kind(cls, value: Any, info: ValidationInfo) -> Any:
        return _params_for_kind(value, info)
