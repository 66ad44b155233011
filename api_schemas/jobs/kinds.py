"""The job-kind table: what each kind of job takes and which worker function runs it.

NOTE [ The job-kind table ]
:data:`JOB_KINDS` is the one list of job kinds. The API validates a job's body by it (the
``kind`` picks the request and params classes), the worker runs its ``runner`` (a
``module:function`` path, imported by the worker only, so the API never imports torch), and
the CLI offers its names. A new kind is its schema module (params + create request), its
runner under workers/running/, and one row here (its classes join the unions below).
"""

from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal, get_args

from pydantic import Field, TypeAdapter, ValidationInfo

from api_schemas.common import RequestModel
from api_schemas.jobs.adapt import AdaptJobCreate, AdaptParams
from api_schemas.jobs.evaluate import EvaluateJobCreate, EvaluateParams
from api_schemas.jobs.train import TrainJobCreate, TrainParams

__all__ = [
    "JOB_KINDS",
    "AnyJobCreate",
    "JobCreate",
    "JobKind",
    "JobKindSpec",
    "JobParams",
    "params_for_kind",
    "parse_job_create",
]

JobKind = Literal["adapt", "train", "evaluate"]
JobParams = AdaptParams | TrainParams | EvaluateParams
AnyJobCreate = AdaptJobCreate | TrainJobCreate | EvaluateJobCreate


@dataclass(frozen=True)
class JobKindSpec:
    """One kind's row; see NOTE [ The job-kind table ]."""

    summary: str
    create: type[RequestModel]
    params: type[RequestModel]
    # `module:function` the worker calls with (payload, records, store, settings).
    runner: str
    # Whether a succeeded job registers a new model (else its report is the whole result).
    registers_model: bool
    needs_labels: bool


JOB_KINDS: Final[dict[str, JobKindSpec]] = {
    "adapt": JobKindSpec(
        "re-estimate BatchNorm statistics on a dataset (labels optional)",
        AdaptJobCreate,
        AdaptParams,
        "workers.running.kinds.adapt:run",
        registers_model=True,
        needs_labels=False,
    ),
    "train": JobKindSpec(
        "train all parameters on a labelled dataset",
        TrainJobCreate,
        TrainParams,
        "workers.running.kinds.train:run",
        registers_model=True,
        needs_labels=True,
    ),
    "evaluate": JobKindSpec(
        "measure accuracy (or MSE) and loss on a labelled dataset; registers nothing",
        EvaluateJobCreate,
        EvaluateParams,
        "workers.running.kinds.evaluate:run",
        registers_model=False,
        needs_labels=True,
    ),
}
assert set(JOB_KINDS) == set(get_args(JobKind)), "JobKind and JOB_KINDS name the same kinds"

JobCreate = Annotated[AnyJobCreate, Field(discriminator="kind")]
_JOB_CREATE: Final[TypeAdapter[AnyJobCreate]] = TypeAdapter(JobCreate)


def parse_job_create(data: object) -> AnyJobCreate:
    """Validates a decoded JSON body as one of the job requests, chosen by its ``kind``.

    Strict: a JSON string is never coerced into a number or a boolean (``"batch_size": "64"``
    is an error, not 64), so what runs is what the client sent. Raises pydantic's
    ``ValidationError``.
    """
    return _JOB_CREATE.validate_python(data, strict=True)


def params_for_kind(value: Any, info: ValidationInfo) -> Any:
    """Validates ``params`` as the class that ``kind`` names.

    Left to a plain union, params that only use shared fields (``{"batch_size": 8}``) would
    validate as either class, and errors would be reported twice, once per class.
    """
    spec = JOB_KINDS.get(info.data.get("kind", ""))
    if spec is None:
        return value  # `kind` itself failed; its error is already reported
    expected = spec.params
    if isinstance(value, RequestModel):
        if not isinstance(value, expected):
            raise ValueError(
                f"params are {type(value).__name__} but kind is {info.data['kind']!r}; "
                f"pass {expected.__name__}"
            )
        return value
    return expected.model_validate(value)
