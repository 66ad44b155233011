"""Jobs: what a client asks for, what it sees, and what a worker receives.

- :mod:`api_schemas.jobs.kinds` — the job-kind table (NOTE [ The job-kind table ]);
- :mod:`api_schemas.jobs.adapt`, :mod:`~api_schemas.jobs.train`,
  :mod:`~api_schemas.jobs.evaluate` — each kind's parameters and request; the estimator table
  is in ``adapt`` (NOTE [ The estimator table ]);
- :mod:`api_schemas.jobs.params` — what every kind shares: the base classes of its params and
  request (NOTE [ Shared job fields ]) and the pieces they are made of;
- :mod:`api_schemas.jobs.public` — the job record, its progress and the worker's payload.
"""

from api_schemas.jobs.adapt import (
    ESTIMATOR_NAMES,
    ESTIMATORS,
    AdaptJobCreate,
    AdaptParams,
    EstimatorName,
    EstimatorSpec,
)
from api_schemas.jobs.evaluate import EvaluateJobCreate, EvaluateParams
from api_schemas.jobs.kinds import (
    JOB_KINDS,
    AnyJobCreate,
    JobCreate,
    JobKind,
    JobKindSpec,
    JobParams,
    parse_job_create,
)
from api_schemas.jobs.params import (
    DEFAULT_MAX_ATTEMPTS,
    DEVICE_PATTERN,
    MAX_BATCH_SIZE,
    MAX_SHARDS,
    BaseJobCreate,
    BaseJobParams,
    CheckpointPolicy,
    ModelJobParams,
    ModulePattern,
    num_batches,
)
from api_schemas.jobs.public import (
    EpochEvent,
    JobAttempt,
    JobPayload,
    JobPayloadDataset,
    JobPayloadModel,
    JobPublic,
    JobResultLinks,
    JobStatus,
    Progress,
)
from api_schemas.jobs.train import TrainJobCreate, TrainParams

__all__ = [
    "DEFAULT_MAX_ATTEMPTS",
    "DEVICE_PATTERN",
    "ESTIMATORS",
    "ESTIMATOR_NAMES",
    "JOB_KINDS",
    "MAX_BATCH_SIZE",
    "MAX_SHARDS",
    "AdaptJobCreate",
    "AdaptParams",
    "AnyJobCreate",
    "BaseJobCreate",
    "BaseJobParams",
    "CheckpointPolicy",
    "EpochEvent",
    "EstimatorName",
    "EstimatorSpec",
    "EvaluateJobCreate",
    "EvaluateParams",
    "JobAttempt",
    "JobCreate",
    "JobKind",
    "JobKindSpec",
    "JobParams",
    "JobPayload",
    "JobPayloadDataset",
    "JobPayloadModel",
    "JobPublic",
    "JobResultLinks",
    "JobStatus",
    "ModelJobParams",
    "ModulePattern",
    "Progress",
    "TrainJobCreate",
    "TrainParams",
    "num_batches",
    "parse_job_create",
]
