"""The job-kind table: what each kind of job takes and which worker function runs it.

NOTE [ The job-kind table ]
:data:`JOB_KINDS` is the one list of job kinds. The API validates a job's body by it (the
``kind`` picks the request and params classes), the worker runs its ``runner`` (a
``module:function`` path, imported by the worker only, so the API never imports torch), and
the CLI offers its names. A new kind is its schema module (params + create request, derived
from the bases of NOTE [ Shared job fields ] in api_schemas/jobs/params.py), its runner (the
module its row names), and one row here: ``JobKind``, ``JobParams`` and ``AnyJobCreate`` are
built from the rows (NOTE [ Types read from the table ]), the OpenAPI document's job schemas
and the texts about kinds are written from them, and the web UI reads the kinds from that
document.

NOTE [ Types read from the table ]
At run time ``JobKind`` is the ``Literal`` of the table's names and ``JobParams`` and
``AnyJobCreate`` are the unions of its ``params`` and ``create`` classes, in the table's order
(which is the order the OpenAPI document lists them in). A type checker cannot read a dict, so
under ``TYPE_CHECKING`` they are what every kind derives from: ``str``, ``BaseJobParams`` and
``BaseJobCreate`` (NOTE [ Shared job fields ] in api_schemas/jobs/params.py), which the row's
classes are typed as. Code that needs one kind's fields narrows with ``isinstance``
(``AdaptParams``, ...), and code that needs the fields of every kind that changes a model,
with ``ModelJobParams``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Final, Literal, Union

from pydantic import Field, TypeAdapter, ValidationInfo

from api_schemas.common import RequestModel
from api_schemas.jobs.adapt import AdaptJobCreate, AdaptParams
from api_schemas.jobs.evaluate import EvaluateJobCreate, EvaluateParams
from api_schemas.jobs.params import BaseJobCreate, BaseJobParams
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


@dataclass(frozen=True)
class JobKindSpec:
    """One kind's row; see NOTE [ The job-kind table ]."""

    summary: str
    create: type[BaseJobCreate]
    params: type[BaseJobParams]
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
        "workers.kinds.adapt:run",
        registers_model=True,
        needs_labels=False,
    ),
    "train": JobKindSpec(
        "train all parameters on a labelled dataset",
        TrainJobCreate,
        TrainParams,
        "workers.kinds.train:run",
        registers_model=True,
        needs_labels=True,
    ),
    "evaluate": JobKindSpec(
        "measure accuracy (or MSE) and loss on a labelled dataset; registers nothing",
        EvaluateJobCreate,
        EvaluateParams,
        "workers.kinds.evaluate:run",
        registers_model=False,
        needs_labels=True,
    ),
}


if TYPE_CHECKING:
    JobKind = str
    JobParams = BaseJobParams
    AnyJobCreate = BaseJobCreate
else:
    JobKind = Literal[tuple(JOB_KINDS)]
    JobParams = Union[tuple(spec.params for spec in JOB_KINDS.values())]  # noqa: UP007
    AnyJobCreate = Union[tuple(spec.create for spec in JOB_KINDS.values())]  # noqa: UP007

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
